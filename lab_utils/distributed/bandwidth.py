"""Collective bandwidth as nccl-tests defines it, and the link to hold it against. No torch, no GPU.

Definitions follow nccl-tests (its doc/PERFORMANCE.md): algbw = S / t, busbw = algbw × factor, with S the bytes of one
rank's buffer (all_reduce, broadcast, reduce) or of the whole gathered buffer (all_gather, reduce_scatter, all_to_all),
t the time of one collective, GB = 1e9 bytes. busbw is what to hold against the link's speed per direction, whatever the
number of ranks; ``link_peak_gbps`` reads that speed from the topology ``course.probe`` records. Units are in the names:
``_ms`` milliseconds, ``_gbps`` GB/s (1e9 B/s), ``_bytes`` bytes."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lab_utils.args import check_int
from lab_utils.course.probe import probe
from lab_utils.course.specs import PCIE_GEN3_GBPS, PCIE_GEN4_GBPS, PCIE_GEN5_GBPS, peaks_for

if TYPE_CHECKING:
    from lab_utils.course.probe import EnvReport

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
# reduce has a busbw factor too (nccl-tests measures it); the sweep leaves it out.
_FACTOR_NAMES = (*COLLECTIVES, "reduce")

KIB, MIB, GIB = 2**10, 2**20, 2**30

# The sweeps' default sizes (``collectives.collective_sweep``, ``plan.lab_plan``): GPU sizes reach the >= 1 GiB
# where NVLink busbw levels off (2 H200s, NVLink 4); CPU sizes keep a gloo sweep on a 2-core laptop to seconds.
GPU_SIZES = (MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB, 2 * GIB)
CPU_SIZES = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB)

# [H200 run] all_reduce busbw in GB/s, 2 GPUs over NV18, fp32, blocking torch.distributed loop
# (the reference measurement): shown beside local numbers where there is no GPU.
H200_ALLREDUCE_BUSBW_GBPS = {MIB: 21.6, 16 * MIB: 216.0, 256 * MIB: 298.0, GIB: 327.0, 2 * GIB: 338.0}

# [H200 run] one rank alone on one H200 (NCCL 2.28.9, world size 1, fp32), ms per call, median of 20
# (collectives.collective_sweep): the in-place all_reduce moves nothing, so its time is the call's fixed cost at
# every size (a second run: 0.040 and 0.044 ms); all_gather copies into a second buffer, 1 GiB in 0.504 ms =
# 2,128 GB/s (4.26 TB/s counting read and write).
H200_ONE_RANK_MS = {("all_reduce", MIB): 0.035, ("all_reduce", GIB): 0.035,
                    ("all_gather", MIB): 0.046, ("all_gather", GIB): 0.504}

# NVLink 2, 3 and 4 each carry 25 GB/s per link per direction (H100/H200: 18 links = 450 GB/s);
# NVLink 5 (Blackwell) doubles it.
NVLINK_GBPS_PER_LINK = 25.0


def check_collective(collective: Any, where: str, valid: Sequence[str] = COLLECTIVES) -> str:
    """``collective`` when it is one of ``valid``, else a ValueError naming ``where`` and the valid names."""
    if collective not in valid:
        raise ValueError(f"{where}(collective={collective!r}): unknown collective; valid names are {list(valid)}")
    return collective


def busbw_factor(collective: str, n: int) -> float:
    """busbw / algbw on ``n`` ranks: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
    broadcast and reduce 1."""
    check_collective(collective, "busbw_factor", _FACTOR_NAMES)
    n = check_int(n, "n", "busbw_factor")
    if collective == "all_reduce":
        return 2 * (n - 1) / n  # a reduce-scatter, then an all-gather
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n  # each rank sends (or receives) all but its own 1/n
    return 1.0


def algbw_gbps(size_bytes: float, time_ms: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 B/s): ``size_bytes`` (S, see the module doc) over ``time_ms``."""
    if not size_bytes >= 0:
        raise ValueError(f"algbw_gbps(size_bytes={size_bytes!r}): must be >= 0 bytes")
    if not time_ms > 0:
        raise ValueError(f"algbw_gbps(time_ms={time_ms!r}): must be > 0 milliseconds")
    return float(size_bytes) / (float(time_ms) * 1e-3) / 1e9


def busbw_gbps(collective: str, size_bytes: float, time_ms: float, n: int) -> float:
    """Bus bandwidth in GB/s: algbw × ``busbw_factor(collective, n)``; comparable with a link's speed."""
    return algbw_gbps(size_bytes, time_ms) * busbw_factor(collective, n)


# --- Link peak from the topology ------------------------------------------------------------------


def _pcie_gbps(gen: int | None, width: int | None) -> float | None:
    per_x16 = {3: PCIE_GEN3_GBPS, 4: PCIE_GEN4_GBPS, 5: PCIE_GEN5_GBPS}.get(gen or 0)
    return None if per_x16 is None else per_x16 * (width or 16) / 16


def link_peak_gbps(report: EnvReport | None = None, n_gpus: int = 2) -> tuple[float | None, str]:
    """(peak GB/s per direction of the slowest link between GPU0..GPU{n_gpus-1}, or None; a description).

    Reads ``report.topology`` (``course.probe.probe()``; probed here when ``report`` is None) and ``report.gpus``:
    ``NV#`` is # NVLinks at 25 GB/s each per direction, capped at the GPU's datasheet NVLink figure; PIX,
    PXB, PHB, NODE and SYS go over PCIe, at the GPU's PCIe link rate. Indices are NVML's, which equal
    CUDA's unless CUDA_VISIBLE_DEVICES reorders them."""
    n_gpus = check_int(n_gpus, "n_gpus", "link_peak_gbps", minimum=2)
    if report is None:
        report = probe()  # nvidia-smi and NVML: only when no report is given
    gpus = list(getattr(report, "gpus", None) or [])
    topo = getattr(report, "topology", None) or {}
    if not gpus and not topo:
        return None, "no GPU link (gloo over loopback/shared memory)"
    labels = [str(x) for x in topo.get("labels", [])]
    matrix = topo.get("matrix") or []
    idx = [i for i, lab in enumerate(labels) if lab.startswith("GPU")][:n_gpus]
    if len(idx) < 2 or len(matrix) <= max(idx):
        return None, f"{len(gpus) or len(idx)} GPU(s) in the topology: no GPU-to-GPU link to measure"
    by_index = {getattr(g, "index", i): g for i, g in enumerate(gpus)}
    worst: tuple[float, str] | None = None
    unknown = []
    for a_pos, a in enumerate(idx):
        for b in idx[a_pos + 1 :]:
            cell = str(matrix[a][b]).strip()
            pair = f"{cell} between {labels[a]} and {labels[b]}"
            gpu = by_index.get(int(labels[a][3:]))
            peaks = peaks_for(gpu.name) if gpu is not None and getattr(gpu, "name", None) else None
            if m := re.fullmatch(r"NV(\d+)", cell):
                links = int(m.group(1))
                gbps = links * NVLINK_GBPS_PER_LINK
                gen = re.search(r"NVLink (\d)", peaks.notes) if peaks else None
                what = f"NVLink {gen.group(1)}" if gen else "NVLink"
                if peaks and peaks.nvlink_gbps_per_dir:
                    gbps = min(gbps, peaks.nvlink_gbps_per_dir)
                    desc = f"{pair}: {what}, {gbps:g} GB/s per direction ({links} links, {peaks.model} datasheet)"
                else:
                    desc = (f"{pair}: {what}, {gbps:g} GB/s per direction ({links} links × "
                            f"{NVLINK_GBPS_PER_LINK:g} GB/s, assumed: NVLink 2-4; NVLink 5 doubles it)")
            elif cell in ("PIX", "PXB", "PHB", "NODE", "SYS"):
                gen, width = getattr(gpu, "pcie_gen_max", None), getattr(gpu, "pcie_width_max", None)
                if (gbps := _pcie_gbps(gen, width)) is not None:
                    desc = f"{pair}: PCIe gen{gen} x{width or 16}: {gbps:g} GB/s per direction"
                elif peaks is not None:
                    gbps = peaks.pcie_gbps_per_dir
                    desc = f"{pair}: PCIe, {gbps:g} GB/s per direction ({peaks.model} datasheet)"
                else:
                    unknown.append(pair)
                    continue
                if cell in ("NODE", "SYS"):
                    desc += "; the path crosses host bridges or CPU sockets, and NCCL may stage through host memory"
            else:
                unknown.append(pair)
                continue
            if worst is None or gbps < worst[0]:
                worst = (gbps, desc)
    if worst is None:
        return None, f"link speed unknown ({'; '.join(unknown) or 'no GPU pair in the topology'})"
    return worst
