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
from decoderlm.allocator import keep_freed_memory
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


def fresh_process(script: str, mode: str) -> tuple[str, int]:
    """What `script` prints in a fresh interpreter given `mode`: the setting's return value
    and a count of pages."""
    result = subprocess.run(
        [sys.executable, "-c", script, mode], capture_output=True, text=True, check=True
    )
    said, count = result.stdout.split()
    return said, int(count)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_kept_memory_is_reused_by_the_next_step_without_page_faults():
    # by default glibc gives the freed 60 MiB back to the kernel (the free space at the top of
    # the heap passes its trim threshold) and each step faults every page in again; with
    # keep_freed_memory the next step writes into the pages the last one freed
    kept, with_kept = fresh_process(STEPS, "keep")
    _, by_default = fresh_process(STEPS, "default")
    assert kept == "True"
    assert by_default > 0.9 * PAGES, (by_default, PAGES)  # what the setting removes
    assert with_kept < 0.05 * PAGES, (with_kept, PAGES)


# A fresh process takes 2,000 blocks of 64 KiB from malloc (below glibc's mmap threshold: they
# come from its heap), writes every page, and frees all but the newest: the freed 125 MiB lie
# below a live block, where the top-of-heap rule never returns them. Resident pages are read
# from /proc/self/statm before and after `give_back_freed_memory` (or a plain second reading).
HOLE = """
import ctypes, ctypes.util, sys
from decoderlm.allocator import give_back_freed_memory
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE, COUNT = 64 * 2**10, 2000
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1])
blocks = [libc.malloc(SIZE) for _ in range(COUNT)]
for block in blocks:
    ctypes.memset(block, 1, SIZE)
for block in blocks[:-1]:
    libc.free(block)
before = resident()
given = give_back_freed_memory() if sys.argv[1] == "give" else None
print(given, before - resident())
"""
HOLE_PAGES = 1999 * 64 * 2**10 // 4096  # the pages freed below the live block


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_memory_below_a_live_block_is_given_back_only_when_asked():
    # what a loaded model leaves: its weights' earlier forms freed beneath the ones that live on
    given, returned = fresh_process(HOLE, "give")
    _, unasked = fresh_process(HOLE, "keep")
    assert given == "True"
    assert returned > 0.9 * HOLE_PAGES, (returned, HOLE_PAGES)
    assert unasked < 0.05 * HOLE_PAGES, (unasked, HOLE_PAGES)
