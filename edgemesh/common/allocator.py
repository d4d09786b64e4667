"""The C allocator of a process that trains: a tensor freed goes back to the kernel, not to a heap that keeps it.

glibc's ``malloc`` serves a block of at least its mmap threshold (128 KiB) with ``mmap`` and returns it with ``munmap``
when freed, but it raises that threshold to the size of each such block freed, up to 32 MiB: after a few steps a
layer's activations and gradients (a few MiB each) come from the heap, and from one heap (arena) per thread that
allocated them, and a heap keeps the pages it freed. A worker computes in a pool of threads
(``asyncio.to_thread``), so its resident memory grew to several steps' worth of activations: on an emulated Pi 3
under its board's 566 MiB, the three members of a model-parallel cluster peaked at 605-656 MiB and one was killed
for memory, where with the threshold fixed and two arenas they held 432 MiB each. Fixing the threshold (which turns
its adjustment off) and capping the arenas costs a page fault per fresh page of a large tensor; on a board whose
memory is the limit that is the trade to make. Not glibc (musl, macOS): nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
"""``mallopt`` parameters (glibc's ``malloc.h``)."""
MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's own initial threshold, held there."""
ARENAS = 2
"""The event loop's thread and the compute threads share at most this many heaps."""


def lean() -> bool:
    """Fix glibc's mmap threshold and cap its arenas for this process (call it before threads start allocating);
    False where the C library has no ``mallopt`` or refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_ARENA_MAX, ARENAS))
    if not done:
        logger.warning("the C library refused mallopt: freed tensors may stay resident")
    return done
