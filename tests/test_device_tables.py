"""Geometry tables moved to a GPU in one packed copy (:func:`mx_roi.cuda.tables.to_device`),
checked with NumPy standing in for CuPy: every table comes back with its values, dtype and
shape, at an aligned offset of the one buffer, and the host twin stays reachable."""

import numpy as np
import pytest

from mx_roi import geometry
from mx_roi.cuda.tables import host_tables, int_bins_max_cells, to_device


class OneCopy:
    """``cupy.asarray`` of the packed buffer, recorded (NumPy arrays play device arrays)."""

    def __init__(self):
        self.copies = []

    def asarray(self, buf):
        self.copies.append(buf.nbytes)
        return np.array(buf)  # a copy, as a host-to-device transfer is


def _leaves(geo):
    import dataclasses
    for f in dataclasses.fields(geo):
        v = getattr(geo, f.name)
        if dataclasses.is_dataclass(v):
            yield from ((f"{f.name}.{k}", x) for k, x in _leaves(v))
        else:
            yield f.name, v


@pytest.mark.parametrize("R", [0, 1, 7])
@pytest.mark.parametrize("kind", ["bins", "grid", "caffe"])
def test_every_table_arrives_whole_in_one_copy(kind, R):
    rng = np.random.default_rng(R)
    rois = np.concatenate([rng.integers(0, 2, (R, 1)), rng.uniform(0, 40, (R, 2)),
                           rng.uniform(40, 90, (R, 2))], axis=1).astype(np.float32)
    if kind == "bins":
        geo = geometry.roi_pooling_bins(rois, (3, 2), 0.25, 20, 24, np)
    elif kind == "grid":
        geo = geometry.roi_align_grid(rois, (2, 3), 0.25, -1, True, 20, 24, np)
    else:
        geo = geometry.caffe_align_grid(rois, (2, 2), 0.25, 20, 24, np)
    dev = OneCopy()
    moved = to_device(geo, dev)
    assert len(dev.copies) == 1
    assert host_tables(moved) is geo and host_tables(geo) is geo
    base = None
    for (name, a), (name2, b) in zip(_leaves(geo), _leaves(moved)):
        assert name == name2
        if not isinstance(a, np.ndarray):
            assert b is a, name
            continue
        assert b.dtype == a.dtype and b.shape == a.shape, name
        np.testing.assert_array_equal(b, a, err_msg=name)
        assert b is not a and not np.shares_memory(a, b), name
        if b.size:
            base = b.base if base is None else base
            assert b.base is base, f"{name}: not a view of the one buffer"
            assert b.__array_interface__["data"][0] % 16 == 0, f"{name}: misaligned"


def test_max_cells_read_from_the_host_twin():
    rois = np.array([[0, 0, 0, 60, 30], [1, 8, 8, 9, 9]], np.float32)
    geo = geometry.roi_pooling_bins(rois, (2, 2), 0.25, 20, 24, np)
    moved = to_device(geo, OneCopy())
    moved.hstart = moved.hend = None  # a device table is never read for it
    # roi 0: x 0..60, y 0..30 at 1/4 -> bins of up to 5 rows x 8 columns
    assert int_bins_max_cells(moved) == int_bins_max_cells(geo) == 5 * 8


class PinnedCopy:
    """CuPy's side of the pinned path, on the host: ``cuda.alloc_pinned_memory`` (a
    bytearray), ``empty`` device buffers whose ``data`` pointer copies from a host address
    (``copy_from_host_async``, recorded with its source), ``ndarray`` views over them."""

    class Ptr:
        def __init__(self, mem, offset=0):
            self.mem, self.offset = mem, offset
            self.ptr = mem.__array_interface__["data"][0] + offset

        def __add__(self, o):
            return PinnedCopy.Ptr(self.mem, self.offset + o)

    def __init__(self):
        import types
        self.copies, self.pinned, self.blocks = [], [], []

        def alloc_pinned_memory(n):
            # every block kept alive: a buffer the staging dropped (grown) must not free
            # an address that a later allocation (another thread's) could then reuse
            self.pinned.append(n)
            self.blocks.append(bytearray(n))
            return self.blocks[-1]
        log = self.events = []

        class Event:
            def __init__(self, block, disable_timing):
                assert (block, disable_timing) == (False, True)

            def record(self, stream):
                log.append(("record", stream, len(self_copies)))

            def synchronize(self):
                log.append(("wait", len(self_copies)))
        self_copies = self.copies
        self.cuda = types.SimpleNamespace(alloc_pinned_memory=alloc_pinned_memory,
                                          get_device_id=lambda: 0,
                                          get_current_stream=lambda: "stream", Event=Event)

    def empty(self, shape, dtype):
        import types
        mem = np.zeros(shape, dtype)
        copies = self.copies

        def copy_from_host_async(src, size, stream):
            import ctypes
            copies.append((src.value, size, stream))
            ctypes.memmove(mem.ctypes.data, src.value, size)
        ptr = PinnedCopy.Ptr(mem)
        ptr.copy_from_host_async = copy_from_host_async
        return types.SimpleNamespace(data=ptr, nbytes=mem.nbytes)

    def ndarray(self, shape, dtype, memptr):
        count = int(np.prod(shape))
        return np.frombuffer(memptr.mem, dtype, count, memptr.offset).reshape(shape)


def test_pinned_staging_copy_is_async_reused_grown_and_per_thread():
    """With CuPy the tables are packed into this thread's pinned staging buffer and moved
    by one asynchronous copy on the current stream, an event recorded after it; the next
    call waits for that event before it writes the buffer again, which is kept (same
    address), grown when a call needs more, and each thread has its own."""
    import threading
    from mx_roi.cuda import tables
    rng = np.random.default_rng(3)

    def grid(R):
        rois = np.concatenate([rng.integers(0, 2, (R, 1)), rng.uniform(0, 40, (R, 2)),
                               rng.uniform(40, 90, (R, 2))], axis=1).astype(np.float32)
        return geometry.roi_align_grid(rois, (2, 3), 0.25, -1, True, 20, 24, np)

    fake = PinnedCopy()
    tables._STAGING.__dict__.pop("stagings", None)
    sources = []
    for R in (3, 5, 400):
        geo = grid(R)
        moved = to_device(geo, fake)
        for (name, a), (_, b) in zip(_leaves(geo), _leaves(moved)):
            if isinstance(a, np.ndarray):
                assert b.dtype == a.dtype and b.shape == a.shape, name
                np.testing.assert_array_equal(b, a, err_msg=name)
        src, size, stream = fake.copies[-1]
        assert stream == "stream" and size % 16 == 0
        sources.append(src)
    assert len(fake.copies) == 3
    # record after each copy; before each refill, a wait for the previous copy
    assert fake.events == [("record", "stream", 1), ("wait", 1), ("record", "stream", 2),
                           ("wait", 2), ("record", "stream", 3)]
    assert sources[0] == sources[1] and fake.pinned[0] == 1 << 16  # reused
    assert sources[2] != sources[0] and len(fake.pinned) == 2 and fake.pinned[1] > 1 << 16
    other = []
    t = threading.Thread(target=lambda: other.append(
        (to_device(grid(3), fake), fake.copies[-1][0])))
    t.start()
    t.join()
    assert other[0][1] not in sources and len(fake.pinned) == 3  # its own buffer
    assert tables._staging(fake, tables.STAGING_MAX_BYTES + 1) is None  # too large: pageable


def test_pinning_failure_falls_back_to_pageable_copies(monkeypatch):
    """A host that cannot pin memory: the first failure is remembered (no retry per call)
    and the tables go through a pageable copy, whole."""
    from mx_roi.cuda import tables
    fake = PinnedCopy()
    attempts = []

    def no_pinning(n):
        attempts.append(n)
        raise MemoryError("cudaErrorMemoryAllocation")
    fake.cuda.alloc_pinned_memory = no_pinning
    asarray = []
    fake.asarray = lambda buf: asarray.append(buf.nbytes) or _as_device(fake, buf)
    tables._STAGING.__dict__.pop("stagings", None)
    rois = np.array([[0, 1, 2, 30, 40], [1, 5, 5, 9, 9]], np.float32)
    geo = geometry.roi_align_grid(rois, (2, 3), 0.25, 2, False, 20, 24, np)
    for _ in range(3):
        moved = to_device(geo, fake)
        for (name, a), (_, b) in zip(_leaves(geo), _leaves(moved)):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(b, a, err_msg=name)
    assert len(attempts) == 1 and len(asarray) == 3 and fake.copies == []


def _as_device(fake, buf):
    """``cupy.asarray`` for :class:`PinnedCopy`: a device buffer holding ``buf``'s bytes."""
    dev = fake.empty(buf.nbytes, np.uint8)
    dev.data.mem[:] = buf
    return dev
