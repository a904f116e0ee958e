"""Give the heap a burst of connections freed back to the kernel.

glibc's malloc keeps memory freed in the middle of its heap resident; only
the top of the heap is returned on its own. Each TLS connection holds large
buffers (the event loop's TLS read buffer, OpenSSL's records), so a burst of
streams leaves a heap that is mostly free and still resident: a gateway
process that had relayed 1,000 concurrent streams from a TLS engine held a
300 MB heap with 13 MB in use, and its resident size rose from one such
burst to the next as new buffers landed on other pages. ``malloc_trim(0)``
returns the free pages in the middle as well (madvise), which took 6 to 7 ms
on that heap.

:class:`HeapTrimmer` trims when the heap's free bytes grew by ``min_growth``
since the least it saw after its last trim: freed memory it has not yet
returned. A heap whose free bytes stay high (already returned, or reused and
freed at the same level) is left alone, so a trim costs only after a burst.
With no request in flight it first collects Python's cyclic garbage and then
trims from :data:`IDLE_MIN_GROWTH` freed: part of what a burst's streams
allocated is left in reference cycles, held until the collector's oldest
generation runs, which may be the next burst (measured after 1,000 streams:
about 240 MB of heap freed by one ``gc.collect()``; which objects, not traced). The daemon
freezes what it allocated at start (``gc.freeze()``), so that the collection
walks only the objects made since.
On a C library without ``mallinfo2`` and ``malloc_trim`` (musl, glibc before
2.33) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["HeapTrimmer", "glibc_heap"]

log = logging.getLogger(__name__)

MIN_GROWTH = 32 * 1024 * 1024
# With no request in flight a trim delays nobody, so a smaller amount freed is
# worth returning: an idle gateway's resident size is then what it uses, which
# is what an operator (and the load test) reads to tell a leak from a burst.
IDLE_MIN_GROWTH = 1024 * 1024


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (malloc.h), every field a size_t.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


class Heap(Protocol):
    """What the trimmer asks of the C library's allocator."""

    def free_bytes(self) -> int:
        """Bytes in free chunks of every arena (resident or not)."""
        ...

    def trim(self) -> None:
        """Return every free page to the kernel."""
        ...


class _Glibc:
    def __init__(self, libc: Any) -> None:
        self._mallinfo2 = libc.mallinfo2
        self._mallinfo2.restype = _MallInfo2
        self._mallinfo2.argtypes = []
        self._malloc_trim = libc.malloc_trim
        self._malloc_trim.restype = ctypes.c_int
        self._malloc_trim.argtypes = [ctypes.c_size_t]

    def free_bytes(self) -> int:
        return int(self._mallinfo2().fordblks)

    def trim(self) -> None:
        self._malloc_trim(0)


def glibc_heap() -> Heap | None:
    """This process's glibc heap, or None when the C library is not glibc 2.33+."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        return _Glibc(libc)
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """Trims the heap after a burst freed ``min_growth`` bytes or more; call
    :meth:`maybe_trim` now and then (the daemon does after each pass)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        heap: Heap | None,
        min_growth: int = MIN_GROWTH,
    ) -> None:
        self._heap = heap
        self._min_growth = min_growth
        # The least free seen since the last trim (none at the start): what is
        # above it was freed since.
        self._low = 0
        self.trims = Counter(
            "llmgw_heap_trims",
            "Times the daemon returned its heap's freed memory to the kernel (malloc_trim).",
            registry=registry,
        )
        # Read at each scrape, not kept up to date by the passes.
        Gauge(
            "llmgw_heap_untrimmed_bytes",
            "Heap bytes freed since the daemon last returned memory to the kernel "
            "(returned after a reconcile pass once they reach 32 MiB, or 1 MiB with no "
            "request in flight).",
            registry=registry,
        ).set_function(self.untrimmed)

    def untrimmed(self) -> int:
        """Bytes freed since the last trim (as far as the looks in between saw)."""
        if self._heap is None:
            return 0
        return max(0, self._heap.free_bytes() - self._low)

    def maybe_trim(self, idle: bool = False) -> bool:
        """Trim when the heap freed ``min_growth`` since the last trim (only
        IDLE_MIN_GROWTH when ``idle``: no request in flight); True if it did."""
        if self._heap is None:
            return False
        if idle:
            gc.collect()
        free = self._heap.free_bytes()
        low = min(self._low, free)
        if free - low < (min(IDLE_MIN_GROWTH, self._min_growth) if idle else self._min_growth):
            self._low = low
            return False
        self._heap.trim()
        # Trimmed pages stay in the free lists: the new floor is what is free now.
        self._low = free
        self.trims.inc()
        log.debug("heap trimmed: %d MiB freed since the last trim", (free - low) >> 20)
        return True
