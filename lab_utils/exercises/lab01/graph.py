"""Lab 01's 01.7: a chain of small kernels captured once in a CUDA graph and replayed per input (GPU only; on the CPU
tier the check is not applicable and says what the H200 reference measured)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from lab_utils.course import specs
from lab_utils.exercises.framework import CodeExercise, References, Wrong, items, run_student, source_as

# --- q7: a CUDA graph ------------------------------------------------------------------------------------


def graph_unavailable() -> str | None:
    """Why CUDA graphs cannot run here (with the H200 reference's numbers), or None on a CUDA GPU."""
    if torch.cuda.is_available():
        return None
    ref = specs.h200_measured("01")
    eager, graph = ref.get("launch_eager"), ref.get("launch_cuda_graph")
    seen = (f" On the H200 reference run, 1000 small kernels cost {eager:.2f} µs each launched one by one and "
            f"{graph:.2f} µs each replayed from a graph ({eager / graph:.1f}x)." if eager and graph else "")
    why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA GPU"
    return (f"CUDA graphs record and replay CUDA kernels, so they need an NVIDIA GPU; {why} (the CPU tier), "
            f"so this check cannot run here.{seen}")


def reference_replay_with_graph(chain: Callable[[torch.Tensor], torch.Tensor], static_x: torch.Tensor,
                                xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[chain(x) for x in xs]``, computed by capturing ``chain(static_x)`` once in a CUDA graph and replaying it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            chain(static_x)  # warm-up on a side stream: lazy initialisation stays out of the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = chain(static_x)  # recorded, not run
    outs = []
    for x in xs:
        static_x.copy_(x)  # new data into the captured input's memory
        g.replay()  # every kernel of the chain, one launch
        outs.append(static_y.clone())  # the next replay overwrites static_y
    return outs


_GRAPH_KERNELS, _GRAPH_INPUTS, _GRAPH_NUMEL = 100, 32, 4096


def _grade_replay_with_graph(fn: Any) -> str:
    # Runs only where graph_unavailable() says None: q7's applicable= marks the check not applicable before grading.
    counts = {"captured": 0, "eager": 0}

    def body(x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(_GRAPH_KERNELS):  # 2 small kernels each: launch-bound when run eagerly
            y = y * 0.999 + 0.001
        return y

    def chain(x: torch.Tensor) -> torch.Tensor:
        counts["captured" if torch.cuda.is_current_stream_capturing() else "eager"] += 1
        return body(x)

    gen = torch.Generator(device="cuda").manual_seed(1)
    static_x = torch.randn(_GRAPH_NUMEL, device="cuda", generator=gen)
    captured_input = body(static_x.clone())
    xs = [torch.randn(_GRAPH_NUMEL, device="cuda", generator=gen) for _ in range(_GRAPH_INPUTS)]
    want = [body(x) for x in xs]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = run_student(fn, chain, static_x, xs, call="replay_with_graph(chain, static_x, xs)", timeout_s=120)
    torch.cuda.synchronize()
    student_ms = (time.perf_counter() - t0) * 1e3
    got = items(got, len(xs), "replay_with_graph", f"a list of {len(xs)} tensors, chain(x) for each x in xs, in order")
    if not all(isinstance(t, torch.Tensor) for t in got):
        raise Wrong(f"replay_with_graph returned a list of {len(xs)}, not all tensors: chain(x) for each x in xs")
    if counts["captured"] == 0:
        raise Wrong("chain was never captured into a graph: create g = torch.cuda.CUDAGraph() and run chain(static_x) "
                    "inside `with torch.cuda.graph(g):`, then g.replay() for each input")
    if counts["captured"] > 1:
        raise Wrong(f"chain was captured {counts['captured']} times: capture it once, then replay that graph for "
                    "every input (capturing costs as much as running eagerly)")
    if counts["eager"] >= len(xs):
        raise Wrong(f"chain ran eagerly {counts['eager']} times for {len(xs)} inputs: the outputs must come from "
                    "g.replay(), not from calling chain(x)")
    same_memory = len({t.data_ptr() for t in got}) == 1
    for i, (t, w) in enumerate(zip(got, want, strict=True)):
        if t.shape == w.shape and torch.allclose(t, w, rtol=1e-5, atol=1e-6):
            continue
        if all(torch.allclose(o, captured_input, rtol=1e-5, atol=1e-6) for o in got):
            raise Wrong("every output is chain() of the tensor static_x held at capture time: a graph replays on "
                        "the memory it captured, so copy each input into it (static_x.copy_(x)) before g.replay()")
        if same_memory or all(torch.allclose(o, want[-1], rtol=1e-5, atol=1e-6) for o in got):
            raise Wrong("all your outputs are the last input's result: each replay writes into the same output "
                        "tensor, so keep a copy after each replay (outs.append(static_y.clone()))")
        err = float((t.float() - w.float()).abs().max()) if t.shape == w.shape else math.inf
        raise Wrong(f"output {i} differs from chain(xs[{i}]) (largest difference {err:.3g}, shape "
                    f"{tuple(t.shape)})")
    return f"{len(xs)} inputs through one captured graph of {2 * _GRAPH_KERNELS} kernels in {student_ms:.1f} ms."


q7 = CodeExercise(
    name="01.7 capture and replay a CUDA graph", var="replay_with_graph", grade=_grade_replay_with_graph,
    references=References("capture the chain in a CUDA graph and replay it yourself", reference_replay_with_graph),
    signature="replay_with_graph(chain, static_x, xs) -> list[Tensor]", applicable=graph_unavailable,
    hints=[
        "A graph records the kernels of one call, on fixed memory: capture chain(static_x) once, inside "
        "`with torch.cuda.graph(g):` (g = torch.cuda.CUDAGraph()); keep what it returns (static_y).",
        "Replaying reads static_x's memory and writes static_y's: for each x, static_x.copy_(x), then g.replay(), "
        "then keep static_y.clone() (the next replay overwrites it).",
        "Warm up first, on a side stream, so lazy initialisation is not captured: a torch.cuda.Stream() that waits "
        "for the current stream, chain(static_x) a few times inside `with torch.cuda.stream(...)`, then the current "
        "stream waits for the side stream (wait_stream both ways).",
    ],
    solution_text=source_as(reference_replay_with_graph, "replay_with_graph(chain, static_x, xs)"),
)
