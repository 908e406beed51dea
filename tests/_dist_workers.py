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
