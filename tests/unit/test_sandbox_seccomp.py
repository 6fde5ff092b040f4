"""The sandbox's seccomp filter (grpo/sandbox/seccomp.py) as a program: its system-call numbers are the kernel's
and it assembles. What it refuses, it refuses in tests/unit/test_sandbox_escape.py, inside real sandboxes."""
import os
import re
import struct

import pytest

from grpo.sandbox import seccomp


@pytest.mark.parametrize("arch, header, pattern", [
    ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", r"#define __NR_(\w+)\s+(\d+)"),
    ("aarch64", "/usr/include/asm-generic/unistd.h", r"#define __NR(?:3264)?_(\w+)\s+(\d+)"),
])
def test_the_filter_uses_the_kernels_numbers(arch, header, pattern):
    """Each architecture's table agrees with the kernel's own header (where this machine has it), and the program
    assembles for both."""
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    numbers = {}
    with open(header) as f:
        for line in f:
            match = re.match(pattern, line)
            if match:
                numbers[match.group(1)] = int(match.group(2))
    table = seccomp._TABLES[arch][2]
    assert {name: numbers.get(name) for name in table} == table
    assert set(seccomp.DENIED) | set(seccomp._SPECIAL) <= set(table)
    program = seccomp.program(arch, own_pid=1234)
    assert len(program) % 8 == 0 and program[-8:] == struct.pack("<HBBI", 0x06, 0, 0, 0x80000000)  # ends: kill


def test_no_table_no_filter(monkeypatch):
    monkeypatch.setattr(seccomp.platform, "machine", lambda: "sparc64")
    assert seccomp.architecture() is None and seccomp.program() is None and seccomp.syscall_number("mount") is None
    monkeypatch.setattr(seccomp.platform, "machine", lambda: "arm64")
    assert seccomp.architecture() == "aarch64" and seccomp.syscall_number("mount") == 40
