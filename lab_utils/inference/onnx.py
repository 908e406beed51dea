"""Lab 03 inference: the models, ONNX export and parity, ONNX Runtime's optimization levels, the torch
backends that stand in for TensorRT, and the one comparison table.

Two models: the digits CNN (trained here in seconds on scikit-learn's 8x8 digits, so accuracy is
measurable) and a bottleneck ResNet-50 with random weights (for speed: torchvision's ``resnet50`` on a GPU
where torchvision imports; on a CPU the same layout at width 16 and 64 px, so the lab stays fast).

Units are in names: ``_ms`` milliseconds, ``_s`` seconds, ``images_per_s`` images per second of wall time;
accuracies are fractions in [0, 1] and accuracy changes are percentage points. torch, onnx and onnxruntime
are imported inside the functions: importing this module does no work.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.args import check_int, require_torch
from lab_utils.models import RESNET50_BLOCKS, BottleneckResNet, digits_arrays, make_digits_cnn
from lab_utils.timing import cpu_cores

# The digits CNN's training recipe (lab 02's DDP runs use the same CNN and split).
DIGITS_TRAIN = {"epochs": 4, "batch_size": 64, "lr": 0.05, "momentum": 0.9, "width": 32}

# ResNet-50 sizes by device: a GPU gets the real thing (25.6 M parameters, 4.1 GFLOP per 224 px image);
# a CPU the same 50-layer bottleneck layout at a quarter of the width and 64 px (about 2 M parameters).
RESNET_SIZES = {"cuda": {"width": 64, "image_size": 224}, "cpu": {"width": 16, "image_size": 64}}

# ONNX Runtime's graph optimization levels, weakest first. "layout" (NCHWc layouts on x86) appeared in
# ONNX Runtime 1.22; ``ort_levels()`` lists the ones this onnxruntime has.
ORT_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",  # constant folding, redundant node removal, Conv+BatchNorm/Mul/Add folding
    "extended": "ORT_ENABLE_EXTENDED",  # operator fusion: Conv+Relu -> FusedConv, Gemm+Relu, GELU, attention...
    "layout": "ORT_ENABLE_LAYOUT",  # layout transforms: NCHW -> NCHWc blocked convolutions
    "all": "ORT_ENABLE_ALL",
}

ONNX_OPSET = 18  # the dynamo exporter's own default; TensorRT 10 and 11 parse it
MAX_BATCH = 4096  # upper bound of the exported batch dimension (the engines' profiles choose their own)

AMP_DTYPES = ("bf16", "fp16")
# ONNX Runtime graph rewrites that assume a quantized type has no negative values (wrong for FP8)
ORT_FP8_UNSAFE_REWRITES = ("ReluQuantRewrite",)


def _torch() -> Any:
    return require_torch("lab_utils.inference.onnx")


# --------------------------------------------------------------------------------------------------
# Models


@dataclass
class ModelInfo:
    """What a model is: where it came from, its size and its input."""

    name: str
    source: str
    params_m: float  # millions of parameters
    input_shape: tuple[int, ...]  # one sample, without the batch dimension
    gflop_per_image: float  # multiply-adds x 2 of one forward pass
    notes: str = ""
    slug: str = ""  # for result names: the same slug means the same model, so runs compare as ratios

    def __str__(self) -> str:
        shape = "x".join(map(str, self.input_shape))
        return (f"{self.name}: {self.source}; {self.params_m:.2f} M parameters, input {shape}, "
                f"{self.gflop_per_image:.3g} GFLOP per image{'; ' + self.notes if self.notes else ''}")


def count_gflop(model: Any, input_shape: Sequence[int]) -> float:
    """GFLOP (2 x multiply-adds) of one forward pass on one sample, counted over Conv2d and Linear layers."""
    torch = _torch()
    nn = torch.nn
    macs: list[int] = []

    def hook(mod: Any, inputs: Any, out: Any) -> None:
        if isinstance(mod, nn.Conv2d):
            k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
            macs.append(out[0].numel() * k)
        elif isinstance(mod, nn.Linear):
            macs.append(out[0].numel() * mod.in_features)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        p = next(model.parameters())
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), dtype=p.dtype, device=p.device))
    finally:
        for h in handles:
            h.remove()
    return 2 * sum(macs) / 1e9


def _params_m(model: Any) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def train_digits_cnn(epochs: int = DIGITS_TRAIN["epochs"], seed: int = 0, width: int = DIGITS_TRAIN["width"],
                     batch_size: int = DIGITS_TRAIN["batch_size"], lr: float = DIGITS_TRAIN["lr"]) -> tuple[Any, dict]:
    """Train lab 02's digits CNN in this process on the CPU; returns (model in eval mode, facts).

    1440 training images, SGD with momentum, cross-entropy; a few seconds on a laptop CPU. The facts hold
    ``accuracy`` (test set, 357 images, fp32), ``train_s`` and the recipe.
    """
    torch = _torch()
    check_int(epochs, "epochs", "train_digits_cnn")
    check_int(batch_size, "batch_size", "train_digits_cnn")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    data = digits_arrays()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.15 M-parameter CNN: more threads only add synchronisation (10x slower on a busy CPU)
    x, y = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
    model = make_digits_cnn(width)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=DIGITS_TRAIN["momentum"])
    t0 = time.perf_counter()
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    train_s = time.perf_counter() - t0
    torch.set_num_threads(threads)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(data["x_test"])).numpy()
    facts = {"accuracy": accuracy(logits, data["y_test"]), "train_s": train_s, "epochs": epochs, "seed": seed,
             "width": width, "train_images": int(len(y)), "test_images": int(len(data["y_test"]))}
    return model, facts


def digits_info(model: Any) -> ModelInfo:
    return ModelInfo("digits CNN", "lab 02's DigitsCNN, trained here", _params_m(model), (1, 8, 8),
                     count_gflop(model, (1, 8, 8)), slug="digits")


def make_resnet50(device: str = "cpu", width: int | None = None, image_size: int | None = None,
                  num_classes: int = 1000, seed: int = 0, prefer_torchvision: bool = True) -> tuple[Any, ModelInfo]:
    """A ResNet-50 with random weights for speed measurements, in eval mode on ``device``.

    On a GPU, at full size: ``torchvision.models.resnet50(weights=None)`` when torchvision imports, else this
    module's identical bottleneck ResNet. On a CPU the same layout at width 16 and 64 px (``RESNET_SIZES``).
    BatchNorm statistics are settled on a few random batches, so activations keep a realistic scale
    (random weights with fresh statistics let values grow layer after layer, which low precision punishes
    unfairly).
    """
    torch = _torch()
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    width = RESNET_SIZES[kind]["width"] if width is None else check_int(width, "width", "make_resnet50")
    image_size = (RESNET_SIZES[kind]["image_size"] if image_size is None
                  else check_int(image_size, "image_size", "make_resnet50", 32))
    torch.manual_seed(seed)
    source = f"lab_utils bottleneck ResNet-50 layout {RESNET50_BLOCKS}, width {width}"
    model = None
    if prefer_torchvision and width == 64:
        try:
            from torchvision.models import resnet50

            model, source = resnet50(weights=None, num_classes=num_classes), "torchvision.models.resnet50(weights=None)"
        except ImportError:
            model = None
    if model is None:
        model = BottleneckResNet(width, RESNET50_BLOCKS, num_classes)
    model = model.to(device)
    _settle_batchnorm(model, image_size, device)
    model.eval()
    info = ModelInfo("ResNet-50" if width == 64 else f"ResNet-50 layout (width {width})", source,
                     _params_m(model), (3, image_size, image_size), count_gflop(model, (3, image_size, image_size)),
                     "random weights, for speed",
                     slug="resnet50" if (width, image_size) == (64, 224) else f"resnet50-w{width}-{image_size}px")
    return model, info


def _settle_batchnorm(model: Any, image_size: int, device: str, batches: int = 2, batch_size: int = 8) -> None:
    torch = _torch()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the settling batches
    model.train()
    gen = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(batch_size, 3, image_size, image_size, generator=gen).to(device))
    model.eval()


def accuracy(logits: Any, labels: Any) -> float:
    """Top-1 accuracy (fraction) of ``logits`` (N, classes) against integer ``labels`` (N,)."""
    logits, labels = np.asarray(logits), np.asarray(labels)
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"accuracy: logits must be (N, classes) and labels (N,); got {logits.shape} and "
                         f"{labels.shape}")
    return float((logits.argmax(1) == labels).mean())


def agreement(logits: Any, reference: Any) -> float:
    """Fraction of samples whose top-1 class equals the reference's (for models without labels)."""
    return float((np.asarray(logits).argmax(1) == np.asarray(reference).argmax(1)).mean())


def logit_error(logits: Any, reference: Any) -> dict[str, float]:
    """How far ``logits`` are from ``reference`` (FP32): top-1 agreement, and the mean |difference| relative
    to the mean |reference| (the fairer measure for a random-weight model, whose top-1 is a near-tie)."""
    a, r = np.asarray(logits, dtype=np.float32), np.asarray(reference, dtype=np.float32)
    return {"top1_agreement": agreement(a, r),
            "rel_logit_error": float(np.abs(a - r).mean() / max(float(np.abs(r).mean()), 1e-12))}


def random_images(n: int, shape: Sequence[int], seed: int = 0) -> np.ndarray:
    """(n, *shape) float32 standard-normal images: random, not zeros (zeros run faster than real data)."""
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# ONNX export


class OnnxExportError(RuntimeError):
    """The export failed; ``operator`` names the operator that has no ONNX translation (None if unknown)."""

    def __init__(self, message: str, operator: str | None = None):
        super().__init__(message)
        self.operator = operator


_OP_PATTERNS = (
    re.compile(r"OpOverload\(op='([\w.:]+)', overload='(\w+)'\)"),  # torch.export-based exporter
    re.compile(r"target=torch\.ops\.([\w.]+)"),
    re.compile(r"Unsupported FX nodes: \{'call_function': \['([\w.:]+)'"),
    re.compile(r"Exporting the operator '?([\w:.]+)'? to ONNX"),  # TorchScript-based exporter
    re.compile(r"(aten::\w+)"),
)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failed_operator(message: str) -> str | None:
    """The operator an exporter error message blames (``aten._linalg_svd.default``), or None."""
    for pattern in _OP_PATTERNS:
        m = pattern.search(message)
        if m:
            return ".".join(g for g in m.groups() if g)
    return None


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter's informational warnings (torchvision ops it skips, deprecations) are not the lab's news."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch._export", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_onnx(model: Any, path: str | os.PathLike[str], example: Any, *, input_name: str = "input",
                output_name: str = "logits", dynamic_batch: bool = True, opset: int = ONNX_OPSET,
                fold_batchnorm: bool = True, check: bool = True) -> Path:
    """Export ``model`` to ONNX with torch's torch.export-based exporter (``dynamo=True``) and check it.

    The batch dimension is dynamic (named ``batch``, 1..MAX_BATCH) unless ``dynamic_batch=False``. ``example``
    is one input batch (a tensor); a batch of 1 is repeated to 2 because torch.export specialises
    dimensions of size 1. With ``fold_batchnorm`` each BatchNorm is first folded into the convolution before
    it (``torch.fx.experimental.optimization.fuse``; eval-mode arithmetic, the same graph the exporter and
    every inference engine produce, and half the operations for the exporter to trace). The file is checked
    with ``onnx.checker`` (full check, with shape inference).
    A failed export raises ``OnnxExportError`` naming the operator with no ONNX translation.
    """
    torch = _torch()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not hasattr(example, "shape"):
        raise TypeError(f"export_onnx(example=...): pass one input batch as a tensor, got {type(example).__name__}")
    example = torch.as_tensor(example).detach().float().cpu()  # exported on the CPU: the same file from any machine
    original, was_training = model, model.training
    model = _cpu_copy(model)  # in eval mode
    if dynamic_batch and example.shape[0] < 2:
        example = example.expand(2, *example.shape[1:]).contiguous()
    if fold_batchnorm:
        try:
            from torch.fx.experimental.optimization import fuse

            model = fuse(model, inplace=False)
        except Exception:  # a model symbolic tracing cannot follow (data-dependent control flow): export it as is
            pass
    kwargs: dict[str, Any] = {}
    if dynamic_batch:
        kwargs["dynamic_shapes"] = ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},)
    try:
        with _quiet_exporter(), torch.no_grad():
            torch.onnx.export(model, (example,), str(path), input_names=[input_name], output_names=[output_name],
                              opset_version=opset, dynamo=True, verbose=False, **kwargs)
    except ImportError as err:
        raise ImportError(f"ONNX export needs onnx and onnxscript ({err}): pip install onnx onnxscript") from err
    except Exception as err:
        text = _ANSI.sub("", f"{err}\n{err.__cause__ or ''}")
        op = failed_operator(text)
        where = f"operator {op} has no ONNX translation" if op else "the exporter failed"
        said = [re.sub(r"^<class '[\w.]+'>: ", "", ln.strip()) for ln in text.splitlines()
                if "No ONNX function found" in ln or "not supported" in ln]
        said = said or [ln.strip() for ln in text.splitlines() if ln.strip()][:1] or [type(err).__name__]
        raise OnnxExportError(
            f"ONNX export of {type(original).__name__} failed: {where}. Replace it with supported operations, "
            f"register a translation (torch.onnx's custom_translation_table) or, for TensorRT, a plugin. "
            f"The exporter said: {said[0]}", op) from err
    finally:
        original.train(was_training)
    if check:
        check_onnx(path)
    return path


def unsupported_model() -> Any:
    """A small module whose forward uses ``torch.linalg.svd``, which ONNX cannot express (for the export error)."""
    torch = _torch()

    class Whitening(torch.nn.Module):
        """Input (B, n, n) -> the left singular vectors (B, n, n)."""

        def forward(self, x: Any) -> Any:
            return torch.linalg.svd(x)[0]

    return Whitening()


def check_onnx(path: str | os.PathLike[str]) -> None:
    """``onnx.checker.check_model`` with full_check (types and shapes inferred and checked)."""
    import onnx

    onnx.checker.check_model(str(path), full_check=True)


def onnx_io(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Inputs and outputs of an ONNX file: name, kind, element type and shape (symbolic dims by name)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    rows = []
    for kind, values in (("input", model.graph.input), ("output", model.graph.output)):
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            rows.append({"kind": kind, "name": v.name, "dtype": onnx.TensorProto.DataType.Name(t.elem_type).lower(),
                         "shape": tuple(dims)})
    return pd.DataFrame(rows)


def op_counts(model_or_path: Any) -> Counter:
    """Operator types of an ONNX graph (a path or a ModelProto) and how often each occurs.

    Operators outside the standard ONNX domain carry it in brackets: ``FusedConv[microsoft]``, and the
    blocked-layout convolutions of ONNX Runtime's layout level ``Conv[nchwc]``.
    """
    import onnx

    model = model_or_path if hasattr(model_or_path, "graph") else onnx.load(str(model_or_path),
                                                                             load_external_data=False)
    return Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.op_type}[{n.domain.split('.')[-1]}]"
                   for n in model.graph.node)


# --------------------------------------------------------------------------------------------------
# ONNX Runtime


def ort_levels() -> list[str]:
    """The graph optimization levels (keys of ``ORT_LEVELS``) this onnxruntime has, weakest first."""
    import onnxruntime as ort

    return [k for k, v in ORT_LEVELS.items() if hasattr(ort.GraphOptimizationLevel, v)]


def ort_session(path: str | os.PathLike[str], level: str = "all", threads: int | None = None,
                optimized_path: str | os.PathLike[str] | None = None) -> Any:
    """An ONNX Runtime session on the CPU provider at graph optimization ``level``.

    ``threads``: intra-op threads (default: torch's thread count, so both frameworks get the same cores).
    ``optimized_path``: where ONNX Runtime writes the graph it will run (to count what it fused).
    """
    import onnxruntime as ort

    if level not in ORT_LEVELS:
        raise ValueError(f"ort_session(level={level!r}): use one of {list(ORT_LEVELS)}")
    if not hasattr(ort.GraphOptimizationLevel, ORT_LEVELS[level]):
        raise ValueError(f"ort_session(level={level!r}): this onnxruntime {ort.__version__} has no "
                         f"{ORT_LEVELS[level]}; available: {ort_levels()}")
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, ORT_LEVELS[level])
    so.intra_op_num_threads = threads or _torch_threads()
    so.log_severity_level = 3  # errors only: the NCHWc "hardware specific" notice is expected here
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    # ONNX Runtime's ReluQuantRewrite (level "extended" and up) deletes a Relu that feeds a QuantizeLinear,
    # valid only where the quantized type cannot hold negatives; FP8 can, so on an FP8 Q/DQ model it lets
    # negative activations through and the logits go wrong (relative error ~1 instead of ~0.01).
    disabled = list(ORT_FP8_UNSAFE_REWRITES) if level != "disable" and has_fp8_qdq(path) else None
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)


def has_fp8_qdq(path: str | os.PathLike[str]) -> bool:
    """Whether an ONNX file quantizes to an FP8 type (a QuantizeLinear with a float8 zero point)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    fp8 = {t for t in (getattr(onnx.TensorProto, n, None) for n in
                       ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ")) if t is not None}
    inits = {i.name: i.data_type for i in model.graph.initializer}
    return any(n.op_type == "QuantizeLinear" and len(n.input) > 2 and inits.get(n.input[2]) in fp8
               for n in model.graph.node)


def cpu_threads() -> int:
    """Threads for CPU inference in the lab: half the cores this process may use (at least 1).

    Leaves room for the notebook, the OS and ONNX Runtime's own scheduling; on a busy 2-core machine a
    second spinning OpenMP thread costs far more than it brings.
    """
    return max(1, cpu_cores() // 2)


def _torch_threads() -> int:
    try:
        return _torch().get_num_threads()
    except ImportError:
        return os.cpu_count() or 1


_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def ort_predict(session: Any, x: Any, batch_size: int | None = None) -> np.ndarray:
    """Run ``session`` on ``x`` (numpy or torch, cast to the input's type), in batches of ``batch_size``."""
    inp = session.get_inputs()[0]
    x = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
    x = x.astype(_NP_TYPES.get(inp.type, np.float32), copy=False)
    chunks = [x] if batch_size is None else [x[i:i + batch_size] for i in range(0, len(x), batch_size)]
    outs = [session.run(None, {inp.name: c})[0] for c in chunks]
    return np.concatenate(outs).astype(np.float32)


def parity(model: Any, onnx_path: str | os.PathLike[str], inputs: Sequence[Any]) -> pd.DataFrame:
    """Largest absolute difference between PyTorch (fp32, CPU) and ONNX Runtime outputs, per input batch.

    Several batch sizes prove the dynamic batch dimension: one export, any batch.
    """
    torch = _torch()
    session = ort_session(onnx_path, "all")
    rows = []
    cpu_model = _cpu_copy(model)
    for x in inputs:
        xt = torch.as_tensor(x, dtype=torch.float32)
        with torch.no_grad():
            ref = cpu_model(xt).numpy()
        out = ort_predict(session, xt)
        rows.append({"batch": int(xt.shape[0]), "output_shape": tuple(out.shape),
                     "max_abs_diff": float(np.abs(out - ref).max()),
                     "max_abs_output": float(np.abs(ref).max()), "top1_agreement": agreement(out, ref)})
    return pd.DataFrame(rows)


def _cpu_copy(model: Any) -> Any:
    """The model in eval mode, FP32 on the CPU: itself when it already is, else a copy."""
    p = next(model.parameters(), None)
    if p is None or (p.device.type == "cpu" and p.dtype == _torch().float32):
        return model.eval()
    import copy

    return copy.deepcopy(model).float().cpu().eval()


def fusion_table(onnx_path: str | os.PathLike[str], workdir: str | os.PathLike[str], example: Any,
                 levels: Sequence[str] | None = None, reps: int = 10, warmup: int = 2,
                 threads: int | None = None) -> pd.DataFrame:
    """What each ONNX Runtime optimization level leaves of the graph, and what it costs to run.

    Per level: the number of nodes ONNX Runtime will execute, the fused operators among them (FusedConv,
    NCHWc Conv...), the most common operators, session creation time, and the p50 latency of ``example``
    (a batch) with the course's timing helper.
    """
    from lab_utils.timing import benchmark

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    x = np.asarray(example, dtype=np.float32)
    rows = []
    for level in levels or ort_levels():
        opt_path = workdir / f"{Path(onnx_path).stem}.ort-{level}.onnx"
        t0 = time.perf_counter()
        session = ort_session(onnx_path, level, threads=threads, optimized_path=opt_path)
        create_s = time.perf_counter() - t0
        counts = op_counts(opt_path)
        opt_path.unlink()  # only counted: a full ResNet-50 would leave 100 MB per level behind
        name = session.get_inputs()[0].name
        t = benchmark(lambda s=session, n=name: s.run(None, {n: x}), reps=reps, warmup=warmup, device="cpu",
                      name=f"ort-{level}")
        fused = {k: v for k, v in counts.items() if "[" in k}  # ONNX Runtime's own fused and layout operators
        rows.append({"level": level, "nodes": sum(counts.values()),
                     "conv_nodes": sum(v for k, v in counts.items() if k.split("[")[0] in ("Conv", "FusedConv")),
                     "fused": ", ".join(f"{k} {v}" for k, v in sorted(fused.items())),
                     "top_ops": ", ".join(f"{k} {v}" for k, v in counts.most_common(4)),
                     "session_s": create_s, "batch": int(x.shape[0]), "p50_ms": t.median_ms,
                     "images_per_s": x.shape[0] / (t.median_ms / 1e3)})
    df = pd.DataFrame(rows)
    df["speedup_vs_disable"] = df["p50_ms"].iloc[0] / df["p50_ms"]
    return df


# --------------------------------------------------------------------------------------------------
# torch backends: the substitutes for TensorRT on a GPU (eager -> autocast -> compile -> CUDA graphs)


def set_fp32_semantics(device: str) -> str:
    """Make "FP32" mean IEEE FP32 on this device: TF32 off for matmuls and convolutions; cuDNN autotuning on.

    Returns a sentence saying what FP32 means here. Set explicitly because the defaults differ between
    torch versions and NGC images (NVIDIA's containers enable TF32 for convolutions by default).
    """
    torch = _torch()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if str(device).startswith("cuda"):
        torch.backends.cudnn.benchmark = True  # cuDNN times its algorithms per shape: TensorRT's tactic choice
        return ("FP32 = IEEE single precision, TF32 off (torch.backends.cudnn.allow_tf32 = False, matmul precision "
                "'highest'); cudnn.benchmark = True, so eager also gets the fastest cuDNN algorithm per shape")
    return "FP32 = IEEE single precision (the CPU has no TF32)"


@dataclass
class TorchRunner:
    """One torch backend, ready to run one batch: ``runner()`` returns the output (on the device)."""

    name: str  # "eager", "autocast", "compile", "cuda-graph"
    precision: str  # "fp32", "bf16", "fp16"
    batch: int
    fn: Callable[[], Any]
    setup_s: float = 0.0  # compile or capture time paid before the first timed call
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> Any:
        return self.fn()


def _amp_dtype(amp: str) -> Any:
    torch = _torch()
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp={amp!r}: use one of {AMP_DTYPES}")
    return torch.bfloat16 if amp == "bf16" else torch.float16


def _no_cudagraph_mode(mode: str) -> str:
    """torch.compile's mode without inductor's own CUDA graphs (the lab captures them itself, step 4)."""
    return {"max-autotune": "max-autotune-no-cudagraphs", "reduce-overhead": "default"}.get(mode, mode)


def torch_runners(model: Any, x: Any, *, steps: Sequence[str] = ("eager", "autocast", "compile", "cuda-graph"),
                  amp: str = "bf16", compile_mode: str = "max-autotune", channels_last: bool = True,
                  autotune_convs: bool = False) -> Iterator[TorchRunner]:
    """The substitute chain on one batch ``x``, one step at a time, each adding one thing:

    1. ``eager``: the model as trained, FP32 (see ``set_fp32_semantics``);
    2. ``autocast``: ``torch.autocast`` in ``amp`` (bf16 or fp16) and channels_last memory (tensor cores);
    3. ``compile``: ``torch.compile`` of step 2 in ``compile_mode`` without CUDA graphs: Inductor fuses
       element-wise work into the convolutions' neighbours and, with max-autotune, times kernel choices;
    4. ``cuda-graph``: step 3 captured once in a CUDA graph and replayed: one launch per batch instead of
       hundreds. ``max-autotune`` is steps 3 + 4 (Inductor's own CUDA graphs); here you see each half.

    A generator, so each step is built (compiled, captured) only when the caller gets to it. Steps 2-4 need
    a GPU; on a CPU only ``eager`` is offered. ``autotune_convs=False`` leaves convolutions to cuDNN (timed by
    cudnn.benchmark) while max-autotune tunes the matmuls and fusions: Triton's convolution templates rarely
    beat cuDNN on ResNet-50 and autotuning them costs minutes.
    """
    torch = _torch()
    device = next(model.parameters()).device
    x = torch.as_tensor(x).to(device)
    gpu = device.type == "cuda"
    unknown = set(steps) - {"eager", "autocast", "compile", "cuda-graph"}
    if unknown:
        raise ValueError(f"torch_runners(steps=...): unknown steps {sorted(unknown)}")
    batch = int(x.shape[0])

    if "eager" in steps:
        def eager() -> Any:
            with torch.inference_mode():
                return model(x)

        yield TorchRunner("eager", "fp32", batch, eager)
    if not gpu:
        return
    dtype = _amp_dtype(amp)
    import copy

    # A copy: .to(memory_format=...) converts a module in place, and the caller's eager model stays NCHW.
    model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last) if channels_last else model
    x_cl = x.contiguous(memory_format=torch.channels_last) if channels_last else x

    def forward(inp: Any) -> Any:
        with torch.autocast("cuda", dtype=dtype):
            return model_cl(inp)

    if "autocast" in steps:
        def autocast() -> Any:
            with torch.inference_mode():
                return forward(x_cl)

        yield TorchRunner("autocast", amp, batch, autocast, note="channels_last" if channels_last else "")
    if "compile" not in steps and "cuda-graph" not in steps:
        return
    mode = _no_cudagraph_mode(compile_mode)
    compiled = torch.compile(forward, mode=mode, dynamic=False)
    kernels_before = _inductor_kernel_count()
    t0 = time.perf_counter()
    from torch._inductor import config as inductor_config

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

    def run_compiled() -> Any:
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


@contextlib.contextmanager
def quiet_autotuning(summary: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Silence Inductor's max-autotune reports while compiling and collect them in ``summary`` instead.

    Inductor otherwise writes, for every matrix multiplication it tunes, a table of candidate kernels and a
    JSON line of statistics, and logs an error for each candidate that cannot run. ``summary`` gets:
    ``gemms`` (operations tuned), ``choices`` (candidates timed), ``skipped`` (candidates that could not run,
    mostly Triton configurations needing more shared memory than an SM has), ``biggest`` (the largest
    GEMM: its shapes, the winning kernel, its time in ms, and cuBLAS's time in ms).
    The reports are turned off through Inductor's own settings; the failures are filtered from its logger.
    Nothing here changes which kernels are tried or chosen.
    """
    summary.update(gemms=0, choices=0, skipped=0, biggest=None)
    patches: dict[str, Any] = {}
    stack = contextlib.ExitStack()
    try:
        from torch._inductor import config as inductor_config

        patches = {k: v for k, v in (("max_autotune_report_choices_stats", False),
                                     ("autotune_num_choices_displayed", 0)) if hasattr(inductor_config, k)}
        stack.enter_context(inductor_config.patch(patches))
    except Exception:  # private settings: a torch without them prints its reports, and the lab still runs
        pass

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
    try:
        from torch._inductor.select_algorithm import AlgorithmSelectorCache

        original = AlgorithmSelectorCache.__dict__.get("log_results")
        if isinstance(original, staticmethod):
            inner = original.__func__

            def log_results(*args: Any, **kwargs: Any) -> Any:
                try:
                    named = dict(zip(("name", "input_nodes", "timings"), args, strict=False)) | kwargs
                    _note_autotuning(summary, named["name"], named["input_nodes"], named["timings"])
                except Exception:  # the summary is a courtesy: never let it break a compile
                    pass
                return inner(*args, **kwargs)

            AlgorithmSelectorCache.log_results = staticmethod(log_results)  # type: ignore[method-assign]
            restore = (AlgorithmSelectorCache, original)
    except Exception:
        pass
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
    finite = {c: t for c, t in timings.items() if t is not None and math.isfinite(t)}
    if not finite:
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
    line = (f"max-autotune timed {summary['choices']} candidate kernels for {summary['gemms']} matrix "
            f"multiplications")
    if summary.get("skipped"):
        line += (f" ({summary['skipped']} candidates skipped: Triton configurations needing more shared memory "
                 "than an SM has, normal and harmless)")
    big = summary.get("biggest")
    if big:
        cublas = f", cuBLAS {big['cublas_ms']:.4f} ms" if big.get("cublas_ms") is not None else ""
        line += f"; the biggest, {big['op']}, went to {big['kernel']} ({big['best_ms']:.4f} ms{cublas})"
    return line


def _cuda_graph_runner(run: Callable[[], Any], static_x: Any, amp: str, batch: int, mode: str) -> TorchRunner:
    """Capture ``run`` (which reads ``static_x``) in a CUDA graph; replays reuse the same input and output memory."""
    torch = _torch()
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    torch.cuda.synchronize()

    def replay() -> Any:
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


def time_ort(session: Any, x: np.ndarray, reps: int = 10, warmup: int = 2, name: str = "onnxruntime") -> Any:
    """Time ``session.run`` on the batch ``x`` (cast to the input's type once, outside the timed loop)."""
    from lab_utils.timing import benchmark

    inp = session.get_inputs()[0]
    feed = {inp.name: np.asarray(x).astype(_NP_TYPES.get(inp.type, np.float32), copy=False)}
    return benchmark(lambda: session.run(None, feed), reps=reps, warmup=warmup, device="cpu", name=name)


def time_torch(runner: Callable[[], Any], device: str, reps: int = 10, warmup: int = 2, name: str = "torch") -> Any:
    """Time a torch runner (CUDA events on a GPU, the host clock on a CPU)."""
    from lab_utils.timing import benchmark

    return benchmark(runner, reps=reps, warmup=warmup, device="cuda" if str(device).startswith("cuda") else "cpu",
                     name=name)


# --------------------------------------------------------------------------------------------------
# The comparison


COMPARISON_COLUMNS = ["model", "backend", "precision", "batch", "p50_ms", "p90_ms", "images_per_s",
                      "accuracy", "accuracy_delta_points", "top1_agreement", "rel_logit_error", "device", "note"]


class Comparison:
    """Rows of backend x precision x batch -> p50 latency, throughput and accuracy change against FP32.

    ``add`` one measurement at a time from any section of the lab; ``frame()`` is the table.
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._fp32_accuracy: dict[str, float] = {}

    def set_reference(self, model: str, fp32_accuracy: float) -> None:
        """The FP32 accuracy of ``model`` that accuracy changes are measured against."""
        self._fp32_accuracy[model] = float(fp32_accuracy)

    def add(self, model: str, backend: str, precision: str, batch: int, timing: Any = None, *,
            p50_ms: float | None = None, p90_ms: float | None = None, accuracy: float | None = None,
            top1_agreement: float | None = None, rel_logit_error: float | None = None, device: str = "",
            note: str = "") -> dict[str, Any]:
        """One row; ``timing`` is a ``lab_utils.timing.Timing`` (or pass ``p50_ms`` directly)."""
        check_int(batch, "batch", "Comparison.add")
        if timing is not None:
            p50_ms, p90_ms, device = timing.median_ms, timing.p90_ms, device or timing.device
        ref = self._fp32_accuracy.get(model)
        row = {"model": model, "backend": backend, "precision": precision, "batch": int(batch),
               "p50_ms": p50_ms, "p90_ms": p90_ms,
               "images_per_s": batch / (p50_ms / 1e3) if p50_ms else None,
               "accuracy": accuracy,
               "accuracy_delta_points": (accuracy - ref) * 100 if accuracy is not None and ref is not None else None,
               "top1_agreement": top1_agreement, "rel_logit_error": rel_logit_error, "device": device, "note": note}
        self.rows.append(row)
        return row

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame(self.rows, columns=COMPARISON_COLUMNS)
        return df.astype({"batch": int}) if len(df) else df

    def throughput(self, model: str, backend: str, precision: str, batch: int) -> float:
        """images/s of one row (NaN when that row was not measured)."""
        df = self.frame()
        hit = df[(df["model"] == model) & (df["backend"] == backend) & (df["precision"] == precision)
                 & (df["batch"] == batch)]
        return float(hit["images_per_s"].iloc[-1]) if len(hit) else math.nan


def plot_comparison(df: pd.DataFrame, model: str | None = None, ax: Any = None, title: str | None = None) -> Any:
    """Throughput (images/s) against batch size, one line per backend + precision, for one model.

    Input: ``Comparison.frame()``. Log-log axes; rows without a latency are skipped.
    """
    if not isinstance(df, pd.DataFrame) or not {"model", "backend", "precision", "batch", "images_per_s"} <= set(df):
        raise ValueError("plot_comparison(df=...): pass Comparison.frame()")
    model = model or str(df["model"].iloc[0])
    rows = df[(df["model"] == model) & df["images_per_s"].notna()]
    if ax is None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.0, 4.5))
    else:
        fig = ax.figure
    for (backend, precision), group in rows.groupby(["backend", "precision"], sort=False):
        group = group.sort_values("batch")
        ax.plot(group["batch"], group["images_per_s"], marker="o", label=f"{backend} {precision}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted(rows["batch"].unique())
    if sizes:
        ax.set_xticks(sizes, [str(int(b)) for b in sizes])
        ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("images/s (at the p50 latency)")
    ax.set_title(title or f"{model}: throughput by backend and precision")
    ax.grid(True, which="both", alpha=0.3)
    if len(rows):
        ax.legend(fontsize="small")
    return fig


def largest_batch_within(latency_ms: dict[int, float], budget_ms: float) -> int | None:
    """The largest batch whose p50 latency fits ``budget_ms`` (None when even the smallest does not)."""
    fits = [b for b, ms in latency_ms.items() if ms <= budget_ms]
    return max(fits) if fits else None
