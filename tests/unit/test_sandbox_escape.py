"""grpo.sandbox against escapes, each attempted for real under every layer this machine has (bwrap, namespaces,
rlimits), checking the host afterwards: a marker file keeps its content, a secret does not leak, no connection
arrives, no process outside is reached.

- With the guard switched off (`guard=False`, as crafted bytecode or a CPython bug would switch it off), the
  kernel layers alone must stop the writes, the reads, the unmounts and remounts, the network, the signals and
  the memory not counted by RLIMIT_AS; `filtered=False` also leaves the seccomp filter out, to show that the
  locked mounts and the dropped capabilities hold by themselves. Under rlimits alone nothing but the filter
  holds: `EXPECTED` pins what docs/sandbox.md says of each layer, measured here.
- With the guard on: the escapes from the guard itself (finalisers that run after the audit hooks are cleared,
  ctypes loaded before the guard) and from the report (closing or replacing its pipe, writing to it).
"""
import json
import os
import platform
import string

import pytest

from grpo.sandbox import parent
# the fixtures too (layer, server, and no_leftovers, which checks after each test that no process is left)
from tests.unit.test_sandbox import FAST, layer, no_leftovers, run, server, _skip_unless_available  # noqa: F401

KERNEL_LAYERS = [pytest.param("namespaces"), pytest.param("bwrap")]
ROOT = os.geteuid() == 0

# What the code gets to do with the guard off: "refused" or "done", per attack and layer (docs/sandbox.md's table).
# Under rlimits alone the files are the caller's: what its user may write and read, the code may.
EXPECTED = {
    "overwrite a file outside": ("refused", "refused", "done"),
    "create a file in the run directory": ("refused", "refused", "done"),
    "read a file outside": ("refused", "refused", "done"),
    "read the run directory": ("refused", "refused", "done"),
    "list the temporary directory": ("refused", "refused", "done"),
    "write /dev/shm": ("refused", "refused", "done"),
    # the caller's own device node, to the mode it has: bwrap binds it writable, and the caller's root owns it
    "change a device node (chmod /dev/null)": ("done" if ROOT else "refused", "refused", "done" if ROOT else "refused"),
    # writing a kernel setting (the value it has): a caller's root may, by file permissions alone
    "write /proc/sys": ("refused", "refused", "done" if ROOT else "refused"),
    "signal the caller": ("refused", "refused", "refused"),
    # under a pid namespace there is no other process to signal (ESRCH); without, the filter refuses it
    "signal every process (kill -1, 0)": ("refused", "refused", "refused"),
    "read the caller's memory (process_vm_readv)": ("refused", "refused", "refused"),
    # /proc/<pid>/mem needs what ptrace needs: root without capabilities lacks it; another user may have it
    "read the caller's memory (/proc/pid/mem)": ("refused", "refused", "refused" if ROOT else None),
    "open a network socket": ("refused", "refused", "refused"),
    "connect to the caller": ("refused", "refused", "refused"),
    "memfd_create": ("refused", "refused", "refused"),
    "System V shared memory": ("refused", "refused", "refused"),
    "a new user namespace": ("refused", "refused", "refused"),
}
# Only where the sandbox has its own mount namespace (elsewhere they would act on the caller's mounts).
EXPECTED_MOUNTS = {
    "unmount /tmp": ("refused", "refused"),
    "unmount /proc": ("refused", "refused"),
    "remount / read-write": ("refused", "refused"),
    "write /": ("refused", "refused"),
    "overwrite a file outside after them": ("refused", "refused"),
    "read a file outside after them": ("refused", "refused"),
}
COLUMN = {"bwrap": 0, "namespaces": 1, "none": 2}

_PROBE = r'''
import json, os, sys
out = {"_ctypes loaded at start": any("_ctypes" in line for line in open("/proc/self/maps"))
       or any("ctypes" in m for m in sys.modules)}
import ctypes, mmap, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
out["status"] = {k: status[k].strip() for k in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp")}

def attempt(name, fn):
    try:
        result = fn()
        out[name] = "refused" if result is False or (isinstance(result, int) and result < 0) else "done"
    except Exception as e:
        out[name] = "refused"

def overwrite():
    with open($marker, "r+") as f:
        f.write("pwned")

def create():
    with open($cwd_file, "x") as f:
        f.write("pwned")

def chmod_device():
    os.chmod("/dev/null", os.stat("/dev/null").st_mode & 0o7777)

def sysctl():
    path = "/proc/sys/vm/overcommit_memory"
    value = open(path).read()
    with open(path, "w") as f:
        f.write(value)

def shm():
    with open($shm_file, "x") as f:
        f.write("x" * 4096)

def vm_read():
    buf = ctypes.create_string_buffer(8)
    local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
    remote = (ctypes.c_void_p * 2)($address, 8)
    return libc.process_vm_readv($pid, local, 1, remote, 1, 0)

def proc_mem():
    with open("/proc/$pid/mem", "rb") as f:
        f.seek($address)
        return f.read(8)

def memfd():
    fds = []
    for _ in range($memfds):  # 60: 960 MB with memory_mb=512, which RLIMIT_AS does not count
        fd = libc.memfd_create(b"x", 0)  # not os.memfd_create, which the sandbox deletes
        if fd < 0:
            return fd
        os.ftruncate(fd, 16 << 20)
        for _ in range(16):
            os.write(fd, b"x" * (1 << 20))
        fds.append(fd)
    for fd in fds:  # held: now give the descriptors back for the attempts below
        os.close(fd)

def sysv():
    shmid = libc.shmget(0, 1 << 20, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
    if shmid >= 0:
        libc.shmctl(shmid, 0, None)  # IPC_RMID
    return shmid

attempt("overwrite a file outside", overwrite)
attempt("create a file in the run directory", create)
attempt("read a file outside", lambda: open($secret).read())
attempt("read the run directory", lambda: open($readme).read())
attempt("list the temporary directory", lambda: os.listdir($tmp))
attempt("write /dev/shm", shm)
attempt("write /proc/sys", sysctl)
attempt("change a device node (chmod /dev/null)", chmod_device)
attempt("signal the caller", lambda: os.kill($pid, 0))
attempt("signal every process (kill -1, 0)", lambda: os.kill(-1, 0))
attempt("read the caller's memory (process_vm_readv)", vm_read)
attempt("read the caller's memory (/proc/pid/mem)", proc_mem)
attempt("open a network socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
attempt("connect to the caller", lambda: socket.create_connection(("127.0.0.1", $port), timeout=1))
attempt("memfd_create", memfd)
attempt("System V shared memory", sysv)
if $mounts:
    MNT_DETACH, MS_REMOUNT, MS_BIND = 2, 32, 4096
    def write_root():
        open("/grpo-sandbox-probe", "x").close()
        os.unlink("/grpo-sandbox-probe")  # if it were the caller's root, leave nothing behind
    def mount_attacks(suffix):
        attempt("unmount /tmp" + suffix, lambda: libc.umount2(b"/tmp", MNT_DETACH))
        attempt("unmount /proc" + suffix, lambda: libc.umount2(b"/proc", MNT_DETACH))
        attempt("remount / read-write" + suffix, lambda: libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND, None))
        attempt("write /" + suffix, write_root)
        # what the unmounts and the remount were for: the files they would uncover or make writable
        attempt("overwrite a file outside after them" + suffix, overwrite)
        attempt("read a file outside after them" + suffix, lambda: open($secret).read())
    mount_attacks("")
    # last, since it changes this process: a user namespace of its own would give it every capability there
    attempt("a new user namespace", lambda: libc.unshare(0x10000000 | 0x00020000))  # CLONE_NEWUSER | NEWNS
    if out["a new user namespace"] == "done":
        mount_attacks(" from a new user namespace")
else:
    attempt("a new user namespace", lambda: libc.unshare(0x10000000))
print(json.dumps(out))
'''


def _probe(sandbox_layer, tmp_path, server, *, filtered=True):
    """Run _PROBE with the guard off; the outcomes, after checking the host."""
    marker, secret = tmp_path / "marker.txt", tmp_path / "secret.txt"
    marker.write_text("original")
    secret.write_text("TOPSECRET")
    cwd_file = os.path.join(os.getcwd(), f"grpo-sandbox-was-here-{os.getpid()}.txt")
    shm_file = f"/dev/shm/grpo-sandbox-probe-{os.getpid()}"
    canary = b"grpo-canary-" + os.urandom(8).hex().encode()
    code = string.Template(_PROBE).substitute(
        marker=repr(str(marker)), cwd_file=repr(cwd_file), secret=repr(str(secret)),
        readme=repr(os.path.join(os.getcwd(), "README.md")), tmp=repr(str(tmp_path)), shm_file=repr(shm_file),
        pid=os.getpid(), address=id(canary) + 32, port=server.port, mounts=repr(sandbox_layer != "none"),
        memfds=60 if filtered else 1)  # unfiltered, one shows that it is the filter that refuses them
    try:
        result = run(code, sandbox_layer, guard=False, limits=parent.Limits(timeout_s=10.0, memory_mb=512),
                     filtered=filtered)
        assert result.ok, result
        out = json.loads(result.stdout)
        assert "TOPSECRET" not in result.stdout and "grpo-canary" not in result.stdout
    finally:
        written = os.path.exists(cwd_file) or os.path.exists(shm_file)
        for path in (cwd_file, shm_file):
            if os.path.exists(path):
                os.remove(path)
    # what the host sees agrees with what the code saw
    assert (marker.read_text() != "original") == (out["overwrite a file outside"] == "done")
    assert written == (out["create a file in the run directory"] == "done" or out["write /dev/shm"] == "done")
    assert server.hits == 0
    assert out["_ctypes loaded at start"] is False  # the code's interpreter never loaded ctypes
    return out


def test_without_the_guard_each_layer_stops_what_it_says(layer, tmp_path, server):
    out = _probe(layer, tmp_path, server)
    column = COLUMN[layer]
    measured = {attack: out[attack] for attack in EXPECTED}
    expected = {attack: row[column] for attack, row in EXPECTED.items()}
    if expected["read the caller's memory (/proc/pid/mem)"] is None:  # as another user it depends on Yama
        expected["read the caller's memory (/proc/pid/mem)"] = measured["read the caller's memory (/proc/pid/mem)"]
    assert measured == expected
    if layer != "none":
        assert {attack: out[attack] for attack in EXPECTED_MOUNTS} == {
            attack: row[column] for attack, row in EXPECTED_MOUNTS.items()}
    # no capability left, no_new_privs, the filter: in every layer
    status = out["status"]
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
    if layer != "none" or ROOT:
        assert int(status["CapBnd"], 16) == 0


# The same attacks in plain Python, for the last column of docs/sandbox.md's table: with the guard on.
_GUARDED_PROBE = r'''
import json, os
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "done"
    except (OSError, AttributeError) as e:  # PermissionError from the guard; a function the sandbox deleted
        out[name] = "refused"
def overwrite():
    with open($marker, "r+") as f:
        f.write("pwned")
def sysctl():
    with open("/proc/sys/vm/overcommit_memory", "w") as f:
        f.write(open("/proc/sys/vm/overcommit_memory").read())
attempt("overwrite a file outside", overwrite)
attempt("create a file in the run directory", lambda: open($cwd_file, "x").close())
attempt("read a file outside", lambda: open($secret).read())
attempt("read the run directory", lambda: open($readme).read())
attempt("list the temporary directory", lambda: os.listdir($tmp))
attempt("write /dev/shm", lambda: open($shm_file, "x").close())
attempt("change a device node (chmod /dev/null)", lambda: os.chmod("/dev/null", 0o666))
attempt("write /proc/sys", sysctl)
attempt("signal the caller", lambda: os.kill($pid, 0))
attempt("signal every process (kill -1, 0)", lambda: os.kill(-1, 0))
attempt("open a network socket", lambda: __import__("socket").socket().close())
attempt("memfd_create", lambda: os.memfd_create("x"))
print(json.dumps(out))
'''


def test_with_the_guard_the_same_attacks_are_refused(layer, tmp_path):
    """What docs/sandbox.md says of rlimits with the guard (and of every layer with it): the plain-Python forms
    of the attacks above are refused, the run is `blocked`, and the host is untouched."""
    marker, secret = tmp_path / "marker.txt", tmp_path / "secret.txt"
    marker.write_text("original")
    secret.write_text("TOPSECRET")
    cwd_file = os.path.join(os.getcwd(), f"grpo-sandbox-was-here-{os.getpid()}.txt")
    shm_file = f"/dev/shm/grpo-sandbox-probe-{os.getpid()}"
    code = string.Template(_GUARDED_PROBE).substitute(
        marker=repr(str(marker)), cwd_file=repr(cwd_file), secret=repr(str(secret)),
        readme=repr(os.path.join(os.getcwd(), "README.md")), tmp=repr(str(tmp_path)), shm_file=repr(shm_file),
        pid=os.getpid())
    try:
        result = run(code, layer)
    finally:
        leftovers = [path for path in (cwd_file, shm_file) if os.path.exists(path)]
        for path in leftovers:
            os.remove(path)
    assert result.status == "blocked", result
    out = json.loads(result.stdout)
    assert out == dict.fromkeys(out, "refused") and len(out) == 12
    assert marker.read_text() == "original" and leftovers == [] and "TOPSECRET" not in result.stdout


@pytest.mark.parametrize("kernel_layer", KERNEL_LAYERS)
def test_without_the_guard_and_the_filter_the_mounts_hold(kernel_layer, tmp_path, server):
    """Without the seccomp filter too: the dropped capabilities and the locked mounts still stop the writes, the
    reads, unmounting and remounting, even from a user namespace of the code's own (where it holds every
    capability); what the filter alone refuses (memfd, sockets, System V memory) is allowed then."""
    _skip_unless_available(kernel_layer)
    out = _probe(kernel_layer, tmp_path, server, filtered=False)
    for attack in ("overwrite a file outside", "create a file in the run directory", "read a file outside",
                   "read the run directory", "list the temporary directory", "write /dev/shm", "write /proc/sys",
                   "signal the caller", "read the caller's memory (process_vm_readv)",
                   "read the caller's memory (/proc/pid/mem)", "connect to the caller", *EXPECTED_MOUNTS):
        assert out[attack] == "refused", attack
    assert out["memfd_create"] == "done" and out["open a network socket"] == "done"
    if out["a new user namespace"] == "done":  # bwrap --disable-userns refuses it; the namespaces layer does not
        for attack in EXPECTED_MOUNTS:
            assert out[attack + " from a new user namespace"] == "refused", attack
    assert int(out["status"]["CapEff"], 16) == 0 and out["status"]["Seccomp"] == "0"
    assert out["change a device node (chmod /dev/null)"] == EXPECTED["change a device node (chmod /dev/null)"][
        COLUMN[kernel_layer]]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 system-call ABIs")
def test_system_calls_of_another_abi_kill_the_process(layer):
    """The filter matches x86_64 numbers: an i386 (int 0x80) or x32 call, whose numbers mean other things, ends the
    process (SIGSYS) instead of passing unchecked."""
    x32 = "import ctypes\nctypes.CDLL(None).syscall(0x40000000 | 272, 0x10000000)\nprint('survived')"  # x32 unshare
    i386 = ("import ctypes, mmap\n"
            "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
            "page.write(b'\\xb8\\x14\\x00\\x00\\x00\\xcd\\x80\\xc3')  # mov eax, 20 (i386 getpid); int 0x80; ret\n"
            "address = ctypes.addressof(ctypes.c_char.from_buffer(page))\n"
            "ctypes.CFUNCTYPE(ctypes.c_int)(address)()\nprint('survived')")
    for code in (x32, i386):
        result = run(code, layer, guard=False)
        assert (result.status, result.detail, result.stdout) == ("error", "killed by SIGSYS", ""), result


# ------------------------------------------------------------------------------------------- the guard

def test_a_finaliser_does_not_outlive_the_guard(layer, tmp_path):
    """Objects the interpreter finalises after it clears the audit hooks (one kept alive by a hook of the code's
    own, or by the codec registry) would run unguarded; the child ends with os._exit, so they never run."""
    marker = tmp_path / "marker.txt"
    marker.write_text("original")
    evil = ("import os\n"
            "class Evil:\n"
            "    def __call__(self, *args):\n"
            "        return None\n"
            f"    def __del__(self, o=os.open, w=os.write, flags=os.O_WRONLY | os.O_TRUNC, path={str(marker)!r}):\n"
            "        w(o(path, flags), b'pwned')\n")
    result = run(evil + "import sys\nsys.addaudithook(Evil())", layer)
    assert (result.status, result.detail) == ("blocked", "blocked: adding audit hooks is not allowed")
    result = run(evil + "import codecs\ncodecs.register(Evil())\nprint('registered')", layer)
    assert result.ok and result.stdout == "registered\n"
    assert marker.read_text() == "original"


def test_ctypes_is_never_in_the_codes_process(layer):
    """The setup that needs ctypes runs in another interpreter, which execve()s the code's: no cached _ctypes to
    come back without an import event."""
    result = run("import sys\nprint(sorted(m for m in sys.modules if 'ctypes' in m))\n"
                 "sys.modules['_imp'].create_dynamic(__import__('importlib.util').util.find_spec('_ctypes'))",
                 layer)
    assert result.stdout == "[]\n"
    assert (result.status, result.detail) == ("blocked", "blocked: importing _ctypes is not allowed")


# -------------------------------------------------------------------------------------------- the report

_REFUSED_THEN_OK = ("try:\n    open({marker!r}, 'w').write('pwned')\nexcept PermissionError:\n    pass\n"
                    "import sys\nsys.exit(0)")


@pytest.mark.parametrize("tamper", [
    "import os\nos.closerange(0, 10**6)",
    "import os\nr, w = os.pipe()\nfor fd in range(3, 40):\n    if fd not in (r, w):\n"
    "        try:\n            os.dup2(w, fd)\n        except OSError:\n            pass",
    "import os\nfor fd in range(3, 40):\n    try:\n        os.write(fd, b'exit 0')\n    except OSError:\n"
    "        pass",
], ids=["every descriptor closed", "another pipe in its place", "half a line before the guard's"])
def test_the_report_cannot_be_lost_or_faked(layer, tmp_path, tamper):
    """A refusal is reported even when the code closed, replaced or wrote to the report pipe first: such a run
    is never `ok`."""
    marker = tmp_path / "marker.txt"
    marker.write_text("original")
    result = run(tamper + "\n" + _REFUSED_THEN_OK.format(marker=str(marker)), layer)
    assert result.status == "blocked", result
    assert marker.read_text() == "original"


# The report's descriptor, as the code can find it: the pipe it may write to (the guard refuses nothing here).
_FIND_REPORT = ("import fcntl, os, stat\n"
                "def writable_pipe(fd):\n"
                "    try:\n"
                "        return (stat.S_ISFIFO(os.fstat(fd).st_mode)\n"
                "                and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY)\n"
                "    except OSError:\n"
                "        return False\n"
                "fd = [fd for fd in range(3, 64) if writable_pipe(fd)][0]\n")


def test_tampering_with_the_report_alone_fails_the_run(layer):
    """Even with nothing refused: a report pipe closed, replaced or written to makes the run an error."""
    replaced = "sandbox: the code closed or replaced the report pipe"
    garbled = "sandbox: the report pipe carried something else than the sandbox's report"
    for code, detail in (("os.close(fd)", replaced),
                         ("r, w = os.pipe()\nos.dup2(w, fd)", replaced),
                         ("os.write(fd, b'\\nexit 0\\nok\\n')", garbled),
                         ("os.write(fd, b'x' * 10000)", garbled)):
        result = run(_FIND_REPORT + code, layer)
        assert (result.status, result.detail) == ("error", detail), (code, result)


def test_many_refusals_are_reported_not_cut():
    """The report pipe is read line by line without a limit (only stdout and stderr count towards the output
    limit): code that keeps provoking refusals is `blocked`, not `output`."""
    result = parent.run_python("for i in range(20000):\n    try:\n        open('/etc/passwd')\n"
                               "    except PermissionError:\n        pass\nprint('done')", limits=FAST)
    assert (result.status, result.stdout) == ("blocked", "done\n"), result


def test_the_report_parser():
    report = parent._Report()
    for chunk in (b"\nblocked reading /etc/pass", b"wd is not allowed\n\nexi", b"t 0\n"):
        report.add(chunk)
    report.done()
    assert report.blocked == "reading /etc/passwd is not allowed" and report.exited and not report.garbled
    report = parent._Report()
    report.add(b"junk\nblocked x\n")  # a line of the code's own: garbled, and the refusal still counts
    assert report.garbled and report.blocked == "x"
    report = parent._Report()
    report.add(b"y" * (parent._REPORT_LINE_BYTES + 1))  # too long for a line of the sandbox's
    assert report.garbled


# ------------------------------------------------------------------------------------- rlimits alone

def test_rlimits_alone_is_refused_unless_accepted(monkeypatch):
    """Where no kernel layer works, run_python refuses to run code (one line, a GRPOError: the CLI prints it and
    exits 2) unless GRPO_SANDBOX_RLIMITS_ONLY=1 accepts the guard as the only wall."""
    from grpo.errors import GRPOError
    monkeypatch.setattr(parent, "_layer", lambda: "none")
    monkeypatch.delenv(parent.ALLOW_RLIMITS_ONLY, raising=False)
    with pytest.raises(parent.SandboxUnavailable) as info:
        parent.run_python("print(1)")
    assert isinstance(info.value, GRPOError) and "\n" not in str(info.value)
    assert "GRPO_SANDBOX_RLIMITS_ONLY=1" in str(info.value) and "bubblewrap" in str(info.value)
    from grpo.envs.tool_calls import python_tool
    with pytest.raises(parent.SandboxUnavailable):  # the python tool is refused when it is built
        python_tool()
    monkeypatch.setenv(parent.ALLOW_RLIMITS_ONLY, "1")
    result = parent.run_python("print(1)")
    assert result.ok and result.stdout == "1\n"
    assert python_tool()("print(2)") == "2"
