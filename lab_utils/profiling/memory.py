"""Memory: peak bytes of a training step on any device, activation checkpointing (full and selective), gradient
accumulation against a larger batch, a real out-of-memory error, and a CUDA memory snapshot's summary.

Peak memory is read where the device keeps it: ``torch.cuda.max_memory_allocated`` on a GPU; on the CPU (no
allocator statistics) from the profiler's ``[memory]`` events (``profile_memory=True``), whose
"Total Allocated" counts every allocation made while profiling."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lab_utils.procs import temporary_folder
from lab_utils.profiling.programs import time_steps
from lab_utils.timing import sync

__all__ = ["peak_bytes", "Blocks", "checkpoint_table", "accumulation_table", "oom_error", "snapshot_summary",
           "SAVE_OPS"]

MiB = 2**20
# Selective checkpointing keeps what is expensive to recompute (matmul outputs) and recomputes the cheap
# pointwise ops (GELU, adds, norms): the policy PyTorch's documentation shows.
SAVE_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def peak_bytes(fn: Callable[[], Any], device: str) -> int:
    """Peak bytes allocated on ``device`` while ``fn()`` runs, above what was allocated before it."""
    if device.startswith("cuda"):
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync(device)
        return int(torch.cuda.max_memory_allocated() - base)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _peak_from_trace(prof)


def _peak_from_trace(prof: Any) -> int:
    """The largest running "Total Allocated" of the CPU allocator in the profile's ``[memory]`` events."""
    with temporary_folder("memtrace") as d:
        path = d / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0]
    return int(max(totals, default=0))


class Blocks(nn.Module):
    """``depth`` transformer-style feed-forward blocks (LayerNorm → Linear d→4d → GELU → Linear 4d→d, residual):
    the layers whose activations checkpointing trades for recomputation. ``mode``: ``none``, ``full`` (each block
    recomputed in backward) or ``selective`` (matmul outputs kept, pointwise ops recomputed)."""

    def __init__(self, width: int, depth: int, mode: str = "none"):
        super().__init__()
        if mode not in ("none", "full", "selective"):
            raise ValueError(f"Blocks(mode={mode!r}): one of none, full, selective")
        self.mode = mode
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            if self.mode == "none":
                x = x + blk(x)
            elif self.mode == "full":
                x = x + checkpoint(blk, x, use_reentrant=False)
            else:
                contexts = partial(create_selective_checkpoint_contexts, _policy)
                x = x + checkpoint(blk, x, use_reentrant=False, context_fn=contexts)
        return x


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _train_fn(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model(x).float().pow(2).mean().backward()

    return run


def checkpoint_table(width: int, depth: int, tokens: int, device: str, reps: int = 5) -> list[dict[str, Any]]:
    """Peak memory of forward + backward above the weights, and time per step, without checkpointing, with
    every block checkpointed, and with selective checkpointing. Same weights and input for all three."""
    rows = []
    torch.manual_seed(0)
    ref = Blocks(width, depth).to(device)
    x = torch.randn(tokens, width, device=device)
    for mode in ("none", "full", "selective"):
        model = Blocks(width, depth, mode).to(device)
        model.load_state_dict(ref.state_dict())
        run = _train_fn(model, x)
        run()  # warm-up: first-call allocations and kernel choice stay out of the numbers
        model.zero_grad(set_to_none=False)  # gradients exist before the measurement, as in a training loop
        peak = peak_bytes(run, device)
        ms = time_steps(run, steps=reps, warmup=1, device=device)
        rows.append({"mode": mode, "peak_mib": peak / MiB, "step_ms": ms})
    base = rows[0]
    for r in rows:
        r["memory_saved"] = 1 - r["peak_mib"] / base["peak_mib"]
        r["time_added"] = r["step_ms"] / base["step_ms"] - 1
    return rows


def accumulation_table(width: int, depth: int, tokens: int, micro: int, device: str,
                       reps: int = 3) -> list[dict[str, Any]]:
    """One step on ``tokens × micro`` rows against ``micro`` accumulated steps of ``tokens`` rows: peak memory,
    time per sample, and the largest gradient difference (the loss is divided by ``micro`` so both agree)."""
    torch.manual_seed(0)
    model = Blocks(width, depth).to(device)
    x = torch.randn(tokens * micro, width, device=device)
    big = _train_fn(model, x)

    def accumulated() -> None:
        for chunk in x.chunk(micro):
            (model(chunk).float().pow(2).mean() / micro).backward()

    out = []
    grads = {}
    for name, fn in (("one large batch", big), (f"{micro} accumulated micro-batches", accumulated)):
        model.zero_grad(set_to_none=True)
        fn()
        grads[name] = [p.grad.detach().clone() for p in model.parameters()]
        peak = peak_bytes(fn, device)
        model.zero_grad(set_to_none=True)
        ms = time_steps(fn, steps=reps, warmup=1, device=device)
        out.append({"variant": name, "rows": tokens * micro, "peak_mib": peak / MiB, "step_ms": ms,
                    "us_per_sample": ms * 1e3 / (tokens * micro)})
    a, b = grads.values()
    diff = max(float((g1 - g2).abs().max() / (g1.abs().max() + 1e-12)) for g1, g2 in zip(a, b, strict=True))
    for r in out:
        r["max_rel_grad_diff"] = diff
    return out


def oom_error(device: str) -> dict[str, str]:
    """Ask ``device`` for far more memory than it has and return the real error: type and message.

    On a GPU: 1.5× the device's total memory (``torch.cuda.OutOfMemoryError``, raised by the caching allocator
    before anything is touched). On the CPU: 2**50 bytes (1 PiB), which no machine maps."""
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        nbytes = int(total * 1.5)
    else:
        nbytes = 2**50
    try:
        torch.empty(nbytes, dtype=torch.uint8, device=device)
    except (torch.cuda.OutOfMemoryError, RuntimeError, MemoryError) as err:
        return {"type": type(err).__name__, "message": str(err).strip(), "requested_gib": f"{nbytes / 2**30:.1f}"}
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    raise RuntimeError(f"oom_error: {nbytes} bytes were granted on {device}; expected an allocation failure")


def snapshot_summary(path: str | Path, top: int = 8) -> dict[str, Any]:
    """Summarize a snapshot from ``torch.cuda.memory._dump_snapshot(path)``: reserved vs allocated bytes, the
    largest live blocks and where (the innermost frame outside torch) each was allocated."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    segments = snap.get("segments", [])
    reserved = sum(s["total_size"] for s in segments)
    live = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    allocated = sum(b["size"] for b in live)

    def where(frames: list[dict[str, Any]]) -> str:
        for fr in frames:  # the innermost Python frame outside torch (C++ frames have no .py file)
            fn = fr.get("filename", "")
            if fn.endswith(".py") and "/torch/" not in fn:
                return f"{Path(fn).name}:{fr.get('line')} {fr.get('name')}"
        return "(no Python frame outside torch)"

    sites: Counter[str] = Counter()
    for b in live:
        sites[where(b.get("frames", []))] += b["size"]
    traces = [t for dev in snap.get("device_traces", []) for t in dev]
    actions = Counter(t.get("action") for t in traces)
    return {"reserved_mib": reserved / MiB, "allocated_mib": allocated / MiB, "segments": len(segments),
            "live_blocks": len(live), "top_sites_mib": {k: v / MiB for k, v in sites.most_common(top)},
            "events": dict(actions)}
