"""compute.reuse_memory (grpo.allocator): with it glibc keeps freed memory for the next request, so a loop that
allocates and frees a large tensor faults its pages in once instead of every time (counted, not timed)."""
import platform
import subprocess
import sys

import pytest

from grpo.config import Config

LOOP = """
import resource, sys, torch
from grpo.allocator import reuse_freed_memory
took = reuse_freed_memory("cpu") if sys.argv[1] == "on" else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    t = torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB: above glibc's largest mmap threshold
    del t
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    return out[0], int(out[1])


def _huge_pages_always() -> bool:
    """Transparent huge pages for every mapping: a 64 MiB tensor then faults in some 32 pages, not 16 k."""
    try:
        return "[always]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
@pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages 'always': too few faults to count")
def test_freed_memory_is_reused_not_faulted_in_again():
    took, reused = _faults("on")
    _, default = _faults("off")
    assert took == "True"
    # 20 x 64 MiB of 4 KiB pages is about 330 k faults when every tensor is a fresh mapping; once otherwise
    assert default > 200_000 and reused < default / 5, (reused, default)


def test_on_by_default_and_for_the_cpu_only():
    from grpo.allocator import reuse_freed_memory

    assert Config().compute.reuse_memory is True
    assert reuse_freed_memory("cuda:0") is False  # a GPU run's passes are not malloc's: nothing is set
