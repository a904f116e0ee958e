"""Returning a burst's freed heap to the kernel (llmgw_slurm/guard/heap.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmgw_slurm.guard.heap import IDLE_MIN_GROWTH, MIN_GROWTH, HeapTrimmer, glibc_heap

MIB = 1024 * 1024


class FakeHeap:
    """A heap whose free bytes the test sets; it knows only the trimmer's two calls."""

    def __init__(self) -> None:
        self.free = 0
        self.trimmed = 0

    def free_bytes(self) -> int:
        return self.free

    def trim(self) -> None:
        self.trimmed += 1

    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"the trimmer asked the heap for {name!r}")


def _trimmer(heap: FakeHeap | None) -> tuple[HeapTrimmer, CollectorRegistry]:
    registry = CollectorRegistry()
    return HeapTrimmer(registry, heap), registry


def _metric(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_a_heap_that_freed_less_than_the_threshold_is_left_alone() -> None:
    heap = FakeHeap()
    t, registry = _trimmer(heap)
    heap.free = MIN_GROWTH - 1
    assert not t.maybe_trim()
    assert heap.trimmed == 0
    assert _metric(registry, "llmgw_heap_untrimmed_bytes") == MIN_GROWTH - 1


def test_a_burst_freed_is_trimmed_once_and_not_again_while_nothing_more_is_freed() -> None:
    heap = FakeHeap()
    t, registry = _trimmer(heap)
    heap.free = 300 * MIB
    assert t.maybe_trim()
    # Trimmed pages stay in the free lists: the same free figure is not a new burst.
    assert not t.maybe_trim()
    assert heap.trimmed == 1
    assert _metric(registry, "llmgw_heap_trims_total") == 1
    assert _metric(registry, "llmgw_heap_untrimmed_bytes") == 0


def test_memory_reused_and_freed_again_is_trimmed_again() -> None:
    heap = FakeHeap()
    t, _ = _trimmer(heap)
    heap.free = 300 * MIB
    t.maybe_trim()
    heap.free = 20 * MIB  # the next burst took most of it (its pages resident again)
    assert not t.maybe_trim()
    heap.free = 300 * MIB  # and gave it back
    assert t.maybe_trim()
    assert heap.trimmed == 2


def test_the_floor_is_the_least_free_seen_between_trims() -> None:
    heap = FakeHeap()
    t, _ = _trimmer(heap)
    heap.free = 300 * MIB
    t.maybe_trim()
    for free in (250, 5, 30):  # looks between: the floor is 5 MiB
        heap.free = free * MIB
        assert not t.maybe_trim()
    heap.free = 5 * MIB + MIN_GROWTH
    assert t.maybe_trim()


def test_an_idle_gateway_returns_a_small_amount_freed_a_busy_one_keeps_it() -> None:
    heap = FakeHeap()
    t, registry = _trimmer(heap)
    heap.free = 4 * MIB
    assert not t.maybe_trim(idle=False)
    assert t.maybe_trim(idle=True)
    assert _metric(registry, "llmgw_heap_untrimmed_bytes") == 0
    heap.free = 4 * MIB + IDLE_MIN_GROWTH - 1  # under the idle amount: left alone
    assert not t.maybe_trim(idle=True)
    assert heap.trimmed == 1


def test_an_idle_trim_first_collects_the_cyclic_garbage_a_busy_one_leaves_it() -> None:
    class Conn:
        pass

    heap = FakeHeap()
    t, _ = _trimmer(heap)
    gc.disable()  # only the trimmer collects within this test
    try:
        a = Conn()
        a.peer = a  # type: ignore[attr-defined]  # a cycle, as a transport and its protocol
        gone = weakref.ref(a)
        del a
        t.maybe_trim(idle=False)
        assert gone() is not None
        t.maybe_trim(idle=True)
        assert gone() is None
    finally:
        gc.enable()


def test_without_glibc_the_trimmer_does_nothing() -> None:
    t, registry = _trimmer(None)
    assert not t.maybe_trim()
    assert _metric(registry, "llmgw_heap_trims_total") == 0
    assert b"llmgw_heap_untrimmed_bytes 0.0" in generate_latest(registry)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_this_process_heap_is_given_back_after_a_burst_of_buffers() -> None:
    heap = glibc_heap()
    if heap is None:
        pytest.skip("the C library is not glibc 2.33 or later")
    registry = CollectorRegistry()
    t = HeapTrimmer(registry, heap)
    t.maybe_trim()  # whatever the tests before left free
    # 32 KiB buffers (under malloc's mmap threshold: in the heap, as TLS
    # buffers are), each followed by a small one that stays: the freed buffers
    # cannot merge into the top of the heap, which free() alone would return.
    buffers, pins = [], []
    for _ in range(4096):  # 128 MiB
        buffers.append(bytearray(32 * 1024))
        pins.append(bytearray(2048))
    before = _rss_kib()
    del buffers
    freed = _rss_kib()
    assert freed > before - 32 * 1024, "free() returned the buffers on its own"
    assert _metric(registry, "llmgw_heap_untrimmed_bytes") >= 100 * MIB
    assert t.maybe_trim()
    after = _rss_kib()
    assert after < freed - 100 * 1024, (before, freed, after)
    assert _metric(registry, "llmgw_heap_trims_total") == 1
    assert len(pins) == 4096
