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
from __future__ import annotations

import codecs
import functools
import inspect
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

STATUSES = ("ok", "error", "timeout", "memory", "blocked", "output")
_OUTPUT_KILL_BYTES = 1 << 20   # stdout + stderr beyond this: the child is killed (status "output")
_TRUNCATED = "…[truncated]"
_TOOL_STDERR_LINES = 20        # python_tool_result shows this many of stderr's last lines


@dataclass(frozen=True)
class Limits:
    """What one execution may use. `timeout_s` is wall-clock time (the child is killed when it runs out);
    `cpu_s` is RLIMIT_CPU; `memory_mb` is RLIMIT_AS (address space, so it also bounds threads' stacks);
    `file_mb` is RLIMIT_FSIZE and, under bwrap or namespaces, the size of the working directory (a tmpfs);
    `output_chars` is how much of stdout and of stderr is kept."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_chars: int = 2000
    file_mb: int = 16

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s", "memory_mb", "output_chars", "file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, section) -> Limits:
        """The limits of a `sandbox.*` config section (`grpo.config.SandboxConfig`)."""
        return cls(timeout_s=section.timeout_s, cpu_s=section.cpu_s, memory_mb=section.memory_mb,
                   output_chars=section.output_chars, file_mb=section.file_mb)


@dataclass(frozen=True)
class Execution:
    """The outcome of one `run_python`.

    `status` is one of:
    - "ok": the code ran to the end (or called sys.exit(0)) and the guard refused nothing;
    - "error": a non-zero exit: an uncaught exception (traceback in stderr), a syntax error, sys.exit(n), or
      death by a signal (a crash);
    - "timeout": the wall-clock deadline (`timeout_s`) or the CPU-time limit (`cpu_s`) was reached;
    - "memory": the memory limit was reached (a MemoryError);
    - "blocked": the guard refused an operation (even if the code caught the PermissionError and went on);
    - "output": killed for writing more than `_OUTPUT_KILL_BYTES` of output.
    `stdout` keeps the first `output_chars` characters and `stderr` the last, "…[truncated]" marking what was
    dropped. `returncode` is the child's exit status (negative: killed by that signal; None: it did not start).
    `detail` says why in a few words ("timed out after 5 s", "blocked: network access is not allowed").
    """

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(code: str, *, stdin: str = "", limits: Limits = Limits()) -> Execution:
    """Run `code` as a Python program in a new sandboxed process (see the module docstring), with `stdin` as its
    standard input. Never raises for anything the code does; hostile code ends as a failed Execution."""
    return _run(code, stdin, limits, _layer())


def isolation() -> str:
    """The layers `run_python` uses on this machine: "bwrap+rlimits+guard", "namespaces+rlimits+guard" or
    "rlimits+guard" (probed once per process)."""
    return {"bwrap": "bwrap+rlimits+guard", "namespaces": "namespaces+rlimits+guard",
            "none": "rlimits+guard"}[_layer()]


def python_tool_result(execution: Execution) -> str:
    """The text a model sees as a `python` tool's result: stdout, then stderr's last lines, then, when the
    execution failed, why in brackets. Example: "3\\n[timed out after 5 s]"; "(no output)" when there is none."""
    parts = []
    if execution.stdout:
        parts.append(execution.stdout.rstrip("\n"))
    if execution.stderr.strip():
        lines = execution.stderr.rstrip("\n").splitlines()
        tail = lines[-_TOOL_STDERR_LINES:]
        parts.append("\n".join((["…"] if len(lines) > len(tail) else []) + tail))
    if not execution.ok:
        parts.append(f"[{execution.detail or execution.status}]")
    return "\n".join(parts) if parts else "(no output)"


# ---------------------------------------------------------------------------------------------------- layers

_LAYERS = ("bwrap", "namespaces", "none")
_probe_lock = threading.Lock()


@functools.cache
def _available(layer: str) -> bool:
    """Whether `layer` works here: a trivial program runs under it and reports its sandbox built."""
    if layer == "none":
        return True
    if layer == "bwrap" and shutil.which("bwrap") is None:
        return False
    result = _run("print('ok')", "", Limits(timeout_s=20.0), layer)
    return result.ok and result.stdout == "ok\n"


def _layer() -> str:
    """The strongest layer that works here, probed once (under a lock: rows of a batch start concurrently)."""
    with _probe_lock:
        return next(layer for layer in _LAYERS if _available(layer))


def _interpreter() -> str:
    """The base interpreter (a virtualenv's python would only add its site-packages, which -S drops anyway, and
    would put the virtualenv, often inside the run directory, on the sandbox's paths)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _needed_dirs() -> list[str]:
    """Directories the child's interpreter reads: its prefix (stdlib, libpython) and its binary's directory."""
    exe = _interpreter()
    return sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(exe))})


def _hidden_dirs() -> list[str]:
    """Directories the namespaces layer hides under empty tmpfs mounts: the system temporary directory, the
    caller's working directory (the run directory), HOME and /dev/shm, except those holding the interpreter."""
    needed = _needed_dirs()
    out: list[str] = []
    candidates = [tempfile.gettempdir(), os.path.expanduser("~"), "/dev/shm"]
    try:
        candidates.append(os.getcwd())
    except OSError:  # deleted under us: nothing there to hide
        pass
    for d in sorted({os.path.realpath(c) for c in candidates}, key=len):
        if d == "/" or not os.path.isdir(d) or any(_inside(n, d) for n in needed):
            continue
        if not any(_inside(d, h) for h in out):  # one inside another is hidden already
            out.append(d)
    return out


def _inside(path: str, d: str) -> bool:
    return path == d or path.startswith(d.rstrip("/") + "/")


def _bwrap_command(root: str, limits: Limits) -> list[str]:
    """bubblewrap around the interpreter: /usr and the Python installation read-only, the rest empty."""
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    for d in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    for d in _needed_dirs():
        if not _inside(d, "/usr"):
            cmd += ["--ro-bind", d, d]
    cmd += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--ro-bind-try", "/etc/localtime",
            "/etc/localtime", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--size", str(limits.file_mb << 20), "--tmpfs", root, "--remount-ro", "/tmp", "--chdir", root, "--"]
    return cmd


def _environment(root: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8", "PYTHONUTF8": "1"}


# ------------------------------------------------------------------------------------------------ one run

def _run(code: str, stdin: str, limits: Limits, layer: str, *, guard: bool = True) -> Execution:
    """One execution under `layer` ("bwrap", "namespaces" or "none"); `guard=False` (tests only) leaves the
    audit hook out, to check what the kernel layers contain by themselves."""
    root = os.path.realpath(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    program = code.encode("utf-8", "replace")
    report_r, report_w = os.pipe()
    config = {"root": root, "report_fd": report_w, "program_bytes": len(program), "guard": guard,
              "namespaces": layer == "namespaces", "hidden": _hidden_dirs() if layer == "namespaces" else [],
              "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_mb": limits.file_mb,
              "nproc": layer != "none", "deadline_s": limits.timeout_s + 2.0}
    # -P -s -S -B rather than -I: -I also implies -E, which would ignore PYTHONHASHSEED; the environment is
    # built from scratch anyway.
    argv = [_interpreter(), "-P", "-s", "-S", "-B", "-c", _BOOTSTRAP, f"{_child_source()}\n_child({config!r})\n"]
    if layer == "bwrap":
        argv = _bwrap_command(root, limits) + argv
    start = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=root, env=_environment(root), start_new_session=True, close_fds=True,
                                    pass_fds=(report_w,))
        except OSError as e:
            return Execution("error", "", "", None, 0.0, f"sandbox: cannot start the interpreter: {e}")
        finally:
            os.close(report_w)
        try:
            out, err, report, killed = _communicate(proc, program + stdin.encode("utf-8", "replace"), report_r,
                                                    limits, start + limits.timeout_s)
        finally:
            cpu = _kill_and_reap(proc)
        seconds = time.monotonic() - start
        return _outcome(out, err, report, killed, proc.returncode, cpu, seconds, limits, layer)
    finally:
        os.close(report_r)
        _remove(root)


class _Head:
    """The first `cap` bytes of a stream."""

    def __init__(self, cap: int):
        self.cap, self.data, self.dropped = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - room)


class _Tail(_Head):
    """The last `cap` bytes of a stream."""

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.cap:  # trim in batches, not on every chunk
            self.dropped += len(self.data) - self.cap
            del self.data[:-self.cap]

    def done(self) -> None:
        if len(self.data) > self.cap:
            self.dropped += len(self.data) - self.cap
            del self.data[:-self.cap]


def _communicate(proc: subprocess.Popen, data: bytes, report_fd: int, limits: Limits,
                 deadline: float) -> tuple[_Head, _Tail, str, str | None]:
    """Feed stdin and drain stdout, stderr and the report pipe until they close, the output limit is passed or
    the deadline comes, then wait (until the deadline) for the child to exit. Returns the kept stdout, stderr
    and report, and why the child was killed ("timeout", "output") or None."""
    cap = 4 * limits.output_chars
    out, err, report = _Head(cap), _Tail(cap), _Head(4096)
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, report_fd: report}
    sel = selectors.DefaultSelector()
    for fd in sinks:
        sel.register(fd, selectors.EVENT_READ)
    stdin_fd, sent = proc.stdin.fileno(), 0
    os.set_blocking(stdin_fd, False)
    sel.register(stdin_fd, selectors.EVENT_WRITE)
    killed, total, reading = None, 0, len(sinks)
    try:
        while reading and killed is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = "timeout"
                break
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        sent += os.write(fd, data[sent:sent + 65536])
                    except BlockingIOError:
                        continue
                    except OSError:  # the child closed stdin or died: the rest is not wanted
                        sent = len(data)
                    if sent >= len(data):
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    reading -= 1
                    continue
                sinks[fd].add(chunk)
                if fd != report_fd:
                    total += len(chunk)
                    if total > _OUTPUT_KILL_BYTES:
                        killed = "output"
                        break
        if killed is None and not _wait_exit(proc, deadline):
            killed = "timeout"
    finally:
        sel.close()
    err.done()
    return out, err, report.data.decode("utf-8", "replace"), killed


def _wait_exit(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait until the child has exited (without reaping it, so its process group stays addressable), at most
    until `deadline`; whether it did."""
    pause = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


def _kill_and_reap(proc: subprocess.Popen) -> float:
    """SIGKILL the child's whole process group (leftovers included), reap the child and return the CPU seconds it
    and the children it waited for used."""
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        try:
            pipe.close()
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its group: start_new_session made the child the leader
    except (ProcessLookupError, PermissionError):
        pass
    try:  # in case it left its group (os.setsid); not proc.kill(), which would reap it first
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def _outcome(out: _Head, err: _Tail, report: str, killed: str | None, rc: int, cpu: float, seconds: float,
             limits: Limits, layer: str) -> Execution:
    """Classify a finished run (see Execution)."""
    lines = report.splitlines()
    blocked = next((line[len("blocked "):] for line in lines if line.startswith("blocked ")), None)
    setup = next((line[len("setup "):] for line in lines if line.startswith("setup ")), None)
    exits = [line[len("exit "):] for line in lines if line.startswith("exit ")]
    if layer == "bwrap" and rc > 128 and not exits:
        rc = -(rc - 128)  # bwrap reports a child killed by signal n as 128 + n
    stdout, stderr = _text(out, head=True), _text(err, head=False)
    sig = -rc if rc < 0 else None

    def result(status: str, detail: str) -> Execution:
        return Execution(status, stdout, stderr, rc, round(seconds, 3), detail)

    if killed == "timeout":
        return result("timeout", f"timed out after {limits.timeout_s:g} s")
    if killed == "output":
        return result("output", f"output limit exceeded: stopped after {_OUTPUT_KILL_BYTES} bytes")
    if setup is not None:
        return result("error", f"sandbox setup failed: {setup}")
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s - 0.05):
        return result("timeout", f"CPU time limit of {limits.cpu_s} s exceeded")
    if "memory" in lines:
        return result("memory", f"memory limit of {limits.memory_mb} MB exceeded")
    if blocked is not None:
        return result("blocked", f"blocked: {blocked}")
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return result("error", f"killed by {name}")
    if rc != 0:
        return result("error", f"exit status {rc}")
    return result("ok", "")


def _text(stream: _Head, *, head: bool) -> str:
    """A kept stream as text, cut at a character boundary, with the truncation marker where bytes were dropped."""
    data = bytes(stream.data)
    if head:
        text = codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=stream.dropped == 0)
    else:
        if stream.dropped:
            skip = 0
            while skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:  # a character cut at the front
                skip += 1
            data = data[skip:]
        text = data.decode("utf-8", "replace")
    n = stream.cap // 4
    truncated = stream.dropped > 0 or len(text) > n
    if not truncated:
        return text
    return text[:n] + _TRUNCATED if head else _TRUNCATED + text[-n:]


def _remove(root: str) -> None:
    """Delete the working directory, whatever modes the code left on its subdirectories."""
    for top, dirs, _ in os.walk(root):
        for d in dirs:
            path = os.path.join(top, d)
            if not os.path.islink(path):  # chmod follows links
                try:
                    os.chmod(path, 0o700)
                except OSError:
                    pass
    shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------ the child (shipped as source)
# The functions below run in the sandboxed interpreter, not here: `_child_source` sends their source as the
# child's -c program. They import what they use and touch no module-level name but each other.

# Compiled under its own name, so that tracebacks can leave the guard's frames out.
_BOOTSTRAP = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"


@functools.cache
def _child_source() -> str:
    return "from __future__ import annotations\n" + "\n".join(
        inspect.getsource(f) for f in (_make_guard, _private_fs, _enter_namespaces, _child))


def _make_guard(root: str, readable: tuple, unreadable: tuple, report_fd: int, pid: int):
    """The audit hook of the guard. Everything it uses is a default argument or a literal (no global or builtin
    name is looked up at call time, no closure), and every container it holds is immutable, so code that
    patches builtins or modules, or even gets hold of the hook, cannot change what it does; it never calls into
    objects the code could have defined (paths must be str or bytes)."""
    import posix

    def refuse(reason, report_fd=report_fd, write=posix.write, encode=str.encode, OSError=OSError,
               PermissionError=PermissionError):
        try:  # reported on the side channel, so that catching the PermissionError does not hide it
            write(report_fd, encode("blocked " + reason + "\n"))
        except OSError:
            pass
        raise PermissionError("sandbox: " + reason)

    def resolve(path, root=root, str=str, bytes=bytes, int=int, type=type, issubclass=issubclass,
                as_str=str.__str__, decode=bytes.decode):
        """An absolute, normalised str path (relative ones are taken from `root`, the only working directory
        allowed); an int (a file descriptor) or None as is; False for anything else."""
        kind = type(path)
        if kind is int or path is None:
            return path
        if kind is not str:
            if issubclass(kind, str):
                path = as_str(path)
            elif issubclass(kind, bytes):
                path = decode(path, "utf-8", "surrogateescape")
            else:
                return False
        if not path.startswith("/"):
            path = root + "/" + path
        parts = []
        for seg in path.split("/"):
            if seg == "..":
                if parts:
                    parts.pop()
            elif seg and seg != ".":
                parts.append(seg)
        return "/" + "/".join(parts)

    def inside(path, dirs):
        for d in dirs:
            if path == d or path.startswith(d + "/"):
                return True
        return False

    def file_type(path, stat=posix.stat, item=tuple.__getitem__, OSError=OSError, ValueError=ValueError):
        try:
            return item(stat(path), 0) & 0o170000  # st_mode (os.stat_result's attributes can be patched)
        except (OSError, ValueError):
            return 0

    def audit(event, args, root=(root,), readable=readable, unreadable=unreadable, pid=pid,
              refuse=refuse, resolve=resolve, inside=inside, file_type=file_type, function=type(refuse), type=type,
              str=str, int=int,
              issubclass=issubclass, as_str=str.__str__,
              write_flags=posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND,
              devices_read=frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/stdin"}),
              devices_write=frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"}),
              process=frozenset({"os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system",
                                 "os.startfile", "subprocess.Popen"}),
              listing=frozenset({"os.listdir", "os.scandir", "os.listxattr", "os.getxattr"}),
              changing=frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown",
                                  "os.utime", "os.truncate", "os.setxattr", "os.removexattr", "os.chflags",
                                  "os.lchflags", "os.lchmod"}),
              introspection=frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents",
                                       "sys._current_frames"}),
              frozen_attrs=frozenset({"__code__", "__defaults__", "__kwdefaults__"}),
              modules=frozenset({
                  "ctypes", "_ctypes", "socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess",
                  "multiprocessing", "_multiprocessing", "_posixshmem", "mmap", "resource", "pty", "termios",
                  "gc", "posix", "_signal", "_imp", "_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_testcapi",
                  "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testimportmultiple",
                  "_testsinglephase", "_testclinic", "_ctypes_test", "_xxtestfuzz", "xxlimited", "xxlimited_35",
                  "sqlite3", "_sqlite3", "_dbm", "_gdbm", "syslog", "spwd", "ossaudiodev", "_tkinter",
                  "readline", "_curses", "_curses_panel"})):
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            p = resolve(path)
            if p is False:
                refuse("file paths must be str or bytes")
            if p is None or type(p) is int:
                return  # a descriptor it already has
            writing = (type(flags) is int and flags & write_flags) or (
                type(mode) is str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode))
            if inside(p, root):
                kind = file_type(p)
                if kind == 0o020000 or kind == 0o060000:
                    refuse("opening the device " + p + " is not allowed")
                return
            if writing:
                if p in devices_write:
                    return
                refuse("writing " + p + " is not allowed: only the working directory is writable")
            if p in devices_read:
                return
            if inside(p, readable) and not inside(p, unreadable):
                if file_type(p) == 0o040000:  # a directory descriptor would make relative paths escape
                    refuse("opening the directory " + p + " is not allowed")
                return
            refuse("reading " + p + " is not allowed: only the working directory and the standard library "
                   "are readable")
        elif event == "import":
            name = args[0]
            if type(name) is not str:
                name = as_str(name) if issubclass(type(name), str) else ""
            for part in name.split("."):
                if part in modules:
                    refuse("importing " + name + " is not allowed")
            if args[1] is not None:  # an extension module's file (_imp.create_dynamic): only the stdlib's
                p = resolve(args[1])
                if type(p) is not str or not inside(p, readable) or inside(p, unreadable):
                    refuse("loading native code from outside the standard library is not allowed")
        elif event in process:
            refuse("starting a process is not allowed")
        elif event == "os.kill":
            if not (type(args[0]) is int and args[0] == pid):
                refuse("sending a signal to another process is not allowed")
        elif event == "os.killpg":
            refuse("sending a signal to a process group is not allowed")
        elif event.startswith("socket."):
            refuse("network access is not allowed")
        elif event.startswith("ctypes."):
            refuse("ctypes is not allowed")
        elif event.startswith("resource."):
            refuse("changing resource limits is not allowed")
        elif event in introspection:
            refuse("inspecting the interpreter's objects is not allowed")
        elif event == "cpython.PyInterpreterState_New":
            refuse("sub-interpreters are not allowed")
        elif event == "object.__setattr__":
            name = args[1]
            if type(name) is not str:
                name = as_str(name) if issubclass(type(name), str) else ""
            if name in frozen_attrs and type(args[0]) is function and args[0].__code__.co_filename == "<sandbox>":
                refuse("changing the sandbox's functions is not allowed")
        elif event == "os.link" or event == "os.symlink":
            refuse("creating links is not allowed")
        elif event == "os.chdir":
            if resolve(args[0]) != root[0]:
                refuse("changing the working directory is not allowed")
        elif event in listing:
            p = resolve(args[0])
            if p is False:
                refuse("file paths must be str or bytes")
            if p is None or type(p) is int or inside(p, root) or (inside(p, readable)
                                                                  and not inside(p, unreadable)):
                return
            refuse("listing " + p + " is not allowed: only the working directory and the standard library "
                   "are readable")
        elif event in changing:
            for i in ((0, 1) if event == "os.rename" else (0,)):
                p = resolve(args[i])
                if type(p) is int and event == "os.truncate":
                    continue  # truncating needs a descriptor open for writing, hence inside the directory
                if type(p) is not str:
                    refuse("changing files through a descriptor or a non-str path is not allowed")
                if not inside(p, root):
                    refuse("changing " + p + " is not allowed: only the working directory is writable")

    return audit


def _private_fs(libc, root: str, hidden: list, size_mb: int) -> str | None:
    """In a new mount namespace: remount everything read-only, hide `hidden` under empty read-only tmpfs mounts
    and mount a `size_mb` tmpfs at `root`. Returns an error message, or None when the filesystem is private."""
    import os

    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
    MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 4096, 1 << 21, 1 << 24
    kept = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
            "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

    def mount(source, target, fstype, flags, data=None):
        enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
        if libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) != 0:
            import ctypes
            return f"mount {target}: {os.strerror(ctypes.get_errno())}"
        return None

    def unescape(field):  # mountinfo escapes space, tab, newline and backslash as \ooo
        out, i = [], 0
        while i < len(field):
            if field[i] == "\\" and field[i + 1:i + 4].isdigit():
                out.append(chr(int(field[i + 1:i + 4], 8)))
                i += 4
            else:
                out.append(field[i])
                i += 1
        return "".join(out)

    with open("/proc/self/mountinfo") as f:
        mounts = [(unescape(fields[4]), fields[5]) for fields in (line.split() for line in f)]
    for target, options in mounts:
        # A remount in a user namespace must keep the flags the mount was locked with (nosuid, nodev…).
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in options.split(","):
            flags |= kept.get(option, 0)
        mount(None, target, None, flags)  # a mount that refuses is checked below, through what matters
    for d in hidden:
        error = mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755")
        if error:
            return error
    os.makedirs(root, mode=0o700, exist_ok=True)  # inside a hidden directory it has to be made again
    error = mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={size_mb}m,mode=700")
    if error:
        return error
    for d in hidden:
        error = mount(None, d, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if error:
            return error
    for d in {os.path.dirname(root), "/"}:
        probe = os.path.join(d, ".grpo-sandbox-probe")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError:
            continue
        os.unlink(probe)
        return f"{d} is still writable"
    return None


def _enter_namespaces(config: dict, libc) -> str | None:
    """Move into new user, mount, pid, network, IPC and UTS namespaces. The calling process stays outside the
    pid namespace as a monitor: it kills the sandbox at the deadline, exits as the sandbox did and never returns
    here. The sandbox (pid 1 inside) gets a private /proc and filesystem. Returns an error message, or None."""
    import ctypes
    import os
    import signal

    CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
    CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE, PR_SET_PDEATHSIG = 2, 4, 8, 16384, 1 << 18, 1
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if libc.unshare(flags) != 0:
        return "unshare: " + os.strerror(ctypes.get_errno())
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as e:
        return f"user namespace: {e}"
    child = os.fork()
    if child:  # the monitor: whatever happens, it exits here
        code = 1
        try:
            for fd in (0, 1, 2, config["report_fd"]):
                os.close(fd)
            signal.signal(signal.SIGALRM, lambda *_: os.kill(child, signal.SIGKILL))
            signal.setitimer(signal.ITIMER_REAL, config["deadline_s"])
            _, status = os.waitpid(child, 0)
            code = os.waitstatus_to_exitcode(status)
            if code < 0:  # die of the same signal, so that the caller sees what happened
                if -code not in (signal.SIGKILL, signal.SIGSTOP):
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
        finally:
            os._exit(code if code >= 0 else 128 - code)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return "mount --make-rprivate /: " + os.strerror(ctypes.get_errno())
    # Our own /proc (this pid namespace's processes only); some containers forbid it: then the host's stays,
    # which shows other processes without letting the sandbox reach them.
    libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    return _private_fs(libc, config["root"], config["hidden"], config["file_mb"])


def _child(config: dict) -> None:
    """The sandboxed interpreter's program: read the code (sent ahead of stdin), build the sandbox (namespaces,
    rlimits, guard), run the code as __main__ and report how it ended on the report pipe: "blocked <reason>",
    "memory", "setup <error>", "exit <status>"."""
    import os
    import sys

    report = config["report_fd"]

    def say(line):
        try:
            os.write(report, (line + "\n").encode())
        except OSError:
            pass

    chunks, left = [], config["program_bytes"]
    while left:
        chunk = os.read(0, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    source = b"".join(chunks).decode("utf-8", "replace")

    if config["namespaces"]:
        import ctypes
        try:
            error = _enter_namespaces(config, ctypes.CDLL(None, use_errno=True))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if error:
            say("setup " + error)
            os._exit(125)
        del ctypes
    os.chdir(config["root"])  # again: in namespaces, onto the tmpfs mounted over it

    import resource
    mb = 1 << 20
    limits = [(resource.RLIMIT_AS, config["memory_mb"] * mb), (resource.RLIMIT_CPU, config["cpu_s"]),
              (resource.RLIMIT_FSIZE, config["file_mb"] * mb), (resource.RLIMIT_NOFILE, 64),
              (resource.RLIMIT_CORE, 0)]
    if config["nproc"]:  # counted per user namespace; outside one it would count the caller's processes too
        limits.append((resource.RLIMIT_NPROC, 64))
    for which, soft in limits:
        # The CPU hard limit one second later: SIGXCPU first, then SIGKILL if that is ignored (as pid 1 it is).
        hard = soft + 1 if which == resource.RLIMIT_CPU else soft
        old_hard = resource.getrlimit(which)[1]
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))
    del resource

    if not config["namespaces"]:  # there the monitor does it; this also ends a child whose caller died
        import _thread
        import time

        def watchdog(seconds=config["deadline_s"], sleep=time.sleep, exit=os._exit):
            sleep(seconds)
            exit(137)

        _thread.start_new_thread(watchdog, ())

    import linecache
    import signal
    import traceback
    for name in list(sys.modules):  # what only the setup needed: imported again, the guard would refuse it
        if name.split(".")[0] in ("ctypes", "_ctypes", "resource"):
            del sys.modules[name]
    # Builtin modules are imported now, and _imp.create_builtin deleted: it would make fresh copies of posix
    # and _signal, with the functions deleted below; the guard refuses importing them again from elsewhere.
    for name in sys.builtin_module_names:
        if name != "gc":
            __import__(name)
    del sys.modules["_imp"].create_builtin
    for module in (os, sys.modules["posix"], signal, sys.modules["_signal"], sys.modules["time"]):
        for name in ("pidfd_open", "pidfd_send_signal", "setpriority", "sched_setaffinity", "sched_setscheduler",
                     "sched_setparam", "mknod", "mkfifo", "chroot", "setns", "unshare", "clock_settime",
                     "clock_settime_ns"):
            function = getattr(module, name, None)
            if function is not None:
                delattr(module, name)
                for functions in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks):
                    functions.discard(function)  # these sets would hand them back
    if config["guard"]:
        readable = tuple(sorted({os.path.realpath(p) for p in sys.path if os.path.exists(p)}))
        unreadable = tuple(p + "/" + s for p in readable for s in ("site-packages", "dist-packages"))
        sys.addaudithook(_make_guard(config["root"], readable, unreadable, report, os.getpid()))

    def print_traceback(e):
        """As the interpreter prints it, without the frames of this program and of the guard."""
        top = traceback.TracebackException(type(e), e, e.__traceback__)
        todo, seen = [top], set()
        while todo:
            te = todo.pop()
            if id(te) not in seen:
                seen.add(id(te))
                te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != "<sandbox>"])
                todo += [x for x in (te.__cause__, te.__context__) if x is not None]
        sys.stderr.write("".join(top.format()))

    main = type(sys)("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    sys.stdout.reconfigure(line_buffering=True)  # what was printed before a timeout is not lost
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    status = 0
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = int(e.code or 0)
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        status = 1
        if isinstance(e, MemoryError):
            say("memory")
            main.__dict__.clear()  # room to print the traceback
        try:
            print_traceback(e)
        except BaseException:
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    say(f"exit {status}")
    sys.exit(status)
