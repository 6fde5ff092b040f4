"""The sandbox's seccomp filter: a classic BPF program, built here with `struct` (no library), that the kernel runs
on every system call of the sandboxed process and its children. `program()` gives it for this machine's
architecture (x86_64 or aarch64), or None where there is no table.

What it refuses, with EPERM (clone3 with ENOSYS, so that the C library falls back to clone, whose flags a filter
can read): changing mounts or the root (mount, umount2, pivot_root, chroot, the new mount API), entering or
making namespaces (unshare, setns, clone with a CLONE_NEW* flag), reaching into other processes (ptrace,
process_vm_readv/writev, process_madvise, pidfd_getfd, kcmp), the kernel keyrings, bpf, perf_event_open,
userfaultfd, io_uring, file handles (name_to_handle_at, open_by_handle_at), memory the address-space limit does
not count (memfd_create, memfd_secret, System V shared memory, message queues and semaphores, POSIX message
queues), kernel modules, kexec, reboot, swap, accounting, the kernel log, quotas, every socket() (socketpair of
AF_UNIX stays: it reaches nobody else), and the ioctls that push input into a terminal (TIOCSTI, TIOCLINUX).
Where the sandbox has no pid namespace (`own_pid` given), signals may only go to the sandboxed process itself
or its own process group. A system call of another architecture (i386 or x32 calls on x86_64, whose numbers
mean other things) kills the process.

The filter is installed after no_new_privs and survives execve; under bubblewrap it is passed with --seccomp.
"""
from __future__ import annotations

import errno
import platform
import struct

# classic BPF opcodes (linux/filter.h, linux/bpf_common.h)
_LD_W_ABS = 0x20            # BPF_LD | BPF_W | BPF_ABS: A = 32-bit word of seccomp_data at k
_JEQ, _JGE, _JSET = 0x15, 0x35, 0x45   # BPF_JMP | BPF_JEQ/JGE/JSET | BPF_K
_RET = 0x06                 # BPF_RET | BPF_K
# seccomp return values (linux/seccomp.h)
_KILL_PROCESS, _ERRNO, _ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# offsets in struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (little-endian: the
# low 32 bits of args[i] are at 16 + 8 i)
_NR, _ARCH = 0, 4


def _arg_low(i: int) -> int:
    return 16 + 8 * i


_X32_SYSCALL_BIT = 0x40000000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (CLONE_NEWTIME, 0x80, is clone3/unshare only)
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_AF_UNIX = 1
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C

# The refused calls, by name; the numbers are each architecture's (asm/unistd_64.h on x86_64,
# asm-generic/unistd.h on aarch64), listed in _TABLES.
DENIED = (
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "name_to_handle_at", "open_by_handle_at", "fanotify_init",
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "msgget", "semget", "mq_open",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "acct", "syslog", "quotactl", "quotactl_fd", "lookup_dcookie", "vhangup", "setpriority",
    "pidfd_open", "pidfd_send_signal",
    "socket",
)
# also: "iopl", "ioperm", "uselib" where they exist
_X86_ONLY = ("iopl", "ioperm", "uselib")
# Calls with a rule on their arguments (see program()).
_SPECIAL = ("clone", "clone3", "socketpair", "ioctl", "kill", "tkill", "tgkill", "rt_sigqueueinfo",
            "rt_tgsigqueueinfo")

_TABLES = {
    # AUDIT_ARCH_X86_64, and the numbers of asm/unistd_64.h
    "x86_64": (0xC000003E, True, dict(
        mount=165, umount2=166, pivot_root=155, chroot=161, unshare=272, setns=308, open_tree=428, move_mount=429,
        fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, process_madvise=440, pidfd_getfd=438, kcmp=312, keyctl=250, add_key=248,
        request_key=249, bpf=321, perf_event_open=298, userfaultfd=323, io_uring_setup=425, io_uring_enter=426,
        io_uring_register=427, name_to_handle_at=303, open_by_handle_at=304, fanotify_init=300, memfd_create=319,
        memfd_secret=447, shmget=29, shmat=30, shmctl=31, msgget=68, semget=64, mq_open=240, kexec_load=246,
        kexec_file_load=320, init_module=175, finit_module=313, delete_module=176, reboot=169, swapon=167,
        swapoff=168, acct=163, syslog=103, quotactl=179, quotactl_fd=443, lookup_dcookie=212, vhangup=153,
        setpriority=141, pidfd_open=434, pidfd_send_signal=424, socket=41, iopl=172, ioperm=173, uselib=134,
        clone=56, clone3=435, socketpair=53, ioctl=16, kill=62, tkill=200, tgkill=234, rt_sigqueueinfo=129,
        rt_tgsigqueueinfo=297)),
    # AUDIT_ARCH_AARCH64, and the numbers of asm-generic/unistd.h
    "aarch64": (0xC00000B7, False, dict(
        mount=40, umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268, open_tree=428, move_mount=429,
        fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, ptrace=117, process_vm_readv=270,
        process_vm_writev=271, process_madvise=440, pidfd_getfd=438, kcmp=272, keyctl=219, add_key=217,
        request_key=218, bpf=280, perf_event_open=241, userfaultfd=282, io_uring_setup=425, io_uring_enter=426,
        io_uring_register=427, name_to_handle_at=264, open_by_handle_at=265, fanotify_init=262, memfd_create=279,
        memfd_secret=447, shmget=194, shmat=196, shmctl=195, msgget=186, semget=190, mq_open=180, kexec_load=104,
        kexec_file_load=294, init_module=105, finit_module=273, delete_module=106, reboot=142, swapon=224,
        swapoff=225, acct=89, syslog=116, quotactl=60, quotactl_fd=443, lookup_dcookie=18, vhangup=58,
        setpriority=140, pidfd_open=434, pidfd_send_signal=424, socket=198, clone=220, clone3=435, socketpair=199,
        ioctl=29, kill=129, tkill=130, tgkill=131, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240)),
}
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def architecture() -> str | None:
    """This machine's architecture if the filter has a table for it, else None."""
    machine = platform.machine().lower()
    machine = _ALIASES.get(machine, machine)
    return machine if machine in _TABLES else None


def syscall_number(name: str, arch: str | None = None) -> int | None:
    """The number of system call `name` on `arch` (default: this machine), or None."""
    arch = arch or architecture()
    return _TABLES[arch][2].get(name) if arch else None


class _Assembler:
    """A forward-only BPF program with named labels (every jump of classic BPF goes forward, at most 255)."""

    def __init__(self):
        self.code: list[tuple[int, object, object, int]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int = 0, jt: object = 0, jf: object = 0) -> None:
        self.code.append((code, jt, jf, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = []
        for i, (code, jt, jf, k) in enumerate(self.code):
            offsets = []
            for target in (jt, jf):
                off = target if isinstance(target, int) else self.labels[target] - i - 1
                if not 0 <= off <= 255:
                    raise ValueError(f"seccomp: jump of {off} at {i}")
                offsets.append(off)
            out.append(struct.pack("<HBBI", code, offsets[0], offsets[1], k & 0xFFFFFFFF))
        return b"".join(out)


def program(arch: str | None = None, *, own_pid: int | None = None) -> bytes | None:
    """The filter for `arch` (default: this machine) as the bytes of a `struct sock_filter` array, or None where
    there is no table. With `own_pid` (the sandbox without a pid namespace), kill, tgkill and rt_*sigqueueinfo may
    only address that process (kill also 0 and -own_pid: its process group) and tkill is refused."""
    arch = arch or architecture()
    if arch is None:
        return None
    audit_arch, x86, nr = _TABLES[arch]
    a = _Assembler()
    a.op(_LD_W_ABS, _ARCH)
    a.op(_JEQ, audit_arch, 0, "kill")
    a.op(_LD_W_ABS, _NR)
    if x86:
        a.op(_JGE, _X32_SYSCALL_BIT, "kill", 0)
    for name in DENIED + (_X86_ONLY if x86 else ()):
        a.op(_JEQ, nr[name], "deny", 0)
    a.op(_JEQ, nr["clone3"], "enosys", 0)
    a.op(_JEQ, nr["clone"], "clone", 0)
    a.op(_JEQ, nr["socketpair"], "socketpair", 0)
    a.op(_JEQ, nr["ioctl"], "ioctl", 0)
    if own_pid is not None:
        a.op(_JEQ, nr["tkill"], "deny", 0)
        a.op(_JEQ, nr["kill"], "kill_pid", 0)
        for name in ("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
            a.op(_JEQ, nr[name], "own_tgid", 0)
    a.op(_RET, _ALLOW)

    a.label("clone")  # flags are its first argument on both architectures
    a.op(_LD_W_ABS, _arg_low(0))
    a.op(_JSET, _CLONE_NEW, "deny", "allow")
    a.label("socketpair")
    a.op(_LD_W_ABS, _arg_low(0))
    a.op(_JEQ, _AF_UNIX, "allow", "deny")
    a.label("ioctl")  # the request is an unsigned int: the kernel ignores the upper 32 bits
    a.op(_LD_W_ABS, _arg_low(1))
    a.op(_JEQ, _TIOCSTI, "deny", 0)
    a.op(_JEQ, _TIOCLINUX, "deny", "allow")
    if own_pid is not None:  # pid_t is an int: the kernel reads the lower 32 bits
        a.label("kill_pid")
        a.op(_LD_W_ABS, _arg_low(0))
        a.op(_JEQ, own_pid, "allow", 0)
        a.op(_JEQ, 0, "allow", 0)
        a.op(_JEQ, -own_pid & 0xFFFFFFFF, "allow", "deny")
        a.label("own_tgid")
        a.op(_LD_W_ABS, _arg_low(0))
        a.op(_JEQ, own_pid, "allow", "deny")
    a.label("allow")
    a.op(_RET, _ALLOW)
    a.label("enosys")
    a.op(_RET, _ERRNO | errno.ENOSYS)
    a.label("deny")
    a.op(_RET, _ERRNO | errno.EPERM)
    a.label("kill")
    a.op(_RET, _KILL_PROCESS)
    return a.assemble()
