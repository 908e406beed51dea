"""Lab 02's plan: ranks, backend, sizes and counts for any number of GPUs, faked on a CPU.

The bug it guards: with one GPU the lab ran 2 gloo ranks (CPU processes) and compared the bare loop at the gloo
size, 4 MiB, but chose the quick sweep's sizes by the GPU count (GPU sizes, 16 MiB and up), so the cell that
looks the compared size up in the sweep raised IndexError. Every choice now follows the backend, in one place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lab_utils.distributed.bandwidth import CPU_SIZES, GIB, GPU_SIZES, MIB
from lab_utils.distributed.plan import lab_plan, whole_per_rank

ROOT = Path(__file__).resolve().parents[1]
GPU_COUNTS = (0, 1, 2, 3, 4, 6, 8)


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_the_compared_size_is_one_the_sweep_measures(gpus, quick):
    plan = lab_plan(gpus, quick, nccl=True)
    assert plan.compare_bytes in plan.sweep_sizes_bytes
    # The sweep reports the size it used, rounded down to whole elements per rank (collectives.buffer_numels):
    # the notebook finds the compared size among those.
    col = pytest.importorskip("lab_utils.distributed.collectives")
    measured = {col.buffer_numels("all_reduce", s, plan.nprocs, 4)[2] for s in plan.sweep_sizes_bytes}
    assert plan.compare_bytes in measured
    assert (plan.compare_bytes // 4) * 4 == plan.compare_bytes  # the bare loop's fp32 buffer is exactly that size


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_one_gpu_runs_gloo_ranks_with_cpu_sizes(quick):
    plan = lab_plan(1, quick, nccl=True)
    assert (plan.backend, plan.nprocs, plan.on_gpus) == ("gloo", 2, False)
    assert max(plan.sweep_sizes_bytes) <= max(CPU_SIZES) and plan.compare_bytes == 4 * MIB
    assert plan.compare_iters == 10 and plan.sweep_warmup == 2
    assert plan.one_gpu and "section 6" in plan.one_gpu_note
    assert plan.one_gpu_sizes_bytes and plan.one_gpu_reps >= 5


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_two_or_more_gpus_run_nccl_on_every_gpu_with_gpu_sizes(gpus, quick):
    plan = lab_plan(gpus, quick, nccl=True)
    assert (plan.backend, plan.nprocs, plan.on_gpus) == ("nccl", gpus, True)
    assert min(plan.sweep_sizes_bytes) >= MIB and max(plan.sweep_sizes_bytes) == 2 * GIB
    assert plan.compare_bytes == GIB and plan.compare_iters == 20
    assert not quick or plan.sweep_sizes_bytes == (16 * MIB, 256 * MIB, GIB, 2 * GIB)
    assert quick or plan.sweep_sizes_bytes == GPU_SIZES
    assert not plan.one_gpu and f"{gpus} GPUs" in plan.one_gpu_note


def test_no_gpu_runs_gloo_and_skips_the_single_gpu_section():
    plan = lab_plan(0, True)
    assert (plan.backend, plan.nprocs) == ("gloo", 2)
    assert plan.sweep_sizes_bytes == (64 * 2**10, MIB, 4 * MIB) and plan.compare_bytes == 4 * MIB
    assert lab_plan(0, False).sweep_sizes_bytes == CPU_SIZES
    assert not plan.one_gpu and "no GPU" in plan.one_gpu_note


def test_sizes_follow_the_backend_not_the_gpu_count():
    # More ranks than GPUs, or no NCCL: gloo, and gloo's sizes, whatever the GPUs.
    for plan in (lab_plan(2, True, 3, nccl=True), lab_plan(8, False, nccl=False), lab_plan(1, True, nccl=True)):
        assert plan.backend == "gloo"
        assert max(plan.sweep_sizes_bytes) <= max(CPU_SIZES) and plan.compare_bytes <= 4 * MIB
    nccl = lab_plan(8, True, 2, nccl=True)  # fewer ranks than GPUs: NCCL on two of them
    assert (nccl.backend, nccl.nprocs, nccl.compare_bytes) == ("nccl", 2, GIB)
    assert not lab_plan(1, True, nccl=False).one_gpu  # the single-GPU section needs NCCL


@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_the_plan_agrees_with_the_launchers_backend(gpus, monkeypatch):
    # The helpers check the backend they are given with spawn.choose_backend: with the GPU count faked, it
    # must choose what the plan chose, for the plan's ranks and for one rank on one GPU.
    spawn = pytest.importorskip("lab_utils.distributed.spawn")
    monkeypatch.setattr(spawn, "torch_gpu_count", lambda: gpus)
    monkeypatch.setattr(spawn.dist, "is_nccl_available", lambda: True)
    plan = lab_plan(gpus, True, nccl=True)
    assert spawn.choose_backend(plan.nprocs) == plan.backend
    assert spawn.choose_backend(plan.nprocs, plan.backend) == plan.backend
    if plan.one_gpu:
        assert spawn.choose_backend(1, "nccl") == "nccl"


def test_counts_and_the_digits_batch():
    for gpus in GPU_COUNTS:
        for quick in (True, False):
            plan = lab_plan(gpus, quick, nccl=True)
            assert plan.digits_global_batch % (2 * plan.nprocs) == 0 and plan.digits_global_batch >= 64
            assert plan.digits_epochs == (2 if quick else 8)
            assert (plan.ddp_steps, plan.ddp_warmup_steps, plan.overlap_repeats) == (
                (4, 2, 1) if quick else (None, None, 2))
            assert plan.sweep_reps == (5 if quick else 20 if plan.on_gpus else 10)
    assert {lab_plan(g, False, nccl=True).digits_global_batch for g in (0, 1, 2, 4, 8)} == {64}
    assert lab_plan(0, True, digits_epochs=5).digits_epochs == 5


def test_whole_per_rank():
    assert whole_per_rank(GIB, 2) == GIB and whole_per_rank(GIB, 8) == GIB
    assert whole_per_rank(GIB, 3) == GIB - 4 and whole_per_rank(GIB, 3) % 12 == 0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"gpus": -1}, "gpus"), ({"gpus": 1.5}, "gpus"), ({"gpus": 2, "nprocs": 1}, "nprocs"),
    ({"gpus": 0, "digits_epochs": 0}, "digits_epochs"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lab_plan(**kwargs)


def test_summary_says_ranks_backend_and_the_single_gpu_section():
    assert lab_plan(1, True, nccl=True).summary().startswith("2 ranks with GLOO (CPU processes), quick sizes; one GPU")
    assert lab_plan(4, False, nccl=True).summary().startswith("4 ranks with NCCL (one GPU each), full sizes")


def test_the_plan_module_needs_no_torch():
    import subprocess
    import sys

    code = "import sys, lab_utils.distributed.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_solution_takes_every_gpu_dependent_choice_from_the_plan():
    # One place decides: no other cell tests the GPU count or quick mode itself (the bug was such a test).
    nb = json.loads((ROOT / "solutions" / "02_nccl_ddp.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    setup = [i for i, src in enumerate(code) if "lab_plan(" in src]
    assert len(setup) == 1, "one cell makes the plan"
    for i, src in enumerate(code):
        if i == setup[0] or src.lstrip().startswith("# Papermill parameters"):
            continue
        assert not re.search(r"\b(gpus|quick)\b", src), src
        assert "compare_bytes =" not in src or "plan.compare_bytes" in src, src
    assert "if plan.one_gpu:" in "\n".join(code)  # the single-GPU section asks the plan too
