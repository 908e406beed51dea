"""Lab 03's torch inference paths, the substitutes for TensorRT on a GPU without it, one knob per step so each step's
gain is its own: eager FP32 with TF32 off, eager FP32 as PyTorch runs it by default (cuDNN convolutions in TF32),
autocast (BF16/FP16), channels-last memory, ``torch.compile`` (Inductor), and that captured in a CUDA graph.

``fp32_mode`` sets what "FP32" means around each eager call and restores it after; Inductor's autotuning reports are
summarized instead of printed (``quiet_autotuning``); the compile workers are stopped when the lab ends
(``shutdown_compile_workers``). Times are milliseconds (``lab_utils.timing``)."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from lab_utils.timing import Timing, benchmark, cuda_graph

AMP_DTYPES = ("bf16", "fp16")
# Each step adds one knob to the one before (the two eager FP32 steps are the two baselines).
TORCH_STEPS = ("eager-ieee", "eager", "autocast", "channels-last", "compile", "cuda-graph")
FP32_MODES = ("default", "ieee")


def _tf32_switches() -> tuple[Any, Any, Any] | None:
    """torch >= 2.9's per-backend precision switches (cuDNN conv, cuDNN RNN, cuBLAS matmul), or None."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    rnn = getattr(torch.backends.cudnn, "rnn", None)
    matmul = torch.backends.cuda.matmul
    if all(m is not None and hasattr(m, "fp32_precision") for m in (conv, rnn, matmul)):
        return conv, rnn, matmul
    return None


@contextlib.contextmanager
def fp32_mode(mode: str) -> Iterator[None]:
    """What FP32 means inside the block, restored after: ``"default"`` (PyTorch's: cuDNN convolutions in TF32,
    matmuls IEEE) or ``"ieee"`` (TF32 off everywhere). torch >= 2.9's ``fp32_precision`` switches (cuDNN's conv and
    RNN set together, so the legacy ``allow_tf32`` reads stay valid), else the legacy flags."""
    if mode not in FP32_MODES:
        raise ValueError(f"fp32_mode({mode!r}): use one of {FP32_MODES}")
    cudnn_value = "tf32" if mode == "default" else "ieee"
    if (switches := _tf32_switches()) is not None:
        conv, rnn, matmul = switches
        saved = (conv.fp32_precision, rnn.fp32_precision, matmul.fp32_precision)
        conv.fp32_precision = rnn.fp32_precision = cudnn_value
        matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            conv.fp32_precision, rnn.fp32_precision, matmul.fp32_precision = saved
    else:
        legacy = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
        torch.backends.cudnn.allow_tf32 = mode == "default"
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = legacy


def set_fp32_semantics(device: str) -> str:
    """Turn cuDNN autotuning on (a GPU) and say what the two FP32 baselines (``fp32_mode``) mean here."""
    if str(device).startswith("cuda"):
        torch.backends.cudnn.benchmark = True  # cuDNN times its algorithms per shape: TensorRT's tactic choice
        override = ("; TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 is set here (NGC images set it), so cuBLAS matmuls run in "
                    "TF32 in both (ResNet-50 has one, its classifier)"
                    if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1" else "")
        return ("two FP32 baselines: `fp32` = PyTorch's default (cuDNN convolutions in TF32, "
                "torch.backends.cudnn.conv.fp32_precision = 'tf32'; matmuls IEEE) and `fp32-ieee` = TF32 off "
                "(fp32_precision = 'ieee'); cudnn.benchmark = True, so eager gets the fastest cuDNN algorithm per "
                f"shape{override}")
    return "FP32 = IEEE single precision (the CPU has no TF32)"


@dataclass
class TorchRunner:
    """One torch backend, ready to run one batch: ``runner()`` returns the output (on the device)."""

    name: str  # "eager", "autocast", "channels-last", "compile", "cuda-graph"
    precision: str  # "fp32" (PyTorch's default), "fp32-ieee" (TF32 off), "bf16", "fp16"
    batch: int
    fn: Callable[[], torch.Tensor]
    setup_s: float = 0.0  # compile or capture time paid before the first timed call
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> torch.Tensor:
        return self.fn()


def _amp_dtype(amp: str) -> torch.dtype:
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp={amp!r}: use one of {AMP_DTYPES}")
    return torch.bfloat16 if amp == "bf16" else torch.float16


def _no_cudagraph_mode(mode: str) -> str:
    """torch.compile's mode without inductor's own CUDA graphs (the lab captures them itself, the last step)."""
    return {"max-autotune": "max-autotune-no-cudagraphs", "reduce-overhead": "default"}.get(mode, mode)


def torch_runners(model: nn.Module, x: torch.Tensor | np.ndarray, *, steps: Sequence[str] = TORCH_STEPS,
                  amp: str = "bf16", compile_mode: str = "max-autotune", autotune_convs: bool = False,
                  progress: Callable[..., Iterable[Any]] | None = None) -> Iterator[TorchRunner]:
    """The substitute chain on one batch ``x``, each step changing one thing: ``eager-ieee`` (FP32, TF32 off),
    ``eager`` (PyTorch's default, TF32 convolutions), ``autocast`` (``amp``), ``channels-last``, ``compile``
    (``compile_mode`` without Inductor's CUDA graphs) and ``cuda-graph`` (step 5 captured and replayed: the two
    halves of max-autotune). A generator: each step is built (compiled, captured) when the caller gets to it. On a
    CPU only ``eager`` is offered. ``autotune_convs=False`` leaves convolutions to cuDNN (Triton's templates rarely
    beat it on ResNet-50 and cost minutes to tune). ``progress``: ``lab_utils.widgets.progress``, one step each."""
    runners = _torch_runners(model, x, steps=steps, amp=amp, compile_mode=compile_mode, autotune_convs=autotune_convs)
    if progress is None:
        yield from runners
        return
    gpu = next(model.parameters()).device.type == "cuda"
    total = sum(1 for s in TORCH_STEPS if s in steps and (gpu or s == "eager"))  # on a CPU only eager is offered
    yield from progress(runners, total=total, desc=f"torch paths, batch {int(torch.as_tensor(x).shape[0])}")


def _torch_runners(model: nn.Module, x: torch.Tensor | np.ndarray, *, steps: Sequence[str],
                   amp: str, compile_mode: str, autotune_convs: bool) -> Iterator[TorchRunner]:
    """The chain of :func:`torch_runners`, without the progress bar."""
    device = next(model.parameters()).device
    x = torch.as_tensor(x).to(device)
    gpu = device.type == "cuda"
    if unknown := set(steps) - set(TORCH_STEPS):
        raise ValueError(f"torch_runners(steps=...): unknown steps {sorted(unknown)}")
    batch = int(x.shape[0])

    def eager_in(mode: str | None) -> Callable[[], torch.Tensor]:
        def eager() -> torch.Tensor:
            with fp32_mode(mode) if mode else contextlib.nullcontext(), torch.inference_mode():
                return model(x)

        return eager

    if "eager-ieee" in steps and gpu:
        yield TorchRunner("eager", "fp32-ieee", batch, eager_in("ieee"), note="TF32 off")
    if "eager" in steps:
        yield TorchRunner("eager", "fp32", batch, eager_in("default" if gpu else None),
                          note="PyTorch's default: TF32 convolutions" if gpu else "")
    if not gpu:
        return
    dtype = _amp_dtype(amp)
    if "autocast" in steps:
        def autocast() -> torch.Tensor:
            with torch.inference_mode(), torch.autocast("cuda", dtype=dtype):
                return model(x)

        yield TorchRunner("autocast", amp, batch, autocast, note="NCHW")
    if not {"channels-last", "compile", "cuda-graph"} & set(steps):
        return
    # A copy: .to(memory_format=...) converts a module in place, and the caller's eager model stays NCHW.
    # (Module.to takes memory_format; torch's annotated overloads leave it out.)
    model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x_cl = x.contiguous(memory_format=torch.channels_last)

    def forward(inp: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=dtype):
            return model_cl(inp)

    if "channels-last" in steps:
        def channels_last() -> torch.Tensor:
            with torch.inference_mode():
                return forward(x_cl)

        yield TorchRunner("channels-last", amp, batch, channels_last, note="autocast + channels_last")
    if "compile" not in steps and "cuda-graph" not in steps:
        return
    mode = _no_cudagraph_mode(compile_mode)
    compiled = torch.compile(forward, mode=mode, dynamic=False)
    kernels_before = _inductor_kernel_count()
    t0 = time.perf_counter()
    from torch._inductor import config as inductor_config  # Inductor loads in seconds: only when compiling

    backends = "ATEN,TRITON" if autotune_convs else "ATEN"
    tuning: dict[str, Any] = {}
    try:
        with torch.inference_mode(), inductor_config.patch(max_autotune_conv_backends=backends), \
                quiet_autotuning(tuning):
            compiled(x_cl)  # compiles (and autotunes) now, not inside a timed repetition
        torch.cuda.synchronize(device)
    except Exception as err:  # a compiler failure costs the compiled steps, not the rest of the lab
        print(f"torch.compile(mode={mode!r}) failed, so the compile and cuda-graph steps are skipped: "
              f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
        return
    compile_s = time.perf_counter() - t0
    after = _inductor_kernel_count()
    kernels = after - kernels_before if after is not None and kernels_before is not None else None

    def run_compiled() -> torch.Tensor:
        with torch.inference_mode():
            return compiled(x_cl)

    if "compile" in steps:
        yield TorchRunner("compile", amp, batch, run_compiled, compile_s, f"torch.compile(mode={mode!r})",
                          {"generated_kernels": kernels, "autotuning": tuning})
    if "cuda-graph" in steps:
        try:
            graphed = _cuda_graph_runner(run_compiled, x_cl, amp, batch, mode)
        except Exception as err:  # e.g. an operation that cannot be captured: say so, keep the lab going
            print(f"CUDA graph capture failed, so the cuda-graph step is skipped: {type(err).__name__}: {err}")
            return
        yield graphed


def time_torch(runner: Callable[[], Any], device: str, reps: int = 10, warmup: int = 2, name: str = "torch") -> Timing:
    """Time a torch runner (CUDA events on a GPU, the host clock on a CPU); per-repetition ms."""
    return benchmark(runner, reps=reps, warmup=warmup, device="cuda" if str(device).startswith("cuda") else "cpu",
                     name=name)


@contextlib.contextmanager
def quiet_autotuning(summary: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Silence Inductor's max-autotune reports (tables, stats lines, failed-candidate errors) and collect them in
    ``summary``: ``gemms`` tuned, ``choices`` timed, ``skipped`` (could not run), ``biggest`` (the largest GEMM: shapes,
    winning kernel, its ms and cuBLAS's ms). Nothing here changes which kernels are tried or chosen."""
    summary.update(gemms=0, choices=0, skipped=0, biggest=None)
    patches: dict[str, Any] = {}
    stack = contextlib.ExitStack()
    # private settings: a torch without them prints its reports, and the lab still runs
    with contextlib.suppress(Exception):
        from torch._inductor import config as inductor_config

        patches = {k: v for k, v in (("max_autotune_report_choices_stats", False),
                                     ("autotune_num_choices_displayed", 0)) if hasattr(inductor_config, k)}
        stack.enter_context(inductor_config.patch(patches))

    class _Failures(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if "during autotuning" in str(record.msg):
                summary["skipped"] += 1
                return False
            return True

    failures = _Failures()
    select_log = logging.getLogger("torch._inductor.select_algorithm")
    select_log.addFilter(failures)
    restore = None
    with contextlib.suppress(Exception):
        from torch._inductor.select_algorithm import AlgorithmSelectorCache

        original = AlgorithmSelectorCache.__dict__.get("log_results")
        if isinstance(original, staticmethod):
            inner = original.__func__

            def log_results(*args: Any, **kwargs: Any) -> Any:
                with contextlib.suppress(Exception):  # the summary is a courtesy: never let it break a compile
                    named = dict(zip(("name", "input_nodes", "timings"), args, strict=False)) | kwargs
                    _note_autotuning(summary, named["name"], named["input_nodes"], named["timings"])
                return inner(*args, **kwargs)

            AlgorithmSelectorCache.log_results = staticmethod(log_results)  # type: ignore[method-assign]
            restore = (AlgorithmSelectorCache, original)
    try:
        with stack, warnings.catch_warnings():
            # Inductor's own call of a deprecated storage API; nothing the student can act on.
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            yield summary
    finally:
        select_log.removeFilter(failures)
        if restore is not None:
            restore[0].log_results = restore[1]  # type: ignore[method-assign]


def _note_autotuning(summary: dict[str, Any], name: str, input_nodes: Any, timings: dict[Any, float]) -> None:
    """Add one tuned operation (Inductor's ``log_results`` arguments) to ``quiet_autotuning``'s summary."""
    summary["gemms"] += 1
    summary["choices"] += len(timings)
    if not (finite := {c: t for c, t in timings.items() if t is not None and math.isfinite(t)}):
        return
    sizes = [tuple(int(d) for d in n.get_size()) for n in input_nodes]
    a, b = sizes[-2], sizes[-1]  # mm(A, B), addmm(bias, A, B): the last two inputs are the operands
    macs = math.prod(a) * b[-1] if len(a) >= 2 and len(b) >= 2 else 0
    if summary["biggest"] is not None and macs <= summary["biggest"]["macs"]:
        return
    best = min(finite, key=finite.__getitem__)
    aten = [t for c, t in finite.items() if not str(getattr(c, "name", "")).startswith("triton")]
    summary["biggest"] = {"op": f"{name}({', '.join('x'.join(map(str, s)) for s in sizes)})", "macs": macs,
                          "kernel": str(getattr(best, "name", best)), "desc": str(getattr(best, "description", "")),
                          "best_ms": finite[best], "cublas_ms": min(aten) if aten else None}


def autotuning_line(summary: dict[str, Any] | None) -> str:
    """One sentence about a compile's autotuning (``quiet_autotuning``'s summary)."""
    if not summary or not summary.get("gemms"):
        return "no matrix multiplication was autotuned (a compile without max-autotune, or results from the cache)"
    line = f"max-autotune timed {summary['choices']} candidate kernels for {summary['gemms']} matrix multiplications"
    if summary.get("skipped"):
        line += (f" ({summary['skipped']} candidates skipped: Triton configurations needing more shared memory "
                 "than an SM has, normal and harmless)")
    if big := summary.get("biggest"):
        cublas = f", cuBLAS {big['cublas_ms']:.4f} ms" if big.get("cublas_ms") is not None else ""
        line += f"; the biggest, {big['op']}, went to {big['kernel']} ({big['best_ms']:.4f} ms{cublas})"
    return line


def _cuda_graph_runner(run: Callable[[], torch.Tensor], static_x: torch.Tensor, amp: str, batch: int,
                       mode: str) -> TorchRunner:
    """Capture ``run`` (which reads ``static_x``) in a CUDA graph; replays reuse the same input and output memory."""
    t0 = time.perf_counter()
    graph, static_out = cuda_graph(run)
    torch.cuda.synchronize()

    def replay() -> torch.Tensor:
        graph.replay()
        return static_out

    return TorchRunner("cuda-graph", amp, batch, replay, time.perf_counter() - t0,
                       f"torch.compile(mode={mode!r}) captured with torch.cuda.graph",
                       {"graph": graph, "static_input": static_x})


def shutdown_compile_workers() -> None:
    """Stop torch.compile's pool of compile worker processes (nothing the lab started may outlive it)."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers as shutdown
    except ImportError:
        return
    shutdown()


def _inductor_kernel_count() -> int | None:
    try:
        from torch._inductor import metrics

        return int(metrics.generated_kernel_count)
    except Exception:  # a private counter: absent in some torch builds, and then the lab says so
        return None
