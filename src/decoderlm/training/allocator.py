"""The C allocator of a CPU training process: `keep_freed_memory`.

A CPU training step allocates and frees the same activations, a few MB each, at every step.
glibc's malloc gives a freed block back to the operating system when the block is above its
mmap threshold, or when the free space at the top of its heap passes its trim threshold
(both adjusted as blocks come and go). The next step then touches those pages afresh, and the
kernel zeroes each one in a page fault. For the default preset in float32 on a 2-core AVX2
EPYC, 150 steps of `decoderlm train` spent 6.6 s in the kernel, against 1.0 s with the
thresholds raised (benchmarks/README.md, "The main job on an AVX2 EPYC").

`keep_freed_memory` raises both thresholds through mallopt(3), so a step reuses the memory
the last step freed. Blocks of MMAP_THRESHOLD or more are still given back when freed, and
the process's peak memory does not change; it keeps what its peak step held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # bytes: the most glibc takes on 64-bit (4 * 1024 * 1024 * 8)
TRIM_THRESHOLD = 2**30  # bytes of free space kept at the top of the heap


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap threshold to MMAP_THRESHOLD and its trim threshold to
    TRIM_THRESHOLD for this process (mallopt), once. Returns whether both were set: False
    with another C library (musl, macOS, Windows), where nothing changes."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and mmap_set
