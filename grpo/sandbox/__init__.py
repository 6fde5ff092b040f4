"""Run model-written Python in a contained child process: `run_python(code) -> Execution`.

Each execution gets a fresh interpreter (`python -P -s -S -B`: no site-packages, no script directory on the
path, no bytecode written) in its own process group and session, a fresh temporary directory as its working
directory (deleted afterwards), a minimal environment (HOME and TMPDIR are that directory, PATH=/usr/bin:/bin,
LANG=C.UTF-8, PYTHONHASHSEED=0: nothing of the caller's, so no tokens or keys), the given stdin, and these
layers, the strongest this machine supports (`isolation()` names them; probed once per process):

- **bwrap** (when `bwrap` is on PATH and works): bubblewrap's user, pid, network, IPC, UTS and mount namespaces;
  the new root holds only /usr (with /bin, /lib… links), the Python installation (read-only), a fresh /proc and
  /dev, an empty /tmp and the working directory, a size-limited tmpfs; bwrap dies with its parent.
- **namespaces** (else, when unprivileged user namespaces work): the child itself calls unshare(2) for new user,
  pid, network, mount, IPC and UTS namespaces. The sandboxed process is pid 1 of its pid namespace, so it cannot
  see or signal any process outside it; the network namespace has no interface up; every mount is remounted
  read-only, the system temporary directory, the caller's working directory (the run directory), its HOME and
  /dev/shm are hidden under empty read-only tmpfs mounts (each when it does not hold the Python installation),
  and the working directory is a size-limited tmpfs. A monitor process outside the pid namespace kills the
  sandbox at the deadline even if the caller died.
- **rlimits**, always: address space (`memory_mb`), CPU time (`cpu_s`), file size (`file_mb`), 64 open files,
  no core dumps, and under bwrap or namespaces (where they are counted per user namespace) 64 processes and
  threads, a limit the kernel does not apply to root.
- **guard**, always: an audit hook (`sys.addaudithook`; it cannot be removed) installed before the code runs
  refuses, with PermissionError("sandbox: …") and status "blocked": creating processes (fork, exec, spawn,
  system, posix_spawn, subprocess), signalling any process but itself, sockets, ctypes, sub-interpreters,
  changing resource limits, listing the interpreter's objects (gc), changing the guard's own functions, links
  and symlinks, changing directory, writing or changing anything outside the working directory (/dev/null,
  /dev/stdout and /dev/stderr excepted), reading or listing anything outside it and Python's standard library
  (site-packages excluded), opening devices or, outside the working directory, directories, loading native
  code from outside the standard library, and importing the modules that exist for those things (ctypes,
  socket, subprocess, multiprocessing, mmap, resource, gc, sqlite3, the _test* modules…). The hook looks up no
  global name and holds no mutable state, so patching builtins or modules cannot change it. Unaudited functions
  that act on other processes or the machine, or make special files (os.pidfd_open, signal.pidfd_send_signal,
  os.setpriority, os.sched_set*, time.clock_settime, os.mknod, os.mkfifo, os.chroot) are deleted, and with them
  _imp.create_builtin, which would make fresh copies of the modules that had them.

The parent keeps the first `output_chars` characters of stdout and the last `output_chars` of stderr (where a
traceback ends), reading at most 4 bytes a character into memory and discarding the rest; it kills the child
once it has written more than `_OUTPUT_KILL_BYTES` (status "output"), at the wall-clock deadline (status
"timeout"), and in the end kills the whole process group whatever happened.

What it does not protect against: this is not a VM. A kernel exploit escapes every layer. The guard is a
Python-level policy: crafted bytecode (marshal, code objects, `_imp`) or a CPython memory-safety bug can switch
it off, and then only the kernel layers hold; without them (isolation() == "rlimits+guard") such code can do
whatever the caller's user can. Without the mount namespace the guard is what keeps files private: anything the
caller's user can read through the allowed directories stays readable, and os.stat, os.access and os.readlink
(not audited) reveal what exists anywhere. As root, RLIMIT_NPROC does not apply; a fork bomb is stopped by the
guard (and the pid namespace and process-group kill clean up). Nothing limits CPU contention with the caller
(use `nice` or cgroups around the trainer), nor, in "rlimits+guard", disk use beyond `file_mb` a file. /proc of
the child's own pid namespace, the kernel version and the CPU count are visible. In the namespaces layer the code
is pid 1, so a signal it sends itself with no handler installed (os.kill(os.getpid(), SIGTERM)) is ignored, and
so is SIGXCPU: the CPU limit then kills it one second later.
See docs/sandbox.md.
"""
from grpo.sandbox.parent import STATUSES, Execution, Limits, isolation, python_tool_result, run_python

__all__ = ["STATUSES", "Execution", "Limits", "isolation", "python_tool_result", "run_python"]
