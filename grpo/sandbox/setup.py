"""The sandbox's setup stage: a first interpreter, the only one that loads ctypes, builds the kernel layers and
then execve()s the interpreter that runs the code (grpo/sandbox/child.py), which so never holds ctypes, nor any
capability, nor a way back.

- namespaces layer: it forks a monitor and a sandbox process. The monitor stays outside the new pid namespace, kills
  the sandbox at the deadline and exits as it did. The sandbox process (pid 1 of new user, pid, mount, network, IPC
  and UTS namespaces, where it stays as init once it has forked the code's process) builds a new root on a tmpfs
  (/usr, the Python installation, /etc/ld.so.cache and /etc/localtime read-only, five device nodes, its own /proc,
  an empty /tmp and the working directory, a `file_mb` tmpfs), pivots into it and detaches the old root, remounts
  everything but the working directory read-only (the device nodes too: they still read and write, but their inodes,
  the caller's own, cannot be changed), then enters a second user and mount namespace: copied into a mount namespace
  of a less privileged user namespace, every mount is locked to its place and its read-only, nosuid, nodev and
  noexec flags can no longer be cleared; there /proc is made read-only too.
- every layer it runs for (namespaces and rlimits): it sets the secure bits that stop root from gaining
  capabilities at execve (locked), empties the bounding, ambient, inheritable, permitted and effective
  capability sets where it may, sets no_new_privs, installs the seccomp filter (grpo/sandbox/seccomp.py) and
  execve()s the final interpreter. Under bubblewrap none of this runs: bwrap does the same with --cap-drop ALL,
  --disable-userns and --seccomp.

Any failure is reported as "setup <why>" on the report pipe and ends the process with status 125: the code never
runs in a half-built sandbox. These functions are shipped as source (`program_source()`) like child.py's.
"""
from __future__ import annotations

import functools
import inspect

BOOTSTRAP = "import sys; exec(compile(sys.argv[1], '<sandbox-setup>', 'exec'))"


@functools.cache
def program_source() -> str:
    """The setup interpreter's -c program: these functions' source (it runs without grpo on its path)."""
    return "from __future__ import annotations\n" + "\n".join(
        inspect.getsource(f) for f in (_mountinfo, _remount_read_only, _new_root, _lock_mounts, _enter_namespaces,
                                       _drop_privileges, _init, _setup))


def _mountinfo() -> list:
    """(mount point, per-mount options) of every mount of this process's mount namespace."""
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
        return [(unescape(fields[4]), fields[5]) for fields in (line.split() for line in f)]


def _remount_read_only(mount, target: str, options: str) -> None:
    """Make the mount at `target` read-only, keeping the flags it has (`options`, from mountinfo): in a user
    namespace a remount must keep those a mount was locked with (nosuid, nodev, noexec, the atime ones)."""
    flags = 32 | 4096 | 1  # MS_REMOUNT | MS_BIND | MS_RDONLY
    for option in options.split(","):
        flags |= {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21,
                  "strictatime": 1 << 24}.get(option, 0)
    mount(None, target, None, flags, None)


def _new_root(config: dict, mount, libc) -> None:
    """Build the sandbox's root on a tmpfs mounted over the (empty) working directory's host path, pivot into it
    and detach the old root. `mount(source, target, fstype, flags, data)` raises OSError on failure."""
    import os

    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 2, 4, 8, 4096, 16384, 1 << 18, 2
    root, new = config["root"], config["root"]  # the new root is built on the working directory's host path

    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for kind, source, target in config["plan"]:
        path = new + target
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if kind == "symlink":
            os.symlink(source, path)
        elif kind == "dir":
            os.makedirs(path, mode=0o755, exist_ok=True)
            mount(source, path, None, MS_BIND | MS_REC, None)
        elif kind == "file":  # a device node or a file: bound onto an empty file
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
            mount(source, path, None, MS_BIND, None)
    os.makedirs(new + "/tmp", mode=0o755, exist_ok=True)
    os.makedirs(new + "/proc", mode=0o555, exist_ok=True)
    try:  # its own /proc: this pid namespace's processes only (some containers refuse it: then there is none)
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    except OSError:
        pass
    os.makedirs(new + root, mode=0o700, exist_ok=True)
    mount("tmpfs", new + root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={config['file_mb']}m,mode=700")

    # Read-only too: the device nodes (a read-only mount still lets a device be read and written, but not its
    # inode, which is the caller's own /dev/null: no chmod, no utime), all but the working directory (and /proc,
    # made read-only in _lock_mounts, after the second user namespace's maps are written).
    for target, options in _mountinfo():
        if (target == new or target.startswith(new + "/")) and target not in (new + root, new + "/proc"):
            _remount_read_only(mount, target, options)

    if config["pivot_root"] is None:
        raise OSError("pivot_root's system call number is not known on this architecture")
    os.chdir(new)
    if libc.syscall(config["pivot_root"], b".", b".") != 0:  # the old root ends up stacked over the new one…
        raise OSError("pivot_root failed")
    if libc.umount2(b".", MNT_DETACH) != 0:  # …and is detached
        raise OSError("detaching the old root failed")
    os.chdir("/")


def _lock_mounts(config: dict, mount, unshare) -> None:
    """Enter a second user and mount namespace, so that every mount is locked (no unmount, no clearing of
    read-only), make /proc read-only there and check that only the working directory can be written."""
    import os

    uid, gid = os.getuid(), os.getgid()
    if unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS
        raise OSError("unshare of the second user namespace failed")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    if os.path.ismount("/proc"):
        _remount_read_only(mount, "/proc", dict(_mountinfo())["/proc"])
        for target, options in _mountinfo():
            if target != config["root"] and "ro" not in options.split(","):
                raise OSError(f"{target} is still writable")
    for d in ("/", "/tmp", os.path.dirname(config["root"])):
        probe = os.path.join(d, ".grpo-sandbox-probe")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError:
            continue
        raise OSError(f"{d} is still writable")
    os.chdir(config["root"])


def _enter_namespaces(config: dict, unshare) -> None:
    """Unshare the user, mount, pid, network, IPC and UTS namespaces and fork: the calling process stays outside
    the new pid namespace as the monitor (it kills the sandbox at the deadline, exits as the sandbox did and
    never returns here); the sandbox process (pid 1 inside) returns."""
    import os
    import signal

    CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
    CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
    uid, gid = os.getuid(), os.getgid()
    if unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0:
        raise OSError("unshare failed (user namespaces are not available)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
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


def _drop_privileges(config: dict, prctl, capset, strict: bool) -> None:
    """Lock root out of capabilities, empty every capability set, set no_new_privs and install the seccomp filter.
    `strict`: every step must succeed (in the namespaces, where the process holds the capabilities these steps
    need); otherwise (the rlimits layer, run by a user without capabilities) the steps it may not take are moot."""
    import ctypes
    import os

    PR_SET_SECUREBITS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 28, 24, 47, 4
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    # SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_NO_CAP_AMBIENT_RAISE and the locks of those and KEEP_CAPS
    SECURE_BITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80

    def check(result, what, required=True):
        if result != 0 and required:
            raise OSError(what + " failed: " + os.strerror(ctypes.get_errno()))

    check(prctl(PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0), "setting the secure bits", strict)
    for cap in range(64):
        if prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: past the last capability
                break
            check(-1, "dropping the bounding set", strict)
    check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing the ambient set", False)
    check(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()                   # two (effective, permitted, inheritable) triples of zeros
    check(capset(header, data), "dropping the capabilities")
    program = config["filter"]
    if program:
        class Filter(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
        check(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(Filter(len(program) // 8, program)), 0, 0),
              "installing the seccomp filter")
    if not os.path.exists("/proc/self/status"):  # no /proc (a container refused it): the calls above were checked
        return
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    for field in ("CapInh", "CapPrm", "CapEff", "CapAmb") + (("CapBnd",) if strict else ()):
        if int(status.get(field, "0"), 16):
            raise OSError(f"capabilities left: {field} {status[field].strip()}")
    if status.get("NoNewPrivs", "1").strip() != "1":
        raise OSError("no_new_privs is not set")


def _init(config: dict) -> None:
    """Fork the code's process (pid 2) and stay as its pid namespace's init (pid 1): reap what ends and, once the
    code's process has, exit as it did (128 + n for a death by signal n: init cannot die of its own signal).
    Since the code is not pid 1, its signals act as anywhere else (SIGXCPU at the CPU limit, a SIGTERM it sends
    itself). Returns in the code's process only."""
    import os
    import signal

    child = os.fork()
    if child == 0:
        return
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler: nothing the code sends reaches init
        for fd in (0, 1, 2, config["report_fd"]):
            os.close(fd)
        while True:
            pid, status = os.wait()
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                break
    finally:
        os._exit(code if code >= 0 else 128 - code)


def _setup(config: dict, argv: list) -> None:
    """The setup interpreter's program: build the layers of `config["layer"]` ("namespaces" or "none") and
    execve() `argv`, the interpreter that runs the code; on failure report "setup <why>" and exit 125."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def mount(source, target, fstype, flags, data):
        enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
        if libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) != 0:
            raise OSError(f"mount {target}: {os.strerror(ctypes.get_errno())}")

    try:
        program = b""
        while True:  # the parent writes the filter here once it knows this process's pid, and closes the pipe
            chunk = os.read(config["filter_fd"], 65536)
            if not chunk:
                break
            program += chunk
        os.close(config["filter_fd"])
        config["filter"] = program
        if config["layer"] == "namespaces":
            _enter_namespaces(config, libc.unshare)
            libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL: dies with the monitor
            _new_root(config, mount, libc)
            _lock_mounts(config, mount, libc.unshare)
        else:
            os.chdir(config["root"])
        _drop_privileges(config, libc.prctl, libc.capset, strict=config["layer"] == "namespaces")
        if config["layer"] == "namespaces":
            _init(config)
        os.execve(argv[0], argv, dict(os.environ))
    except BaseException as e:
        try:
            os.write(config["report_fd"], f"\nsetup {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(125)
