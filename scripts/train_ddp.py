#!/usr/bin/env python
"""Train the lab 02 digits CNN with DDP under torchrun, on one node or several; rank 0 writes a JSON result.

torchrun starts one process per GPU (or CPU rank) on every node and hands each its RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; this script joins the process group from them
(``spawn.start_process_group``), runs ``lab_utils.distributed.ddp.train_digits``, the same worker the notebook
launches, and leaves the group (``spawn.leave_process_group``: a barrier, then the group destroyed before the
interpreter exits, so the process ends with exit code 0 and no thread of the group is left).

One node, 2 GPUs:
    torchrun --standalone --nproc-per-node=2 scripts/train_ddp.py --out result.json

Two nodes, static rendezvous (run on each node; R = 0 on the node whose address is given, 1 on the other):
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=R --master-addr=HOST0 --master-port=29500 \\
        scripts/train_ddp.py --backend gloo --out result.json

Two nodes, c10d rendezvous (the same command on every node; no node ranks to hand out; what Slurm uses,
see scripts/slurm/ddp.sbatch):
    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 --rdzv-id=JOB \\
        scripts/train_ddp.py --out result.json

``--global-batch`` stays the same whatever the world size (the per-rank batch is derived from it), so a run
on any number of ranks is comparable with a single-process run of the same seed.

Nothing waits for ever: a collective (the final barrier included) waits at most ``--timeout-s`` for a peer;
the c10d rendezvous at most its ``join_timeout`` (600 s unless ``--rdzv-conf=join_timeout=S``). After its own
ranks finish, torchrun waits up to 300 s (its exit barrier, fixed) for the other nodes' torchruns: when a node
fails, stop the others (Slurm's ``srun --kill-on-bad-exit=1`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

try:
    import lab_utils  # noqa: F401
except ImportError:  # an install, not a path hack: every node needs the same environment
    sys.exit("train_ddp.py: lab_utils is not importable on this node: run `pip install -e .` in the course "
             "checkout (or export PYTHONPATH=<checkout>) in the environment torchrun starts")

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from lab_utils.distributed import ddp, spawn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = ddp.DIGITS_DEFAULTS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto: NCCL when this rank has a GPU of its own, else gloo")
    p.add_argument("--epochs", type=int, default=d["epochs"])
    p.add_argument("--global-batch", type=int, default=d["global_batch"],
                   help="images per optimizer step over all ranks (per-rank batch = this / world size / accumulate)")
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none")
    p.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step (no_sync on all but last)")
    p.add_argument("--checkpoint", default=None, help="rank 0 writes the trained model here (.pt)")
    p.add_argument("--no-set-epoch", action="store_true", help="skip sampler.set_epoch (shows the bug)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="seconds a collective may wait for a peer")
    p.add_argument("--out", default=None, help="rank 0 writes the result as JSON here")
    return p.parse_args(argv)


def _backend(requested: str, local_rank: int) -> str:
    has_gpu = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    if requested == "auto":
        return "nccl" if has_gpu and dist.is_nccl_available() else "gloo"
    if requested == "nccl" and not has_gpu:
        raise SystemExit(f"--backend nccl: local rank {local_rank} has no GPU of its own "
                         f"({torch.cuda.device_count()} visible); use --backend gloo")
    return requested


@record  # a rank's traceback goes into torchrun's failure summary
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not set: start this script with torchrun (see its docstring)")
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    backend = _backend(args.backend, local_rank)
    ctx = spawn.start_process_group(backend, rank, world, local_rank, args.timeout_s)  # env://, from torchrun
    done = False
    try:
        result = ddp.train_digits(
            ctx, epochs=args.epochs, batch_size=ddp.per_rank_batch(args.global_batch, world, args.accumulate),
            lr=args.lr, seed=args.seed, amp=None if args.amp == "none" else args.amp, accumulate=args.accumulate,
            checkpoint_path=args.checkpoint, set_epoch=not args.no_set_epoch)
        hosts: list[str | None] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())  # which node each rank ran on
        result["hosts"] = hosts
        result["nnodes"] = len(set(hosts))
        if rank == 0:
            summary = (f"world_size {world} on {result['nnodes']} host(s), {backend}: test accuracy "
                       f"{result['accuracy']:.4f}, final loss {result['final_loss']:.4f}, "
                       f"{result['samples_per_s']:.0f} samples/s")
            print(summary, flush=True)
            if args.out:
                out = Path(args.out)
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_name(out.name + ".tmp")
                tmp.write_text(json.dumps(result, indent=2) + "\n")
                tmp.replace(out)  # atomic: a reader never sees half a file
        done = True
    finally:
        spawn.leave_process_group(ctx, synchronize=done)  # after a failure, no barrier: a peer may be stuck
    return 0


if __name__ == "__main__":
    sys.exit(main())
