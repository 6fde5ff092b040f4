"""grpo.sandbox: ordinary programs run; hostile ones are contained, reported as failed and leave nothing behind.

The hostile cases run under every layer this machine has (bwrap, namespaces, the bare rlimits+guard), with the
guard; `TestKernelLayers` runs them again without the guard, to check what namespaces and bubblewrap contain
by themselves.
"""
import dis
import json
import os
import resource
import shutil
import socket
import threading
import types

import pytest

from grpo.sandbox import child, parent
from grpo.sandbox import Execution, Limits, isolation, python_tool_result, run_python

FAST = Limits(timeout_s=2.0, cpu_s=2)
LAYERS = [pytest.param("none", id="rlimits+guard"), pytest.param("namespaces", id="namespaces"),
          pytest.param("bwrap", id="bwrap")]


def _skip_unless_available(layer: str) -> None:
    if layer == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    if layer == "namespaces" and not parent._available("namespaces"):
        pytest.skip("unprivileged user namespaces are not available on this machine")


@pytest.fixture(params=LAYERS)
def layer(request) -> str:
    _skip_unless_available(request.param)
    return request.param


def run(code: str, layer: str, *, stdin: str = "", limits: Limits = FAST, guard: bool = True,
        filtered: bool = True) -> Execution:
    return parent._run(code, stdin, limits, layer, guard=guard, filtered=filtered)


def descendants(pid: int) -> set[int]:
    """The processes below `pid` (children, grandchildren…), from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test leaves no process behind (the sandbox kills its whole process group, or pid namespace)."""
    before = descendants(os.getpid())
    yield
    assert descendants(os.getpid()) - before == set()


class Server:
    """A TCP server on 127.0.0.1 in this process, counting the connections it accepts."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.1)
        self.port, self.hits = self.sock.getsockname()[1], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.accept, daemon=True)
        self.thread.start()

    def accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:  # the timeout included
                continue
            self.hits += 1
            conn.close()

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def server():
    srv = Server()
    yield srv
    srv.close()


# --------------------------------------------------------------------------------------------- ordinary code

def test_ok_with_stdout():
    result = run_python("print(6 * 7)")
    assert (result.status, result.stdout, result.stderr, result.returncode) == ("ok", "42\n", "", 0)
    assert result.ok and result.seconds > 0


def test_stdin():
    result = run_python("import sys\nprint(sys.stdin.read().upper(), end='')", stdin="abc\ndef\n")
    assert result.stdout == "ABC\nDEF\n"


def test_syntax_error():
    result = run_python("def f(:\n    pass")
    assert result.status == "error" and not result.ok
    assert "SyntaxError" in result.stderr and result.returncode == 1


def test_exception_has_a_traceback_of_the_code_only():
    result = run_python("def f():\n    return 1 / 0\nf()")
    assert result.status == "error" and result.detail == "exit status 1"
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert 'File "main.py", line 2, in f' in result.stderr and "return 1 / 0" in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<sandbox>" not in result.stderr  # the sandbox's own frames are left out


def test_exit_status():
    assert run_python("import sys; sys.exit(0)").status == "ok"
    result = run_python("import sys; sys.exit(3)")
    assert (result.status, result.returncode, result.detail) == ("error", 3, "exit status 3")


def test_the_end_waits_for_threads_and_runs_atexit():
    """The child ends with os._exit, after what the interpreter's shutdown would do while still guarded: waiting
    for non-daemon threads, atexit functions (one that raises is reported as the interpreter reports it, and is
    not a refusal)."""
    code = ("import atexit, sys, threading, time\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "atexit.register(lambda: sys.exit(3))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
            "print('main done')")
    result = run_python(code)
    assert (result.status, result.stdout) == ("ok", "main done\nthread done\natexit ran\n"), result
    assert result.stderr.startswith("Exception ignored in atexit callback") and "SystemExit: 3" in result.stderr


def test_stdlib_imports_work():
    code = ("import math, itertools, functools, collections, json, re, fractions, decimal, statistics, random\n"
            "import string, heapq, bisect, dataclasses, typing, enum, datetime, time\n"
            "P = collections.namedtuple('P', 'x y')\n"
            "print(json.dumps([math.comb(5, 2), re.sub('a', 'b', 'aa'), str(fractions.Fraction(1, 3)),"
            " list(itertools.accumulate([1, 2])), P(1, 2).y, statistics.mean([1, 3])]))")
    result = run_python(code)
    assert result.ok, result.stderr
    assert json.loads(result.stdout) == [10, "bb", "1/3", [1, 3], 2, 2]


def test_files_in_its_own_directory_work():
    code = ("import os, tempfile, shutil, pathlib\n"
            "pathlib.Path('a/b').mkdir(parents=True)\n"
            "open('a/b/c.txt', 'w').write('hi')\n"
            "shutil.copytree('a', 'z'); shutil.rmtree('a')\n"
            "with tempfile.TemporaryDirectory() as d: open(os.path.join(d, 'x'), 'w').write('1')\n"
            "print(sorted(os.listdir('.')), open('z/b/c.txt').read())")
    result = run_python(code)
    assert result.ok, result.stderr
    assert result.stdout == "['z'] hi\n"


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("GRPO_SECRET_TOKEN", "hunter2")
    result = run_python("import os, json; print(json.dumps(dict(os.environ)))")
    env = json.loads(result.stdout)
    assert "GRPO_SECRET_TOKEN" not in env and "hunter2" not in result.stdout
    assert env["PATH"] == "/usr/bin:/bin" and env["LANG"] == "C.UTF-8" and env["PYTHONHASHSEED"] == "0"
    assert env["HOME"] == env["TMPDIR"] != os.environ.get("HOME")


def test_hash_seed_is_fixed():
    first, second = (run_python("print(hash('grpo'))").stdout for _ in range(2))
    assert first == second


def test_cwd_is_a_fresh_directory_removed_afterwards():
    code = "import os; open('mine.txt', 'w').write('x'); print(os.getcwd()); print(sorted(os.listdir('.')))"
    result = run_python(code)
    cwd, listing = result.stdout.splitlines()
    assert listing == "['mine.txt']" and cwd != os.getcwd()
    assert os.path.basename(cwd).startswith("grpo-sandbox-")
    assert not os.path.exists(cwd)


def test_isolation_names_the_layers():
    assert isolation() in ("bwrap+rlimits+guard", "namespaces+rlimits+guard", "rlimits+guard")
    if os.geteuid() == 0 and parent._available("namespaces"):
        # as root the namespaces layer comes first: under bwrap the code could change the host's device nodes
        assert isolation() == "namespaces+rlimits+guard"
    elif shutil.which("bwrap"):
        assert isolation() == "bwrap+rlimits+guard"  # with bubblewrap present, it is used


# ------------------------------------------------------------------------------------------------- limits

def test_infinite_loop_times_out():
    result = run_python("while True: pass", limits=Limits(timeout_s=1.0, cpu_s=10))
    assert (result.status, result.detail) == ("timeout", "timed out after 1 s")
    assert 1.0 <= result.seconds < 2.0


def test_sleep_times_out():
    result = run_python("import time\nprint('before', flush=True)\ntime.sleep(60)", limits=Limits(timeout_s=1.0))
    assert result.status == "timeout" and result.seconds < 2.0
    assert result.stdout == "before\n"  # what was printed before the deadline is kept


def test_cpu_limit():
    result = run_python("while True: pass", limits=Limits(timeout_s=10.0, cpu_s=1))
    assert (result.status, result.detail) == ("timeout", "CPU time limit of 1 s exceeded")
    assert result.seconds < 3.5


def test_memory_bombs(layer):
    for code in ("x = bytearray(10**10)", "x = []\nwhile True: x.append(bytearray(10**6))"):
        result = run(code, layer, limits=Limits(memory_mb=256, timeout_s=5.0))
        assert result.status == "memory", (code, result)
        assert result.detail == "memory limit of 256 MB exceeded" and "MemoryError" in result.stderr


def test_huge_output_is_truncated_and_killed(layer):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run("while True: print('x' * 10000)", layer, limits=Limits(output_chars=100))
    assert (result.status, result.detail) == ("output", f"output limit exceeded: stopped after "
                                                        f"{parent._OUTPUT_KILL_BYTES} bytes")
    assert result.stdout == "x" * 100 + "…[truncated]"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024  # KiB: no blow-up here
    result = run("import sys\nsys.stdout.write('x' * 10**8)", layer)
    assert result.status == "output" and len(result.stdout) == 2000 + len("…[truncated]")


def test_output_under_the_kill_limit_is_truncated():
    result = run_python("import sys\nprint('a' * 5000)\nprint('e' * 3000 + 'END', file=sys.stderr)",
                        limits=Limits(output_chars=100))
    assert result.ok
    assert result.stdout == "a" * 100 + "…[truncated]"
    assert result.stderr == "…[truncated]" + "e" * 96 + "END\n"  # stderr keeps its end


def test_multibyte_output_is_cut_at_a_character():
    result = run_python("print('é' * 50)", limits=Limits(output_chars=10))
    assert result.stdout == "é" * 10 + "…[truncated]"


# ------------------------------------------------------------------------------------------- hostile code

def test_fork_bomb(layer):
    result = run("import os\nwhile True: os.fork()", layer)
    assert result.status == "blocked" and "starting a process is not allowed" in result.detail
    for code in ("import os; os.system('echo hi')", "import subprocess", "import os; os.execv('/bin/sh', ['sh'])",
                 "import os; os.posix_spawn('/bin/sh', ['sh'], {})", "import pty; pty.fork()"):
        assert run(code, layer).status == "blocked", code


def test_writing_outside_its_directory(layer, tmp_path):
    mine = tmp_path / "mine.txt"
    mine.write_text("original")
    outside_cwd = os.path.join(os.getcwd(), "grpo-sandbox-was-here.txt")
    for code in (f"open({str(mine)!r}, 'w').write('pwned')",
                 f"open({outside_cwd!r}, 'w').write('pwned')",
                 f"import os; os.remove({str(mine)!r})",
                 f"import os; os.rename({str(mine)!r}, 'stolen')",
                 f"import os; os.symlink({str(mine)!r}, 'link')",
                 f"import os; os.link({str(mine)!r}, 'link')",
                 f"import shutil; shutil.copy('/dev/null', {str(tmp_path / 'new.txt')!r})",
                 "import os; os.chdir('..'); open('x', 'w')"):
        result = run(code, layer)
        assert result.status == "blocked", (code, result)
    assert mine.read_text() == "original"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    assert not os.path.exists(outside_cwd)


def test_reading_the_runs_files(layer, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    for code in (f"print(open({str(secret)!r}).read())",
                 f"import os; print(os.listdir({str(tmp_path)!r}))",
                 "import os; print(open(os.path.join(os.environ['HOME'], '..', '..', "
                 f"{str(secret)!r}.lstrip('/'))).read())",
                 "print(open('/proc/self/environ').read())",
                 f"print(open({os.path.join(os.getcwd(), 'README.md')!r}).read())"):
        result = run(code, layer)
        assert result.status == "blocked", (code, result)
        assert "TOPSECRET" not in result.stdout and "secret.txt" not in result.stdout
    assert run(f"import os; print(os.listdir({os.getcwd()!r}))", layer).status == "blocked"


def test_opening_a_socket(layer, server):
    port = server.port
    for code in (f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
                 "import socket; socket.socket()",
                 f"import _socket; _socket.socket().connect(('127.0.0.1', {port}))",
                 "import urllib.request; urllib.request.urlopen('http://127.0.0.1:%d/' % " + str(port) + ")"):
        result = run(code, layer)
        assert result.status == "blocked", (code, result)
    assert run("import socket; socket.socket()", layer, guard=True).detail in (
        "blocked: importing socket is not allowed", "blocked: network access is not allowed")
    assert server.hits == 0


def test_signalling_its_parent(layer):
    me = os.getpid()
    for code in ("import os; os.kill(os.getppid(), 9)",
                 "import os; os.killpg(0, 9)",
                 f"import os, signal; os.kill({me}, signal.SIGTERM)",
                 f"import os; os.killpg(os.getpgid({me}), 9)",
                 f"import os; os.kill({os.getppid()}, 9)",  # pytest's parent
                 f"import os; os.pidfd_open({me})",
                 "import signal; signal.pidfd_send_signal(3, 9)"):
        result = run(code, layer)
        assert result.status in ("blocked", "error"), (code, result)
    assert run("import os; os.kill(os.getppid(), 9)", layer).detail == (
        "blocked: sending a signal to another process is not allowed")
    # Still here; and a signal to itself is allowed.
    assert run("import os, signal\nsignal.signal(signal.SIGUSR1, lambda *a: print('got it'))\n"
               "os.kill(os.getpid(), signal.SIGUSR1)", layer).stdout == "got it\n"


def test_blocked_even_when_the_error_is_caught(layer):
    result = run("try:\n    open('/etc/passwd')\nexcept PermissionError as e:\n    print('caught:', e)", layer)
    assert result.status == "blocked"
    assert result.stdout.startswith("caught: sandbox: reading /etc/passwd is not allowed")


def test_ctypes_and_escape_hatches_are_refused(layer):
    for code in ("import ctypes",
                 "import gc; gc.get_objects()",
                 "import sys; sys.modules['_frozen_importlib']._gcd_import('gc').get_objects()",
                 "import _imp, sys\n"
                 "_imp.create_builtin(sys.modules['_frozen_importlib'].ModuleSpec('posix', None)).pidfd_open(1)",
                 "import resource; resource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
                 "import mmap",
                 "import os; [f for f in os.supports_dir_fd if f.__name__ == 'mknod'][0]('/tmp/x')",
                 "import time; time.clock_settime(time.CLOCK_REALTIME, 0)",
                 "import multiprocessing",
                 "import builtins; builtins.type = lambda x: int; builtins.len = lambda x: 0\n"
                 "open('/etc/passwd').read()"):
        result = run(code, layer)
        assert not result.ok, (code, result)


def test_guard_uses_no_global_name():
    """The hook must not look anything up at call time: code could patch builtins or modules."""
    audit = child._make_guard("/tmp/x", ("/usr/lib/python3",), (), 2, 1)
    functions = [audit] + [d for d in audit.__defaults__ if isinstance(d, types.FunctionType)]
    assert len(functions) == 5  # audit, refuse, resolve, inside, file_type
    for fn in functions:
        assert fn.__closure__ is None and fn.__kwdefaults__ is None, fn.__name__
        lookups = [i.opname for i in dis.get_instructions(fn) if i.opname in
                   ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "STORE_GLOBAL")]
        assert lookups == [], fn.__name__
        assert all(isinstance(d, (str, int, tuple, frozenset)) or callable(d) for d in fn.__defaults__ or ())


# ---------------------------------------------------------------------------------------- kernel layers

_KERNEL_PROBE = """
import json, os
out = {{}}
def attempt(name, fn):
    try:
        out[name] = repr(fn())
    except BaseException as e:
        out[name] = "refused: " + type(e).__name__
attempt("write", lambda: open({mine!r}, "w").write("pwned"))
attempt("write_cwd", lambda: open({cwd_file!r}, "w").write("pwned"))
attempt("read", lambda: open({secret!r}).read())
attempt("read_cwd", lambda: open({readme!r}).read())
import socket
attempt("connect", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1))
attempt("signal", lambda: os.kill({pid}, 0))
out["ppid"] = os.getppid()
out["processes"] = len([p for p in os.listdir("/proc") if p.isdigit()])
print(json.dumps(out))
"""


@pytest.mark.parametrize("kernel_layer", [pytest.param("namespaces"), pytest.param("bwrap")])
def test_kernel_layer_contains_code_without_the_guard(kernel_layer, tmp_path, server):
    _skip_unless_available(kernel_layer)
    assert parent._available(kernel_layer), f"{kernel_layer} is installed but does not work"
    mine, secret = tmp_path / "mine.txt", tmp_path / "secret.txt"
    mine.write_text("original")
    secret.write_text("TOPSECRET")
    cwd_file = os.path.join(os.getcwd(), "grpo-sandbox-was-here.txt")
    code = _KERNEL_PROBE.format(mine=str(mine), cwd_file=cwd_file, secret=str(secret),
                                readme=os.path.join(os.getcwd(), "README.md"),
                                port=server.port, pid=os.getpid())
    result = run(code, kernel_layer, guard=False)
    assert result.ok, result
    out = json.loads(result.stdout)
    for key in ("write", "write_cwd", "read", "read_cwd", "connect", "signal"):
        assert out[key].startswith("refused: "), (key, out[key])
    assert out["ppid"] != os.getpid() and out["ppid"] in (0, 1)  # pytest is not even visible
    assert out["processes"] < 5  # its own pid namespace's /proc
    assert mine.read_text() == "original" and not os.path.exists(cwd_file) and server.hits == 0


# ------------------------------------------------------------------------------------------- tool result

def test_python_tool_result():
    assert python_tool_result(run_python("print('hi')")) == "hi"
    assert python_tool_result(run_python("pass")) == "(no output)"
    text = python_tool_result(run_python("print(1)\nimport time\ntime.sleep(9)", limits=Limits(timeout_s=0.5)))
    assert text == "1\n[timed out after 0.5 s]"
    text = python_tool_result(run_python("import socket"))
    assert text.endswith("PermissionError: sandbox: importing socket is not allowed\n"
                         "[blocked: importing socket is not allowed]")
    text = python_tool_result(run_python("import sys\nfor i in range(100): print(i, file=sys.stderr)\n1/0"))
    lines = text.splitlines()
    assert lines[0] == "…" and len(lines) == 1 + parent._TOOL_STDERR_LINES + 1
    assert lines[-2] == "ZeroDivisionError: division by zero" and lines[-1] == "[exit status 1]"


def test_limits_are_checked():
    with pytest.raises(ValueError, match="timeout_s"):
        Limits(timeout_s=0)
