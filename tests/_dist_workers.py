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


def ddp_digits_and_accumulation(ctx, plan, micro_batch=8, accumulate=2):
    """Lab 02's digits runs of ``plan`` (``ddp.each_world_size``), then DDP's gradients after ``accumulate``
    micro-steps (all but the last under no_sync) against one big batch in one process, in one launch: the ranks
    start once for every test that reads them. The check returns the largest absolute difference (max over ranks)
    and the gradient's largest magnitude, for scale."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from lab_utils.distributed import ddp, ddp_base
    from lab_utils.models import make_digits_cnn

    runs = ddp.each_world_size(ctx, ddp.train_digits, plan)
    data = ddp._digits_tensors(ctx.device)
    torch.manual_seed(0)
    ref = make_digits_cnn(16).to(ctx.device)
    model = make_digits_cnn(16).to(ctx.device)
    model.load_state_dict(ref.state_dict())
    net = ddp_base.wrap_ddp(ctx, model)
    per_rank = micro_batch * accumulate
    x = data["x_train"][: per_rank * ctx.world_size]  # (global, 1, 8, 8); rank r owns rows [r*per_rank, ...)
    y = data["y_train"][: per_rank * ctx.world_size]
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    for k, (xb, yb) in enumerate(zip(x[mine].split(micro_batch), y[mine].split(micro_batch), strict=True)):
        with contextlib.nullcontext() if k == accumulate - 1 else net.no_sync():
            (F.cross_entropy(net(xb), yb) / accumulate).backward()
    F.cross_entropy(ref(x), y).backward()  # the big batch, in one process
    diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    diff = ddp_base.all_reduce_values(ctx, [diff], op="max")[0]
    return runs, {"max_abs_diff": diff, "max_abs_grad": scale, "global_batch": per_rank * ctx.world_size}


def imported_after(ctx, module, watch):
    """Import ``module`` in this rank; which of the modules in ``watch`` are loaded then."""
    import importlib
    import sys

    importlib.import_module(module)
    return sorted(m for m in watch if m in sys.modules)
