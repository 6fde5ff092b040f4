"""The sandbox's parent side: `run_python` picks the strongest layer that works here (probed once), starts the
sandbox in a fresh working directory with a minimal environment (under bwrap for that layer, else through the
setup interpreter of grpo/sandbox/setup.py, which execve()s the code's interpreter), hands it the seccomp filter,
feeds it the code and stdin, keeps the head of stdout and the tail of stderr, reads the report pipe, kills its
whole process group at the end or at a limit, and classifies the outcome (`Execution`) from the exit status and
CPU time the kernel gives (wait4) and the failures the report adds. The program the code's interpreter runs is
grpo/sandbox/child.py; what the layers contain is in grpo/sandbox/__init__.py and docs/sandbox.md.
"""
from __future__ import annotations

import codecs
import functools
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

from grpo.errors import GRPOError
from grpo.sandbox import seccomp, setup
from grpo.sandbox.child import BOOTSTRAP, program_source

STATUSES = ("ok", "error", "timeout", "memory", "blocked", "output")
_OUTPUT_KILL_BYTES = 1 << 20   # stdout + stderr beyond this: the child is killed (status "output")
_TRUNCATED = "…[truncated]"
_TOOL_STDERR_LINES = 20        # python_tool_result shows this many of stderr's last lines
_REPORT_LINE_BYTES = 4096      # a longer line on the report pipe is not the sandbox's: the report is garbled
_SETUP_FAILED = 125            # the setup stage's exit status when a layer could not be built
_CHANNEL_LOST = 86             # the guard's exit status when it cannot report a refusal (child.py's `lost`)…
_CHANNEL_REPLACED = 87         # …and the child's when it finds the report pipe closed or replaced at the end
# Set to 1 to run model-written code where no kernel layer works (isolation() == "rlimits+guard"): see
# SandboxUnavailable.
ALLOW_RLIMITS_ONLY = "GRPO_SANDBOX_RLIMITS_ONLY"


class SandboxUnavailable(GRPOError):
    """No kernel layer (bubblewrap, user namespaces) works on this machine, and the rlimits and the guard alone
    were not accepted (environment variable GRPO_SANDBOX_RLIMITS_ONLY=1): without a kernel layer, code that
    switches the guard off can do whatever the caller's user can."""


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
    """Run `code` as a Python program in a new sandboxed process (see grpo.sandbox), with `stdin` as its
    standard input. Never raises for anything the code does; hostile code ends as a failed Execution. Raises
    SandboxUnavailable where no kernel layer works and GRPO_SANDBOX_RLIMITS_ONLY=1 is not set."""
    layer = ensure_available()
    return _run(code, stdin, limits, layer)


def ensure_available() -> str:
    """The layer run_python uses here ("bwrap", "namespaces" or "none"); raises SandboxUnavailable where it would
    (no kernel layer, and GRPO_SANDBOX_RLIMITS_ONLY=1 not set). What builds the python tool calls it, so that a
    run on such a machine stops before it starts instead of feeding the model the error."""
    layer = _layer()
    if layer == "none":
        why = "; ".join(f"{name}: {_probe_failures.get(name, 'not available')}" for name in ("bwrap", "namespaces"))
        if os.environ.get(ALLOW_RLIMITS_ONLY) != "1":
            raise SandboxUnavailable(
                f"the sandbox has no kernel layer on this machine ({why}), so model-written code would be contained "
                f"by a Python audit hook alone; install bubblewrap or allow unprivileged user namespaces, or set "
                f"{ALLOW_RLIMITS_ONLY}=1 to accept that (docs/sandbox.md)")
        if not _available("none"):
            raise SandboxUnavailable(f"the sandbox cannot run code on this machine ({why}; rlimits: "
                                     f"{_probe_failures['none']})")
    return layer


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

# For a root caller the namespaces layer comes first: under bwrap its code (the caller's root, without
# capabilities) could still chmod or touch the host's own device nodes, which bwrap binds writable (and a
# read-only bind would make them unusable, nodev), where the namespaces layer binds them read-only.
_LAYERS = ("namespaces", "bwrap", "none") if os.geteuid() == 0 else ("bwrap", "namespaces", "none")
_probe_lock = threading.Lock()
_probe_failures: dict[str, str] = {}   # why a layer is not available, for SandboxUnavailable's message


@functools.cache
def _available(layer: str) -> bool:
    """Whether `layer` works here: a trivial program runs under it and reports its sandbox built."""
    if layer == "bwrap" and shutil.which("bwrap") is None:
        _probe_failures[layer] = "bwrap is not installed"
        return False
    result = _run("print('ok')", "", Limits(timeout_s=20.0), layer)
    if result.ok and result.stdout == "ok\n":
        return True
    _probe_failures[layer] = (result.detail or result.status) + (
        f" ({result.stderr.strip().splitlines()[-1]})" if result.stderr.strip() else "")
    return False


def _layer() -> str:
    """The strongest layer that works here, probed once (under a lock: rows of a batch start concurrently)."""
    with _probe_lock:
        return next((layer for layer in _LAYERS[:-1] if _available(layer)), "none")


def _interpreter() -> str:
    """The base interpreter (a virtualenv's python would only add its site-packages, which -S drops anyway, and
    would put the virtualenv, often inside the run directory, on the sandbox's paths)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _needed_dirs() -> list[str]:
    """Directories the child's interpreter reads: its prefix (stdlib, libpython) and its binary's directory, the
    outermost of nested ones."""
    exe = _interpreter()
    dirs = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(exe))},
                  key=len)
    return [d for i, d in enumerate(dirs) if not any(_inside(d, e) for e in dirs[:i])]


def _inside(path: str, d: str) -> bool:
    return path == d or path.startswith(d.rstrip("/") + "/")


def _root_plan() -> list[tuple[str, str, str]]:
    """What the sandbox's root holds besides /proc, /dev, /tmp and the working directory, as (kind, source,
    target): ("symlink", where it points, path), ("dir", host directory, path) bound read-only, ("file", host
    file, path) bound read-only: /usr (and the /bin, /lib… links to it), the Python installation,
    /etc/ld.so.cache and /etc/localtime."""
    plan = []
    for d in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            plan.append(("symlink", os.readlink(d), d))
        elif os.path.isdir(d):
            plan.append(("dir", d, d))
    plan += [("dir", d, d) for d in _needed_dirs() if not _inside(d, "/usr")]
    plan += [("file", os.path.realpath(f), f) for f in ("/etc/ld.so.cache", "/etc/localtime") if os.path.isfile(f)]
    return plan


_DEVICES = ("null", "zero", "full", "random", "urandom")


def _bwrap_command(root: str, limits: Limits, seccomp_fd: int | None) -> list[str]:
    """bubblewrap around the interpreter: the root of `_root_plan()`, read-only but for the working directory
    (a `file_mb` tmpfs); no capabilities, no further user namespaces (so the mounts cannot be changed), the seccomp
    filter read from `seccomp_fd`."""
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--cap-drop", "ALL", "--die-with-parent", "--new-session"]
    if _bwrap_version() >= (0, 8):  # before 0.8 the filter alone keeps the code from making a user namespace
        cmd.append("--disable-userns")
    for kind, source, target in _root_plan():
        cmd += ["--symlink", source, target] if kind == "symlink" else ["--ro-bind", source, target]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--dir", "/tmp", "--size", str(limits.file_mb << 20),
            "--tmpfs", root, "--remount-ro", "/proc", "--remount-ro", "/dev", "--remount-ro", "/"]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    return cmd + ["--chdir", root, "--"]


@functools.cache
def _bwrap_version() -> tuple[int, ...]:
    """bwrap's version ("bubblewrap 0.8.0" -> (0, 8, 0)); (0,) if it cannot be told."""
    try:
        text = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(part) for part in text.split()[-1].split("."))
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return (0,)


def _setup_config(layer: str, root: str, limits: Limits, report_fd: int, filter_fd: int) -> dict:
    """The setup stage's configuration (grpo/sandbox/setup.py) for the namespaces and rlimits layers."""
    plan = _root_plan() + [("file", f"/dev/{d}", f"/dev/{d}") for d in _DEVICES] + [
        ("symlink", "/proc/self/fd", "/dev/fd")] + [
        ("symlink", f"/proc/self/fd/{i}", f"/dev/{name}") for i, name in enumerate(("stdin", "stdout", "stderr"))]
    return {"layer": layer, "root": root, "report_fd": report_fd, "filter_fd": filter_fd,
            "deadline_s": limits.timeout_s + 2.0, "file_mb": limits.file_mb, "plan": plan,
            "pivot_root": seccomp.syscall_number("pivot_root")}  # None where unknown: the layer is not built


def _environment(root: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8", "PYTHONUTF8": "1"}


# ------------------------------------------------------------------------------------------------ one run

def _run(code: str, stdin: str, limits: Limits, layer: str, *, guard: bool = True,
         filtered: bool = True) -> Execution:
    """One execution under `layer` ("bwrap", "namespaces" or "none"). For tests, to check what the other layers
    hold by themselves: `guard=False` leaves the audit hook out, `filtered=False` the seccomp filter."""
    root = os.path.realpath(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    program = code.encode("utf-8", "replace")
    report_r, report_w = os.pipe()
    filter_r, filter_w = os.pipe()
    config = {"root": root, "report_fd": report_w, "program_bytes": len(program), "guard": guard,
              "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_mb": limits.file_mb,
              "nproc": layer != "none", "deadline_s": limits.timeout_s + 2.0, "watchdog": layer != "namespaces",
              "lost_status": _CHANNEL_LOST}
    # -P -s -S -B rather than -I: -I also implies -E, which would ignore PYTHONHASHSEED; the environment is
    # built from scratch anyway.
    python = [_interpreter(), "-P", "-s", "-S", "-B", "-c"]
    argv = python + [BOOTSTRAP, f"{program_source()}\n_child({config!r})\n"]
    with_filter = filtered and seccomp.architecture() is not None
    if layer == "bwrap":
        argv = _bwrap_command(root, limits, filter_r if with_filter else None) + argv
    else:
        setup_config = _setup_config(layer, root, limits, report_w, filter_r)
        argv = python + [setup.BOOTSTRAP, f"{setup.program_source()}\n_setup({setup_config!r}, sys.argv[2:])\n",
                         *argv]
    start = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=root, env=_environment(root), start_new_session=True, close_fds=True,
                                    pass_fds=(report_w, filter_r) if layer != "bwrap" or with_filter else (report_w,))
        except OSError as e:
            return Execution("error", "", "", None, 0.0, f"sandbox: cannot start the interpreter: {e}")
        finally:
            os.close(report_w)
            os.close(filter_r)
        try:
            # Written once the child's pid is known: without a pid namespace the filter lets signals go only
            # to it and its process group. Small enough for the pipe's buffer: this never blocks.
            if with_filter:
                os.write(filter_w, seccomp.program(own_pid=proc.pid if layer == "none" else None))
        finally:
            os.close(filter_w)
            filter_w = -1
        try:
            out, err, report, killed = _communicate(proc, program + stdin.encode("utf-8", "replace"), report_r,
                                                    limits, start + limits.timeout_s)
        finally:
            cpu = _kill_and_reap(proc)
        seconds = time.monotonic() - start
        return _outcome(out, err, report, killed, proc.returncode, cpu, seconds, limits, layer)
    finally:
        if filter_w != -1:
            os.close(filter_w)
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


class _Report:
    """What the report pipe said, read line by line as it comes: the first refusal ("blocked <reason>"),
    "memory", a setup failure ("setup <why>"), the exit status the child reported ("exit <n>"), and whether
    anything else came (`garbled`: the code wrote to the pipe; a line too long to be the sandbox's included)."""

    def __init__(self):
        self.partial = bytearray()
        self.blocked: str | None = None
        self.setup: str | None = None
        self.memory, self.exited, self.garbled = False, False, False

    def add(self, chunk: bytes) -> None:
        self.partial += chunk
        *lines, rest = self.partial.split(b"\n")
        self.partial = bytearray(rest)
        for line in lines:
            self._line(line)
        if len(self.partial) > _REPORT_LINE_BYTES:
            self.garbled = True
            self.partial.clear()

    def done(self) -> None:
        if self.partial:
            self._line(bytes(self.partial))
            self.partial.clear()

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace")
        if not line:  # the sandbox starts each line with a newline, so that it stands alone whatever came before
            return
        if line.startswith("blocked ") and len(raw) <= _REPORT_LINE_BYTES:
            self.blocked = self.blocked if self.blocked is not None else line[len("blocked "):]
        elif line.startswith("setup ") and self.setup is None:
            self.setup = line[len("setup "):]
        elif line == "memory":
            self.memory = True
        elif line.startswith("exit ") and line[len("exit "):].lstrip("-").isdigit():
            self.exited = True
        else:
            self.garbled = True


def _communicate(proc: subprocess.Popen, data: bytes, report_fd: int, limits: Limits,
                 deadline: float) -> tuple[_Head, _Tail, _Report, str | None]:
    """Feed stdin and drain stdout, stderr and the report pipe until they close, the output limit is passed or
    the deadline comes, then wait (until the deadline) for the child to exit. Returns the kept stdout, stderr,
    the report, and why the child was killed ("timeout", "output") or None."""
    cap = 4 * limits.output_chars
    out, err, report = _Head(cap), _Tail(cap), _Report()
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
                if fd != report_fd:  # the report is read line by line into a few flags: it can run on
                    total += len(chunk)
                    if total > _OUTPUT_KILL_BYTES:
                        killed = "output"
                        break
        if killed is None and not _wait_exit(proc, deadline):
            killed = "timeout"
    finally:
        sel.close()
    err.done()
    report.done()
    return out, err, report, killed


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


def _outcome(out: _Head, err: _Tail, report: _Report, killed: str | None, rc: int, cpu: float, seconds: float,
             limits: Limits, layer: str) -> Execution:
    """Classify a finished run (see Execution). The exit status and the CPU time come from the kernel (wait4);
    the report pipe can only add failures: the code can write to it, but never take back what the guard wrote
    (a refusal that cannot be written ends the process), and anything but the sandbox's lines fails the run."""
    if layer != "none" and rc > 128 and not report.exited:
        rc = -(rc - 128)  # bwrap, and the namespaces' init, report a child killed by signal n as 128 + n
    stdout, stderr = _text(out, head=True), _text(err, head=False)
    sig = -rc if rc < 0 else None

    def result(status: str, detail: str) -> Execution:
        return Execution(status, stdout, stderr, rc, round(seconds, 3), detail)

    if killed == "timeout":
        return result("timeout", f"timed out after {limits.timeout_s:g} s")
    if killed == "output":
        return result("output", f"output limit exceeded: stopped after {_OUTPUT_KILL_BYTES} bytes")
    if report.setup is not None:
        return result("error", f"sandbox setup failed: {report.setup}")
    if rc == _SETUP_FAILED and not report.exited and layer != "bwrap":
        return result("error", "sandbox setup failed")
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s - 0.05):
        return result("timeout", f"CPU time limit of {limits.cpu_s} s exceeded")
    if report.memory:
        return result("memory", f"memory limit of {limits.memory_mb} MB exceeded")
    if report.blocked is not None:
        return result("blocked", f"blocked: {report.blocked}")
    if rc == _CHANNEL_LOST and not report.exited:
        return result("blocked", "blocked: an operation was refused and the report pipe was closed or replaced")
    if rc == _CHANNEL_REPLACED and not report.exited:
        return result("error", "sandbox: the code closed or replaced the report pipe")
    if report.garbled:
        return result("error", "sandbox: the report pipe carried something else than the sandbox's report")
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
