"""Lab 02's choices for the hardware found, made in one place: ranks, backend, sizes and counts.

``lab_plan(gpus, quick)`` decides everything in the lab that depends on the number of GPUs, and every cell reads
the plan rather than testing the GPU count itself. Sizes follow the backend, not the GPU count: with one GPU the
ranks are gloo CPU processes, so they get the CPU sizes, and the size the bare loop is compared at is always one
of the sweep's sizes. The single-GPU section (NCCL and DDP on one rank) runs only where there is exactly one GPU.
No torch: the plan is arithmetic on the GPU count, so a CPU test can fake any count. Units are in the names:
``_bytes`` bytes, ``_steps`` and ``_iters`` counts of steps and calls."""

from __future__ import annotations

from dataclasses import dataclass

from lab_utils.args import check_int
from lab_utils.distributed.bandwidth import CPU_SIZES, GIB, GPU_SIZES, KIB, MIB

# Quick mode (CI, a first look): the sweep keeps sizes on both sides of the latency-bound region and the
# compared size; on GPUs 1 GiB and up, where NVLink busbw levels off.
QUICK_GPU_SIZES = (16 * MIB, 256 * MIB, GIB, 2 * GIB)
QUICK_CPU_SIZES = (64 * KIB, MIB, 4 * MIB)
# The bare loop's size: >= 1 GiB on GPUs (where per-call costs vanish), 4 MiB on gloo (seconds on 2 cores).
GPU_COMPARE_BYTES = GIB
CPU_COMPARE_BYTES = 4 * MIB
# One rank on one GPU: from a size where the call's fixed cost dominates up to 1 GiB.
ONE_GPU_SIZES = (64 * KIB, MIB, 16 * MIB, 256 * MIB, GIB)
QUICK_ONE_GPU_SIZES = (MIB, 256 * MIB, GIB)
DIGITS_BATCH = 64  # the digits runs' global batch, rounded up to a multiple of 2 × ranks
FP32_BYTES = 4  # the sweeps' and the bare loop's dtype


def whole_per_rank(size_bytes: int, nprocs: int, itemsize: int = FP32_BYTES) -> int:
    """The largest size <= ``size_bytes`` (bytes) that splits into whole elements per rank.

    ``collectives.buffer_numels`` rounds a size down the same way, and the sweep reports the size it used: on 3 or
    6 ranks 1 GiB becomes 1 GiB - 4 bytes there, and a lookup of 1 GiB would find no row. Sizes made whole first
    are measured as asked, on any number of ranks."""
    return size_bytes - size_bytes % (itemsize * nprocs)


@dataclass(frozen=True)
class LabPlan:
    """What lab 02 runs on this machine; see ``lab_plan``. Checked when made: the compared size is swept."""

    gpus: int  # CUDA devices found
    quick: bool
    nprocs: int  # ranks of the multi-rank sections
    backend: str  # "nccl" (one GPU per rank) or "gloo" (CPU processes)
    sweep_sizes_bytes: tuple[int, ...]  # collectives.collective_sweep's sizes
    sweep_reps: int  # timed calls per collective and size
    sweep_warmup: int  # untimed calls before them
    compare_bytes: int  # the bare loop's all_reduce size: one of sweep_sizes_bytes
    compare_iters: int  # the bare loop's timed calls
    compare_warmup: int
    digits_epochs: int
    digits_global_batch: int  # digits images per optimizer step, all ranks together (divisible by 2 × ranks)
    ddp_steps: int | None  # ResNet steps timed per run; None: ddp.throughput's default for the device
    ddp_warmup_steps: int | None
    overlap_repeats: int  # rounds over the bucket variants (each keeps its fastest)
    one_gpu: bool  # the single-GPU section runs: exactly one GPU, and NCCL
    one_gpu_sizes_bytes: tuple[int, ...]  # its one-rank NCCL sweep
    one_gpu_reps: int  # timed calls per collective and size there
    one_gpu_note: str  # why the single-GPU section runs, or why not

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"LabPlan(backend={self.backend!r}): 'nccl' or 'gloo'")
        if self.backend == "nccl" and self.nprocs > self.gpus:
            raise ValueError(f"LabPlan: NCCL needs one GPU per rank, {self.nprocs} ranks on {self.gpus} GPU(s)")
        if self.compare_bytes not in self.sweep_sizes_bytes:
            raise ValueError(f"LabPlan: the bare loop's {self.compare_bytes} bytes are not among the sweep's sizes "
                             f"{self.sweep_sizes_bytes}, so its busbw has nothing to be compared with")
        if self.digits_global_batch % (2 * self.nprocs):
            raise ValueError(f"LabPlan: digits batch {self.digits_global_batch} not divisible by 2 × {self.nprocs}")

    @property
    def on_gpus(self) -> bool:
        """True when the ranks are GPUs (NCCL), False for gloo CPU processes."""
        return self.backend == "nccl"

    def summary(self) -> str:
        """One line: ranks, backend, where they run, and what the single-GPU section does."""
        where = "one GPU each" if self.on_gpus else "CPU processes"
        mode = "quick" if self.quick else "full"
        return f"{self.nprocs} ranks with {self.backend.upper()} ({where}), {mode} sizes; {self.one_gpu_note}"


def _nccl_here() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_nccl_available())


def lab_plan(gpus: int, quick: bool = False, nprocs: int | None = None, *, nccl: bool | None = None,
             digits_epochs: int | None = None) -> LabPlan:
    """Lab 02's ranks, backend, sizes and counts for ``gpus`` GPUs (0, 1, 2, 4, 8...).

    ``nprocs``: the ranks of the multi-rank sections; None takes every GPU where there are two or more, else 2
    CPU processes. NCCL when each rank has a GPU (and ``nccl``: this torch has NCCL; None asks torch), else gloo,
    as ``spawn.choose_backend`` decides; sizes and counts then follow that backend: NCCL ``GPU_SIZES`` (1 MiB ..
    2 GiB) compared at 1 GiB, gloo ``CPU_SIZES`` (4 KiB .. 16 MiB) compared at 4 MiB; ``quick`` fewer sizes and
    repetitions, both keeping the compared size. Sizes are whole fp32 elements per rank (``whole_per_rank``), so
    the sweep measures each as asked. ``digits_epochs``: None takes 2 (quick) or 8."""
    where = "lab_plan"
    gpus = check_int(gpus, "gpus", where, minimum=0)
    quick = bool(quick)
    if nprocs is None:
        nprocs = gpus if gpus >= 2 else 2
    # Two ranks at least: on one, busbw is 0 by formula and the comparisons of 1 and N ranks compare nothing.
    nprocs = check_int(nprocs, "nprocs", where, minimum=2)
    has_nccl = _nccl_here() if nccl is None else bool(nccl)
    backend = "nccl" if has_nccl and gpus >= nprocs else "gloo"
    gpu = backend == "nccl"
    if gpus == 1 and has_nccl:
        one_gpu, note = True, "one GPU: section 6 also runs NCCL and DDP on it alone"
    elif gpus == 1:
        one_gpu, note = False, "one GPU, but this torch has no NCCL: section 6 needs it, and shows one H200's numbers"
    elif gpus == 0:
        one_gpu, note = False, "no GPU here: section 6 needs exactly one, and shows one H200's numbers instead"
    else:
        one_gpu, note = False, f"{gpus} GPUs here: section 6 needs exactly one, and shows one H200's numbers instead"
    if digits_epochs is None:
        digits_epochs = 2 if quick else 8
    digits_epochs = check_int(digits_epochs, "digits_epochs", where)
    sizes = (QUICK_GPU_SIZES if gpu else QUICK_CPU_SIZES) if quick else (GPU_SIZES if gpu else CPU_SIZES)
    return LabPlan(gpus=gpus, quick=quick, nprocs=nprocs, backend=backend,
                   sweep_sizes_bytes=tuple(whole_per_rank(s, nprocs) for s in sizes),
                   sweep_reps=5 if quick else (20 if gpu else 10), sweep_warmup=5 if gpu else 2,
                   compare_bytes=whole_per_rank(GPU_COMPARE_BYTES if gpu else CPU_COMPARE_BYTES, nprocs),
                   compare_iters=20 if gpu else 10, compare_warmup=5, digits_epochs=digits_epochs,
                   digits_global_batch=2 * nprocs * -(-DIGITS_BATCH // (2 * nprocs)),  # 64 for 1, 2, 4, 8 ranks
                   ddp_steps=4 if quick else None, ddp_warmup_steps=2 if quick else None,
                   overlap_repeats=1 if quick else 2, one_gpu=one_gpu,
                   one_gpu_sizes_bytes=QUICK_ONE_GPU_SIZES if quick else ONE_GPU_SIZES, one_gpu_reps=5 if quick else 20,
                   one_gpu_note=note)
