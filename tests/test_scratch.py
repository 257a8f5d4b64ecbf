"""mx_roi.scratch: large host scratch arrays reuse kept buffers, never one still in use."""
import gc
import warnings

import numpy as np
import pytest

from mx_roi import scratch


@pytest.fixture
def small_pool(monkeypatch):
    monkeypatch.setattr(scratch, "MIN_BYTES", 1024)
    monkeypatch.setattr(scratch, "_IDLE", [])
    return scratch


def _addr(a):
    return a.__array_interface__["data"][0]


def test_small_arrays_are_plain(small_pool):
    a = small_pool.empty((10,), np.float32)
    assert a.shape == (10,) and a.dtype == np.float32 and a.base is None
    del a
    gc.collect()
    assert small_pool.idle_bytes() == 0


def test_a_collected_array_gives_its_memory_to_the_next(small_pool):
    a = small_pool.empty((64, 8), np.int32)
    first = _addr(a)
    a[...] = 5
    b = small_pool.empty((64, 8), np.int32)          # a is alive: another buffer
    assert _addr(b) != first
    del a
    gc.collect()
    assert small_pool.idle_bytes() == 64 * 8 * 4
    c = small_pool.empty((32, 16), np.float32)       # same size, another shape and dtype
    assert _addr(c) == first and c.shape == (32, 16) and c.dtype == np.float32
    assert c.flags.c_contiguous and c.flags.writeable
    assert small_pool.idle_bytes() == 0
    b[...] = 1
    c[...] = 2
    assert (b == 1).all()                             # never shared


def test_a_view_keeps_the_buffer_taken(small_pool):
    a = small_pool.empty((1024,), np.float32)
    view = a[10:20]
    del a
    gc.collect()
    assert small_pool.idle_bytes() == 0               # the view still reads it
    view[...] = 3
    del view
    gc.collect()
    assert small_pool.idle_bytes() == 4096


def test_fit_and_cap(small_pool):
    big = small_pool.empty((4096,), np.uint8)
    del big
    gc.collect()
    small = small_pool.empty((1500,), np.uint8)       # 4096 > 2 x 1500: not handed out
    assert small_pool.idle_bytes() == 4096
    arrays = [small_pool.empty((2048 + i,), np.uint8) for i in range(4)]
    del arrays, small
    gc.collect()
    assert len(small_pool._IDLE) == small_pool.MAX_KEPT


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def test_huge_page_advice_keeps_the_data_and_skips_small_arrays():
    """Large arrays are advised (the call succeeds where THP is available); the values
    stay as they were; small or strided arrays are left alone."""
    assert scratch.advise_huge_pages(np.ones(1000, np.float32)) is False
    big = np.arange(4 * scratch.HUGE_MIN_BYTES // 4, dtype=np.float32)
    assert scratch.advise_huge_pages(big[::2]) is False               # not contiguous
    advised = scratch.advise_huge_pages(big)
    if _thp_mode() in ("always", "madvise"):
        assert advised is True
    np.testing.assert_array_equal(big[:5], [0, 1, 2, 3, 4])
    assert big[-1] == big.size - 1


@pytest.fixture
def real_pool(monkeypatch):
    """The real thresholds, an empty set of idle buffers."""
    monkeypatch.setattr(scratch, "_IDLE", [])
    return scratch


def _lease_bytes(a):
    return a.base.raw.nbytes  # the buffer behind a handed-out array


def test_a_too_small_idle_buffer_is_not_handed_out(real_pool):
    """32 MiB given back, 48 MiB asked for: a new buffer of at least 48 MiB (writing all
    of it stays inside it), the 32 MiB one still idle."""
    mib = 1 << 20
    a = real_pool.empty((32 * mib,), np.uint8)
    small = _addr(a)
    del a
    gc.collect()
    assert real_pool.idle_bytes() == 32 * mib
    b = real_pool.empty((12 * mib,), np.float32)       # 48 MiB
    assert _addr(b) != small and _lease_bytes(b) >= 48 * mib
    b[...] = 1
    assert real_pool.idle_bytes() == 32 * mib


def test_size_boundaries(small_pool):
    """MIN_BYTES itself is pooled, one byte less is not; an idle buffer serves exactly its
    size and down to half of it, not one byte less."""
    assert small_pool.empty((1023,), np.uint8).base is None
    assert _lease_bytes(small_pool.empty((1024,), np.uint8)) == 1024
    gc.collect()
    small_pool._IDLE[:] = []
    a = small_pool.empty((4096,), np.uint8)
    del a
    gc.collect()
    for nbytes, served in ((4097, False), (2047, False), (2048, True), (4096, True)):
        b = small_pool.empty((nbytes,), np.uint8)
        assert (small_pool.idle_bytes() == 0) == served, nbytes
        assert _lease_bytes(b) == (4096 if served else nbytes)
        del b
        gc.collect()
        small_pool._IDLE[:] = [r for r in small_pool._IDLE if r.nbytes == 4096]


def test_the_smallest_fitting_buffer_is_taken_and_the_newest_are_kept(small_pool):
    """Of two idle buffers that fit, the smaller (found by identity: ``list.remove`` would
    compare it by value with the others, a NumPy error for buffers of other sizes); of
    more given back than MAX_KEPT, the last ones returned."""
    a, b = small_pool.empty((3000,), np.uint8), small_pool.empty((2000,), np.uint8)
    addr_b = _addr(b)
    del a, b
    gc.collect()
    with warnings.catch_warnings():  # (taken out by identity, never compared by value)
        warnings.simplefilter("error")
        c = small_pool.empty((1800,), np.uint8)       # both fit: the 2000-byte one
    assert _addr(c) == addr_b and small_pool.idle_bytes() == 3000
    del c
    gc.collect()
    arrays = [small_pool.empty((4000 + 100 * i,), np.uint8) for i in range(3)]
    while arrays:                                      # given back in this order
        del arrays[0]
        gc.collect()
    assert sorted(r.nbytes for r in small_pool._IDLE) == [4100, 4200]


def test_huge_page_advice_covers_the_aligned_interior(monkeypatch):
    """madvise gets the 2 MiB pages lying fully inside the memory, no more, no less;
    HUGE_MIN_BYTES itself is advised, one byte less is not."""
    calls = []
    monkeypatch.setattr(scratch, "_madvise", lambda start, n, advice: calls.append(
        (start, n, advice)) or 0)
    huge = 2 << 20
    base = 100 * huge
    assert scratch.advise_huge_pages_at(base + 5, scratch.HUGE_MIN_BYTES - 1) is False
    assert calls == []
    assert scratch.advise_huge_pages_at(base, scratch.HUGE_MIN_BYTES) is True
    assert calls[-1] == (base, scratch.HUGE_MIN_BYTES, 14)
    assert scratch.advise_huge_pages_at(base + 5, 5 * huge) is True
    assert calls[-1] == (base + huge, 4 * huge, 14)
    assert scratch.advise_huge_pages_at(base + 5, 5 * huge - 6) is True  # ends 1 short
    assert calls[-1] == (base + huge, 3 * huge, 14)
    assert scratch.advise_huge_pages_at(0, 4 * huge) is False          # no address
