"""The C allocator (glibc's malloc) of a CPU process: `keep_freed_memory` for training,
`give_back_freed_memory` after loading or compiling a model.

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

Loading a model works the other way: the weights read (dequantised, converted to float32)
and then converted once more (to bfloat16 or int8 for decoding) leave freed blocks below the
ones that live on, which the top-of-heap rule never gives back: the process stays as large
as the largest form its weights took. `give_back_freed_memory` hands every free page back
(malloc_trim(3)) once the model is ready, and again once its decoding step is compiled
(compiling frees the traced graphs and autotuning's buffers the same way).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

__all__ = ["keep_freed_memory", "give_back_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # bytes: the most glibc takes on 64-bit (4 * 1024 * 1024 * 8)
TRIM_THRESHOLD = 2**30  # bytes of free space kept at the top of the heap


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap threshold to MMAP_THRESHOLD and its trim threshold to
    TRIM_THRESHOLD for this process (mallopt), once. Returns whether both were set: False
    with another C library (musl, macOS, Windows), where nothing changes."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and mmap_set


def give_back_freed_memory() -> bool:
    """Return the free memory of this process's heap to the operating system (glibc's
    malloc_trim(0): the free space at the top of the heap and every whole free page below
    it), so that what it keeps resident is what lives. Returns whether memory was given back:
    False when there was none to give, and with another C library, where nothing is done."""
    libc = _glibc()
    if libc is None:
        return False
    trim = libc.malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim(0) == 1


@functools.cache
def _glibc():
    """The C library as a ctypes.CDLL where it is glibc on Linux, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
