import platform
import subprocess
import sys

import pytest

# A fresh process runs six "steps" through the C library's own malloc and free (as torch's CPU
# allocator does): ten 6 MiB blocks, every page written, then freed newest first, as a training
# step's activations come and go. The kernel's minor page faults are counted over steps 2 to 6.
# The blocks are taken straight from malloc so that no other allocation lands between them: with
# torch tensors, the small objects allocated beside each tensor's data decide, run by run, whether
# the freed space reaches the top of the heap, and the count varied from 2% to 40% of the pages.
STEPS = """
import ctypes, ctypes.util, resource, sys
from decoderlm.training.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 6 * 2**20
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    blocks = [libc.malloc(SIZE) for _ in range(10)]
    for block in blocks:
        ctypes.memset(block, 1, SIZE)
    for block in reversed(blocks):
        libc.free(block)
step()
before = faults()
for _ in range(5):
    step()
print(kept, faults() - before)
"""
PAGES = 5 * 10 * 6 * 2**20 // 4096  # pages the 5 counted steps write


def faults(mode: str) -> tuple[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True
    )
    kept, count = result.stdout.split()
    return kept, int(count)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_kept_memory_is_reused_by_the_next_step_without_page_faults():
    # by default glibc gives the freed 60 MiB back to the kernel (the free space at the top of
    # the heap passes its trim threshold) and each step faults every page in again; with
    # keep_freed_memory the next step writes into the pages the last one freed
    kept, with_kept = faults("keep")
    _, by_default = faults("default")
    assert kept == "True"
    assert by_default > 0.9 * PAGES, (by_default, PAGES)  # what the setting removes
    assert with_kept < 0.05 * PAGES, (with_kept, PAGES)
