"""Run model-written Python in a contained child process: `run_python(code) -> Execution`.

Each execution gets a fresh interpreter (`python -P -s -S -B`: no site-packages, no script directory on the
path, no bytecode written) that never loads ctypes, in its own process group and session, a fresh temporary
directory as its working directory (deleted afterwards), a minimal environment (HOME and TMPDIR are that
directory, PATH=/usr/bin:/bin, LANG=C.UTF-8, PYTHONHASHSEED=0: nothing of the caller's, so no tokens or keys),
the given stdin, and these layers, the strongest this machine supports (`isolation()` names them; probed once
per process; for a root caller the namespaces layer comes before bwrap, which binds the host's device nodes
writable):

- **bwrap** (when `bwrap` is on PATH and works): bubblewrap's user, pid, network, IPC, UTS and mount
  namespaces; a read-only root with only /usr (and the /bin, /lib… links), the Python installation,
  /etc/ld.so.cache and /etc/localtime, its own read-only /proc and /dev (the device nodes bound writable), an
  empty /tmp, and the working
  directory (a `file_mb` tmpfs, the only writable place); no capabilities, no further user namespaces, the
  seccomp filter; bwrap dies with its parent.
- **namespaces** (else, when unprivileged user namespaces work): the same, built by a setup interpreter
  (grpo/sandbox/setup.py): new namespaces, a new root it pivots into, then a second user and mount namespace
  that locks every mount (no unmount, no clearing of read-only), then no capabilities (bounding set and secure
  bits included), no_new_privs, the filter, and execve of the interpreter that runs the code. A monitor
  outside the pid namespace kills the sandbox at the deadline even if the caller died.
- **rlimits**, always: address space (`memory_mb`), CPU time (`cpu_s`), file size (`file_mb`), 64 open files,
  no core dumps, and under bwrap or namespaces 64 processes and threads. Without a kernel layer the setup
  interpreter still drops the capabilities it may, sets no_new_privs and installs the filter.
- **seccomp filter** (grpo/sandbox/seccomp.py), in every layer on x86_64 and aarch64: no mounts, namespaces,
  ptrace or process_vm_*, keyrings, bpf, perf, io_uring, memfd_create or System V shared memory (memory the
  address-space limit would not count), no socket() (socketpair(AF_UNIX) aside); another ABI's system calls kill
  the process.
- **guard**, always: an audit hook installed before the code runs refuses, with PermissionError("sandbox: …")
  and status "blocked": creating processes, signalling any process but itself, sockets, ctypes,
  sub-interpreters, adding audit hooks, changing resource limits, listing the interpreter's objects (gc),
  changing the guard's own functions, links and symlinks, changing directory, writing or changing anything
  outside the working directory, reading or listing anything outside it and Python's standard library, opening
  devices or outside directories, loading native code from outside the standard library, and importing the
  modules that exist for those things. The hook looks up no global name and holds no mutable state, so patching
  builtins or modules cannot change it. Unaudited functions that act on other processes or the machine, or make
  special files or uncounted memory, are deleted. The guard is a layer, not the wall: crafted bytecode can
  switch it off, and then the kernel layers hold by themselves.

Where no kernel layer works, `run_python` (and `ensure_available()`, which the python tool calls when it is built)
raises `SandboxUnavailable` unless GRPO_SANDBOX_RLIMITS_ONLY=1 accepts the guard as the only file wall. The parent
keeps the first `output_chars` characters of stdout and the last `output_chars` of stderr, kills the child past 1
MiB of output, at the deadline, and in the end kills the whole process group. The exit status and CPU time come from
the kernel; the report pipe (refusals, memory errors) can only add failures: a refusal that cannot be reported ends
the process, and a pipe closed, replaced or written to by the code fails the run. The child ends with os._exit, so
no finaliser runs after the audit hooks are cleared. What each layer stops, measured, and what none does:
docs/sandbox.md.
"""
from grpo.sandbox.parent import (STATUSES, Execution, Limits, SandboxUnavailable, ensure_available, isolation,
                                 python_tool_result, run_python)

__all__ = ["STATUSES", "Execution", "Limits", "SandboxUnavailable", "ensure_available", "isolation",
           "python_tool_result", "run_python"]
