"""What the C library does with the memory a run frees: `compute.reuse_memory`.

PyTorch takes a CPU tensor's memory from the C library's malloc. glibc serves a block above its mmap threshold
(128 KiB at first, rising to at most 32 MiB as large blocks are freed) with a mapping of its own and unmaps it when
it is freed, and it hands the top of its heap back to the kernel once more than its trim threshold lies free there.
A training step allocates and frees the same activations, logits and gradients in every pass, so every pass asks
the kernel again for pages it has just given back, and the kernel faults and zeroes each one (on a virtual machine
the host may have to back them again too). With `reuse_memory` glibc keeps what is freed for the next request: no
block gets a mapping of its own (M_MMAP_MAX = 0; glibc still maps what a thread's arena cannot hold) and the heap is
trimmed only once 2 GiB lie free at its top (M_TRIM_THRESHOLD). Resident memory then stays near its peak between
passes instead of falling back, and the peak grows a little (1 % on SmolLM2-135M, 5 % on the 1 M tiny-vision job;
docs/benchmarks.md).

Process-wide, for the rest of the process, on glibc only (Linux); elsewhere, and with musl, nothing changes. Applied
for runs whose model is on the CPU, where the passes' tensors are the C library's (on a GPU they are not).
"""
from __future__ import annotations

import ctypes
import functools

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_BYTES = 2**31 - 1  # mallopt takes an int: the largest it holds


def reuse_freed_memory(device) -> bool:
    """For a model on `device` (a torch.device or its name): on the CPU, have glibc's malloc keep the memory the
    process frees for its next requests; whether it took both settings (False on another device, or where the C
    library is not glibc)."""
    return getattr(device, "type", str(device)) == "cpu" and _keep_freed_memory()


@functools.cache
def _keep_freed_memory() -> bool:
    try:
        libc = ctypes.CDLL(None)  # the process's own C library
        libc.gnu_get_libc_version  # glibc's alone: musl has a mallopt too, which ignores these
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: CDLL(None) on Windows
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) & bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))
