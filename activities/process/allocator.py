"""The C allocator's settings for the worker process, applied before the Temporal SDK allocates anything.

glibc's malloc serves a request of at least M_MMAP_THRESHOLD bytes (128 KiB at first) with a mapping of its own,
returned to the system when freed. But each time such a block is freed it raises that threshold to the block's
size, up to 32 MiB: after one burst of large messages (one workflow task that brings a run 10,000 signals, decoded
whole by the SDK's core), later large blocks come from the heap, where a few live allocations among them keep the
pages resident. That was most of C2's +90 MB. Setting the threshold stops the raising, so each block of at least
the threshold is given back when freed; the default, 1 MiB, costs an upload nothing measurable, where lower ones
cost it an mmap per buffer (store/settings.py).

Smaller blocks freed after such a burst stay with the heap too, in pages among live ones that glibc returns only
on malloc_trim: the worker calls it every `malloc_trim_interval_seconds`, from a thread of its own (ctypes lets go
of the GIL for the call), which took C2's export worker from +42 MB to +25 MB.
"""

from __future__ import annotations

import ctypes
import threading
import time

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them: no library search at start
        libc.gnu_get_libc_version  # noqa: B018  # only glibc has it; mallopt's numbers are glibc's
    except (OSError, AttributeError):
        return None
    return libc


def configure_allocator(mmap_threshold_bytes: int, trim_interval_seconds: float) -> list[str]:
    """Fix glibc's mmap threshold (and its trim threshold) at `mmap_threshold_bytes` (0: glibc's own dynamic
    threshold), and hand the heap's free pages back every `trim_interval_seconds` (0: never). What was done, a
    line each, for the worker's start-up log."""
    libc = _glibc()
    if libc is None:
        return ["not glibc: malloc_mmap_threshold_bytes and malloc_trim_interval_seconds have no effect here"]
    return [_fix_mmap_threshold(libc, mmap_threshold_bytes), _give_back_free_pages(libc, trim_interval_seconds)]


def _fix_mmap_threshold(libc: ctypes.CDLL, threshold_bytes: int) -> str:
    if threshold_bytes == 0:
        return "the C allocator's own mmap threshold (malloc_mmap_threshold_bytes = 0)"
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, threshold_bytes) and mallopt(_M_TRIM_THRESHOLD, threshold_bytes)):
        return f"glibc refused malloc_mmap_threshold_bytes = {threshold_bytes}: its own threshold stays"
    return f"glibc's mmap and trim thresholds fixed at {threshold_bytes} bytes"


def _give_back_free_pages(libc: ctypes.CDLL, interval_seconds: float) -> str:
    """A daemon thread calls malloc_trim every `interval_seconds`."""
    if interval_seconds == 0:
        return "free heap pages are not given back (malloc_trim_interval_seconds = 0)"
    trim = libc.malloc_trim
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int

    def every_interval() -> None:
        while True:
            time.sleep(interval_seconds)
            trim(0)

    threading.Thread(target=every_interval, name="malloc-trim", daemon=True).start()
    return f"free heap pages given back every {interval_seconds:g} s"
