"""``python -m mx_roi.bench.kernel_ab``: two versions of the compiled kernels in one
process, each side's calls on its own modules, the loader left as it was found."""
import os

import pytest

from mx_roi.bench import kernel_ab
from mx_roi.cuda import loader, source
from mx_roi.ndio import Kind


def test_paired_rows_every_direction_and_the_loader_restored():
    dir_before, modules_before = source._operators_dir(), loader._MODULES
    for direction in kernel_ab.DIRECTIONS:
        rows = kernel_ab.compare("HEAD", direction, repeat=3, only="ROIAlign/7x7,PrRoIPool",
                                 quick=True)
        assert [r["key"] for r in rows] == ["ROIAlign/7x7", "PrRoIPool/7x7"], rows
        for r in rows:
            assert r["direction"] == direction and r["runs"] == 3
            assert r["base_ms"] > 0 and r["tree_ms"] > 0 and 0 <= r["wins"] <= 3
            assert r["ratio"] == pytest.approx(r["tree_ms"] / r["base_ms"])
        assert source._operators_dir() == dir_before and loader._MODULES is modules_before
    text = kernel_ab.format_rows(rows, "HEAD")
    assert "PrRoIPool/7x7" in text and "tree faster" in text


def test_ops_with_extra_inputs_are_left_out():
    assert kernel_ab.compare("HEAD", "fwd", repeat=1, only="DeformablePSROIPooling",
                             quick=True) == []


def test_each_side_builds_from_its_own_sources(tmp_path):
    """A base whose kernel text differs (here by a comment) gets modules of its own: a
    library built from that text, not the tree's."""
    names = kernel_ab.extract_operators("HEAD", str(tmp_path))
    assert "psroi_pooling.cu" in names and "roi_common.cuh" in names
    with open(tmp_path / "psroi_pooling.cu", "a", encoding="utf-8") as f:
        f.write("\n// kernel_ab test: another text, another library\n")
    dir_before, modules_before = source._operators_dir, loader._MODULES
    sides = [kernel_ab._Side(str(tmp_path)), kernel_ab._Side(dir_before())]
    try:
        libs = []
        for side in sides:
            kernel_ab._use(side)
            libs.append(loader.get_module("psroi_pooling.cu", Kind.NATIVE)._lib._name)
            assert ("psroi_pooling.cu", Kind.NATIVE, -1) in side.modules
    finally:
        source._operators_dir = dir_before
        source.read_source.cache_clear()
        loader._MODULES = modules_before
    assert libs[0] != libs[1] and all(os.path.exists(p) for p in libs)


def test_unknown_revision_is_named():
    with pytest.raises(ValueError, match=r"no kernel sources at revision 'no-such-rev-0'"):
        kernel_ab.compare("no-such-rev-0", repeat=1, only="ROIAlign/7x7", quick=True)
    with pytest.raises(SystemExit):
        kernel_ab.main(["--base", "no-such-rev-0", "--only", "ROIAlign/7x7", "--quick"])
