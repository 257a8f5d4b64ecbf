"""mx_roi.parallel: thread count, NumPy's BLAS held at one thread, dynamic split."""
import threading

import numpy as np
import pytest

from mx_roi import parallel


def test_thread_count_env(monkeypatch):
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert parallel.num_threads() == 3
    monkeypatch.delenv("MX_ROI_NUM_THREADS")
    assert parallel.num_threads() == 5           # OMP_NUM_THREADS when ours is unset
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # nested list: the outer level
    assert parallel.num_threads() == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert 1 <= parallel.num_threads() <= parallel.MAX_DEFAULT_THREADS


def test_blas_held_at_one_thread_inside_kernels(monkeypatch):
    if parallel._blas_handles().set is None:
        pytest.skip("NumPy's BLAS exposes no OpenBLAS thread setter here")
    before = parallel.blas_threads()
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "2")
    seen = []
    parallel.for_chunks(list(range(64)), lambda c: seen.append(parallel.blas_threads()))
    assert seen and set(seen) == {1}
    # nested / concurrent users: restored only when the last one leaves
    with parallel.blas_limited():
        with parallel.blas_limited():
            assert parallel.blas_threads() == 1
        assert parallel.blas_threads() == 1
    assert parallel.blas_threads() == before


def test_dynamic_split_covers_every_item_once_and_uses_threads(monkeypatch):
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "3")
    seen, names = [], set()
    lock = threading.Lock()

    def run(chunk):
        with lock:
            seen.extend(chunk)
            names.add(threading.current_thread().name)

    parallel.for_chunks(range(200), run)
    assert sorted(seen) == list(range(200))
    threads, chunks = parallel._split(range(200), parallel.CHUNKS_PER_THREAD)
    assert threads == 3 and len(chunks) == 3 * parallel.CHUNKS_PER_THREAD
    assert [i for c in chunks for i in c] == list(range(200))  # contiguous, in order


def test_sum_into_is_ordered_and_deterministic(monkeypatch):
    """Chunk buffers are added in chunk order whatever thread finishes first: the sum
    is bit-identical to a serial left-to-right sum of the chunks."""
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "2")
    rng = np.random.RandomState(0)
    vals = rng.standard_normal((96, 50)).astype(np.float32) * 10.0 ** rng.randint(-6, 6, (96, 1))

    def fn(chunk, out):
        if chunk[0] == 0:  # the first chunk finishes last
            threading.Event().wait(0.05)
        for i in chunk:
            out += vals[i]

    got = parallel.sum_into((50,), np.float32, list(range(96)), fn)
    _, chunks = parallel._split(range(96), parallel.SUM_CHUNKS_PER_THREAD)
    parts = []
    for c in chunks:
        p = np.zeros(50, np.float32)
        for i in c:
            p += vals[i]
        parts.append(p)
    want = parts[0]
    for p in parts[1:]:
        want = want + p
    assert np.array_equal(got, want)


def test_errors_wait_for_all_chunks_then_raise(monkeypatch):
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "2")
    running = []

    def run(chunk):
        running.append(chunk[0])
        if chunk[0] == 0:
            raise ValueError("chunk 0 failed")
        threading.Event().wait(0.02)
        running.remove(chunk[0])

    with pytest.raises(ValueError, match="chunk 0 failed"):
        parallel.for_chunks(list(range(64)), run)
    assert running == [0]  # every other chunk that was taken had finished


@pytest.mark.parametrize("entry", ("for_chunks", "sum_into"))
def test_the_caller_returns_only_after_every_chunk_finished(entry, monkeypatch):
    """A chunk a pool thread took and is slow to finish is waited for: when the call
    returns, every chunk has finished (sum_into: its result holds every chunk).  The
    caller's first chunk waits until a pool thread has started one, so the pool takes
    part whatever the scheduling."""
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "2")
    caller = threading.current_thread()
    pool_started = threading.Event()
    finished = []

    def work(chunk):
        if threading.current_thread() is caller:
            pool_started.wait(5)
        else:
            pool_started.set()
            threading.Event().wait(0.2)  # slow: still running when the caller is done
        finished.append(chunk[0])

    items = list(range(64))
    if entry == "for_chunks":
        parallel.for_chunks(items, work)
    else:
        got = parallel.sum_into((), np.int64, items, lambda c, out: (work(c), out.__iadd__(
            sum(c))))
        assert got == sum(items)
    assert pool_started.is_set()
    _, chunks = parallel._split(items, parallel.CHUNKS_PER_THREAD if entry == "for_chunks"
                                else parallel.SUM_CHUNKS_PER_THREAD)
    assert sorted(finished) == [c[0] for c in chunks]


def test_thread_count_bounds(monkeypatch):
    """MX_ROI_NUM_THREADS below 1 means 1, a non-number is refused by name; without it,
    OMP_NUM_THREADS when a positive integer (0 is ignored), else the usable cores at most
    MAX_DEFAULT_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for value in ("0", "-2"):
        monkeypatch.setenv("MX_ROI_NUM_THREADS", value)
        assert parallel.num_threads() == 1
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "two")
    with pytest.raises(ValueError, match=r"^MX_ROI_NUM_THREADS='two': expected a positive "
                                         r"integer"):
        parallel.num_threads()
    monkeypatch.delenv("MX_ROI_NUM_THREADS")
    monkeypatch.setattr(parallel, "_cores", 64)
    assert parallel.num_threads() == parallel.MAX_DEFAULT_THREADS == 8
    monkeypatch.setattr(parallel, "_cores", 3)
    assert parallel.num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    assert parallel.num_threads() == 3


def test_threads_start_at_min_rois_per_thread_each(monkeypatch):
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "3")
    m = parallel.MIN_ROIS_PER_THREAD
    for n, threads in ((2 * m - 1, 1), (2 * m, 2), (3 * m - 1, 2), (3 * m, 3), (50 * m, 3)):
        assert parallel._split(range(n), 4)[0] == threads, n


def test_after_an_error_no_further_chunk_starts(monkeypatch):
    """Chunk 0 fails while chunk 1 runs on the other thread: neither thread starts
    another chunk, and the error is raised."""
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "2")
    started, second = [], threading.Event()

    def run(chunk):
        started.append(chunk[0])
        if chunk[0] == 0:
            second.wait(5)
            raise ValueError("chunk 0 failed")
        second.set()
        threading.Event().wait(0.1)  # chunk 0 fails meanwhile

    with pytest.raises(ValueError, match="chunk 0 failed"):
        parallel.for_chunks(list(range(64)), run)
    assert sorted(started) == [0, 8]
