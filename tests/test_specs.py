"""Datasheet table lookups and the roofline ridge point."""

from __future__ import annotations

import json
import math

import pytest

from lab_utils.course import specs
from lab_utils.course.catalog import repo_root
from lab_utils.course.specs import (
    DTYPE_FIELDS,
    H200_SXM,
    GpuPeaks,
    h200_measured,
    h200_reference_tflops,
    peaks_for,
    ridge_point,
)


def test_h200_lookup_matches_reference():
    p = peaks_for("NVIDIA H200")
    assert p is H200_SXM
    assert (p.bf16_tflops, p.fp16_tflops, p.tf32_tflops, p.fp32_tflops, p.fp8_tflops) == (
        989.0, 989.0, 494.5, 67.0, 1979.0,
    )
    assert p.hbm_tbps == 4.8
    assert p.nvlink_gbps_per_dir == 450.0
    assert p.pcie_gbps_per_dir == pytest.approx(63.0)
    assert p.tflops("bf16") == 989.0


@pytest.mark.parametrize(
    "name, model",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM5 80GB"),
        ("NVIDIA H100 PCIe", "H100 PCIe 80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100 SXM4 40GB"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10", "A10"),
        ("Tesla T4", "T4"),
    ],
)
def test_variants_are_told_apart(name, model):
    p = peaks_for(name)
    assert p is not None and p.model == model


@pytest.mark.parametrize(
    "name",
    # Not in the table, or a different part whose name contains a known one: no guess.
    ["NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA L40",
     "NVIDIA A10G", "NVIDIA T400", "cpu", ""],
)
def test_unknown_names_give_none(name):
    assert peaks_for(name) is None


def test_peaks_for_rejects_non_string():
    with pytest.raises(ValueError, match="get_device_name"):
        peaks_for(None)  # type: ignore[arg-type]


def test_table_is_dense_and_consistent():
    table = [p for p in vars(specs).values() if isinstance(p, GpuPeaks)]  # every datasheet entry of the module
    assert table
    for p in table:
        assert p.fp32_tflops > 0 and p.hbm_tbps > 0 and p.pcie_gbps_per_dir > 0
        # Tensor-core rates: TF32 is half of FP16 where both exist; FP8 twice FP16. A sparse figure
        # slipped in would break these ratios.
        if p.tf32_tflops and p.fp16_tflops:
            assert p.tf32_tflops == pytest.approx(p.fp16_tflops / 2, rel=0.02), p.model
        if p.fp8_tflops:
            assert p.fp8_tflops == pytest.approx(2 * p.fp16_tflops, rel=0.02), p.model
        for field in DTYPE_FIELDS.values():
            v = getattr(p, field)
            assert v is None or v > 0


def test_unknown_dtype_lists_valid_ones():
    with pytest.raises(ValueError, match="fp32"):
        H200_SXM.tflops("int8")


def test_h200_numbers_come_from_the_committed_reference_run():
    rows = json.loads((repo_root() / "reference_runs" / "h200" / "results_01.json").read_text())
    recorded = {r["name"]: r["value"] for r in rows}
    measured = h200_measured("01")
    assert measured == {k: v for k, v in recorded.items() if v is not None}
    tflops = h200_reference_tflops()
    assert set(tflops) == set(DTYPE_FIELDS)
    assert tflops["fp8"] == recorded["matmul_fp8"]  # not a hand-typed figure (1369 once stood here for 1440)
    assert not hasattr(specs, "H200_MEASURED")
    assert h200_measured("99") == {}


def test_h200_reference_numbers_are_below_peaks():
    for dtype, value in h200_reference_tflops().items():
        assert 0.5 < value / H200_SXM.tflops(dtype) < 1.0, dtype
    measured = h200_measured("01")
    assert 0.5 < measured["copy_bandwidth"] / 1e3 / H200_SXM.hbm_tbps < 1.0
    assert measured["h2d_pinned"] < H200_SXM.pcie_gbps_per_dir
    assert measured["launch_cuda_graph"] < measured["launch_eager"]


def test_ridge_point():
    assert ridge_point(989, 4.8) == pytest.approx(206, abs=0.5)
    assert ridge_point(H200_SXM.bf16_tflops, H200_SXM.hbm_tbps) == pytest.approx(206.04, abs=0.01)
    assert math.isclose(ridge_point(1.0, 2.0), 0.5)
    with pytest.raises(ValueError, match="bw_tbps"):
        ridge_point(989, 0)
    with pytest.raises(ValueError, match="peak_tflops"):
        ridge_point(None, 4.8)  # type: ignore[arg-type]
