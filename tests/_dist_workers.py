"""Worker functions for tests of lab_utils.distributed.spawn (spawned ranks import them by module name)."""

import os
import time
from pathlib import Path


def allreduce_sum(ctx, n=4):
    import torch
    import torch.distributed as dist

    x = torch.full((n,), float(ctx.rank + 1))
    dist.all_reduce(x)
    return {"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend, "sum": x.tolist()}


def fail_on_rank1(ctx):
    if ctx.rank == 1:
        raise RuntimeError("deliberate failure in a worker")
    time.sleep(60)


def hang_in_collective(ctx):
    import torch
    import torch.distributed as dist

    ctx.status("all_reduce 1 MiB")
    if ctx.rank == 0:
        time.sleep(60)  # rank 1 waits in the collective for a partner that never comes
    dist.all_reduce(torch.ones(4))


def read_env(ctx, names=()):
    return {n: os.environ.get(n) for n in names}


def write_pid_and_sleep(ctx, folder):
    Path(folder, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    time.sleep(120)


def two_groups(ctx):
    """launch(group=False, rendezvous=2): join a group from the torchrun-style environment, all-reduce, leave; then
    a second group in the same process, at the second store."""
    import torch
    import torch.distributed as dist

    sums = []
    for port in ctx.rendezvous_ports:
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo")
        x = torch.full((2,), float(dist.get_rank() + 1))
        dist.all_reduce(x)
        sums.append(x.tolist())
        dist.destroy_process_group()
    return {"sums": sums, "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                  "TORCHELASTIC_USE_AGENT_STORE")}}


def subgroups(ctx):
    """ctx.subgroup(n) for n = 1..world: rank, world size and a sum within each subgroup (None outside it)."""
    import torch
    import torch.distributed as dist

    out = []
    for n in range(1, ctx.world_size + 1):
        sub = ctx.subgroup(n)
        if sub is None:
            out.append(None)
        else:
            x = torch.ones(1)
            dist.all_reduce(x, group=sub.group)
            sub.barrier()
            out.append((sub.rank, sub.world_size, x.item()))
        ctx.barrier()
    return out


def rank1_lingers(ctx, seconds=600):
    """Rank 0 returns at once; rank 1 stays (a rank that never follows its peers)."""
    if ctx.rank == 1:
        time.sleep(seconds)
    return ctx.rank


def destroy_process_group(seconds):  # named as torch's: what the check recognizes in a rank's stack
    time.sleep(seconds)


def teardown_hangs(ctx, flag, times=1, student=None):
    """Rank 1 hangs in a function named destroy_process_group on its first ``times`` launches (``flag``: a file
    counting them), then returns like rank 0. ``student``: what a lab check passes its workers (unused)."""
    if ctx.rank == 1:
        count = int(Path(flag).read_text()) if Path(flag).exists() else 0
        Path(flag).write_text(str(count + 1))
        if count < times:
            destroy_process_group(600)
    return ctx.rank


def barrier_after_refused_op(ctx, rounds=20):
    """Start an operation gloo refuses (float8 all_gather: "Invalid scalar type") without waiting for it, then meet
    at the context's barrier while gloo's worker thread still holds it; then wait for it (it raises)."""
    import torch
    import torch.distributed as dist

    x = torch.zeros(16, dtype=torch.float8_e4m3fn)
    refused = 0
    for _ in range(rounds):
        work = dist.all_gather_into_tensor(torch.empty(16 * ctx.world_size, dtype=x.dtype), x, async_op=True)
        ctx.barrier()
        try:
            work.wait()
        except RuntimeError as exc:
            refused += "Invalid scalar type" in str(exc)
    return {"rank": ctx.rank, "refused": refused}


def imported_after(ctx, module, watch):
    """Import ``module`` in this rank; which of the modules in ``watch`` are loaded then."""
    import importlib
    import sys

    importlib.import_module(module)
    return sorted(m for m in watch if m in sys.modules)
