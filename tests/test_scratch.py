"""mx_roi.scratch: large host scratch arrays reuse kept buffers, never one still in use."""
import gc

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
