"""Datasheet peaks of common NVIDIA data-centre GPUs, and the course's measured H200 numbers (read from the committed
reference run).

Every peak is the vendor's *dense* figure (NVIDIA datasheets quote tensor-core rates "with sparsity", twice the dense
rate; those are halved here). Units are in the field names: TFLOP/s = 1e12 FLOP/s, TB/s = 1e12 B/s, GB/s = 1e9 B/s. A
GPU whose numbers are not known with confidence is left out: ``peaks_for`` then answers ``None`` rather than a guess.

Imports nothing heavy: safe to import on any machine."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lab_utils.args import check_positive
from lab_utils.course.catalog import repo_root

DTYPE_FIELDS = {"fp32": "fp32_tflops", "tf32": "tf32_tflops", "fp16": "fp16_tflops", "bf16": "bf16_tflops",
                "fp8": "fp8_tflops"}

# PCIe x16 per direction: line rate x 16 lanes x 128b/130b encoding (datasheets round to 2x these,
# "128 GB/s" bidirectional for Gen5).
PCIE_GEN3_GBPS = 15.75
PCIE_GEN4_GBPS = 31.5
PCIE_GEN5_GBPS = 63.0


@dataclass(frozen=True)
class GpuPeaks:
    """Dense datasheet peaks of one GPU model; ``None`` where the model has no such unit or mode."""

    model: str
    fp32_tflops: float  # CUDA cores (FMA), no tensor cores
    tf32_tflops: float | None
    fp16_tflops: float | None
    bf16_tflops: float | None
    fp8_tflops: float | None
    hbm_tbps: float  # device memory bandwidth (HBM, or GDDR on the L- and T-series), TB/s
    nvlink_gbps_per_dir: float | None  # to one peer, one direction; None: no NVLink
    pcie_gbps_per_dir: float  # host link, one direction
    notes: str = ""

    def tflops(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s for a dtype name ("fp32", "tf32", "fp16", "bf16", "fp8")."""
        if dtype not in DTYPE_FIELDS:
            raise ValueError(f"GpuPeaks.tflops(dtype={dtype!r}): use one of {sorted(DTYPE_FIELDS)}")
        return getattr(self, DTYPE_FIELDS[dtype])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Vendor datasheets (dense). Sparse datasheet figures halved: H100/H200 SXM "BF16 1,979*" -> 989.
H200_SXM = GpuPeaks("H200 SXM", 67.0, 494.5, 989.0, 989.0, 1979.0, 4.8, 450.0, PCIE_GEN5_GBPS,
                    "NVLink 4: 900 GB/s total, 450 per direction")
H100_SXM = GpuPeaks("H100 SXM5 80GB", 67.0, 494.5, 989.0, 989.0, 1979.0, 3.35, 450.0, PCIE_GEN5_GBPS,
                    "NVLink 4: 900 GB/s total, 450 per direction")
H100_PCIE = GpuPeaks("H100 PCIe 80GB", 51.0, 378.0, 756.0, 756.0, 1513.0, 2.0, None, PCIE_GEN5_GBPS,
                     "NVLink only through an optional bridge (600 GB/s total)")
_A100_NOTE = "no FP8; NVLink 3: 600 GB/s total, 300 per direction"
A100_SXM_80GB = GpuPeaks("A100 SXM4 80GB", 19.5, 156.0, 312.0, 312.0, None, 2.039, 300.0, PCIE_GEN4_GBPS, _A100_NOTE)
A100_SXM_40GB = GpuPeaks("A100 SXM4 40GB", 19.5, 156.0, 312.0, 312.0, None, 1.555, 300.0, PCIE_GEN4_GBPS, _A100_NOTE)
_A100_PCIE_NOTE = "no FP8; NVLink only through an optional bridge (600 GB/s total)"
A100_PCIE_80GB = GpuPeaks("A100 PCIe 80GB", 19.5, 156.0, 312.0, 312.0, None, 1.935, None, PCIE_GEN4_GBPS,
                          _A100_PCIE_NOTE)
A100_PCIE_40GB = GpuPeaks("A100 PCIe 40GB", 19.5, 156.0, 312.0, 312.0, None, 1.555, None, PCIE_GEN4_GBPS,
                          _A100_PCIE_NOTE)
L40S = GpuPeaks("L40S", 91.6, 183.0, 362.05, 362.05, 733.0, 0.864, None, PCIE_GEN4_GBPS, "GDDR6")
L4 = GpuPeaks("L4", 30.3, 60.0, 121.0, 121.0, 242.5, 0.3, None, PCIE_GEN4_GBPS, "GDDR6")
A10 = GpuPeaks("A10", 31.2, 62.5, 125.0, 125.0, None, 0.6, None, PCIE_GEN4_GBPS, "GDDR6; no FP8")
T4 = GpuPeaks("T4", 8.1, None, 65.0, None, None, 0.32, None, PCIE_GEN3_GBPS,
              "Turing: FP16 tensor cores only (65 = FP16 with FP32 accumulate); no TF32, BF16 or FP8; GDDR6")

# (pattern, peaks), first match wins, so specific names come before general ones. Matched against
# torch.cuda.get_device_name() / NVML names, e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3",
# "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA L40S", "Tesla T4".
# `_B` is a boundary that also refuses letters/digits, so "GH200" is not an H200, "A100" is not an A10,
# and "L40S" is not an L4.
_B = r"(?<![A-Za-z0-9])"
_E = r"(?![A-Za-z0-9])"
_TABLE: list[tuple[re.Pattern[str], GpuPeaks | None]] = [
    # Variants whose numbers differ and are not in this table: answer None rather than the SXM part's.
    (re.compile(_B + r"H[12]00\s*NVL", re.I), None),
    (re.compile(_B + r"H200" + _E, re.I), H200_SXM),
    (re.compile(_B + r"H100\b.*PCI\s*-?e", re.I), H100_PCIE),
    (re.compile(_B + r"H100\b.*(SXM|HBM3)", re.I), H100_SXM),
    (re.compile(_B + r"A100\b.*SXM.*40\s*GB", re.I), A100_SXM_40GB),
    (re.compile(_B + r"A100\b(?=.*PCI\s*-?e)(?=.*40\s*GB)", re.I), A100_PCIE_40GB),
    (re.compile(_B + r"A100\b.*PCI\s*-?e", re.I), A100_PCIE_80GB),
    (re.compile(_B + r"A100" + _E, re.I), A100_SXM_80GB),  # "A100-SXM4-80GB" and an unqualified "A100"
    (re.compile(_B + r"L40S" + _E, re.I), L40S),
    (re.compile(_B + r"L4" + _E, re.I), L4),
    (re.compile(_B + r"A10" + _E, re.I), A10),
    (re.compile(_B + r"T4" + _E, re.I), T4)]

# The course's measured H200 numbers are not typed in here: they are read from the committed reference run
# (reference_runs/h200/results_<lab>.json, written by the notebooks on one H200 SXM), so a table beside a
# student's numbers shows what that run recorded, and a new reference run updates every table at once.
REFERENCE_RUN = "h200"


@functools.lru_cache(maxsize=8)
def _reference_values(path: str) -> tuple[tuple[str, float], ...]:
    rows = json.loads(Path(path).read_text())
    return tuple((r["name"], float(r["value"])) for r in rows if r.get("value") is not None)


def h200_measured(lab: str = "01", run_dir: Path | str | None = None) -> dict[str, float]:
    """What the committed H200 reference run recorded for ``lab``, by measurement name (units as recorded:
    ``matmul_<dtype>`` TFLOP/s at n=8192, ``copy_bandwidth`` GB/s read + write, ``h2d_pinned`` GB/s,
    ``launch_eager`` / ``launch_cuda_graph`` µs per kernel, ...). Empty when the run has no results for it."""
    folder = Path(run_dir) if run_dir is not None else repo_root() / "reference_runs" / REFERENCE_RUN
    path = folder / f"results_{lab}.json"
    return dict(_reference_values(str(path))) if path.is_file() else {}


def h200_reference_tflops(run_dir: Path | str | None = None) -> dict[str, float]:
    """The reference run's matmul TFLOP/s by dtype (``fp32``, ``tf32``, ``fp16``, ``bf16``, ``fp8``; n = 8192)."""
    measured = h200_measured("01", run_dir)
    return {d: measured[f"matmul_{d}"] for d in DTYPE_FIELDS if f"matmul_{d}" in measured}


def peaks_for(name: str) -> GpuPeaks | None:
    """Datasheet peaks for a device name as torch or NVML reports it; ``None`` when not in the table."""
    if not isinstance(name, str):
        raise ValueError(f"peaks_for(name={name!r}): pass the device name as a string, "
                         "for example torch.cuda.get_device_name(0)")
    return next((peaks for pattern, peaks in _TABLE if pattern.search(name)), None)


def ridge_point(peak_tflops: float, bw_tbps: float) -> float:
    """Arithmetic intensity in FLOP/byte where the roofline turns: peak rate / memory bandwidth.

    Kernels below it are bound by memory, above it by arithmetic. H200 bf16: 989 / 4.8 ≈ 206."""
    # TFLOP/s over TB/s: the 1e12 factors cancel.
    return (check_positive(peak_tflops, "peak_tflops", "ridge_point", what="peak rate (TFLOP/s)")
            / check_positive(bw_tbps, "bw_tbps", "ridge_point", what="memory bandwidth (TB/s)"))
