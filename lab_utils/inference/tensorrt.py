"""Lab 03 TensorRT: strongly typed engines from ONNX files, optimization profiles, a timing cache, engine
files, execution from torch tensors on a CUDA stream, and the equivalent ``trtexec`` command lines.

Works on TensorRT 10.x and 11.x with the same calls; precision comes from the ONNX graph
(``lab_utils.inference.quantize``), never from builder flags. The module imports on machines without TensorRT;
``tensorrt_status`` says whether it can run here and why.

Design notes: docs/internals.md#lab_utilsinferencetensorrtpy"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lab_utils.course.probe import find_trtexec, tensorrt_runtime_present
from lab_utils.timing import benchmark

if TYPE_CHECKING:
    import tensorrt as trt

# Default builder workspace: ample for the lab's models; TensorRT uses less when tactics need less.
WORKSPACE_BYTES = 1 << 30

# The newest TensorRT major version, for command lines printed where no TensorRT is installed.
LATEST_MAJOR = 11

_INSTALL_HINT = ("On a GPU machine with internet access `pip install tensorrt-cu13` (or tensorrt-cu12, matching "
                 "torch's CUDA major; `./course setup` does it when nvidia-smi finds a GPU) fetches the real "
                 "libraries; or use an NGC container (nvcr.io/nvidia/pytorch or nvcr.io/nvidia/tensorrt), which "
                 "ships TensorRT")


class TensorRTUnavailable(RuntimeError):
    """TensorRT cannot run here; the message says why and what would make it run."""


class EngineBuildError(RuntimeError):
    """The ONNX file did not parse or the engine did not build; the message carries TensorRT's errors."""


class EngineLoadError(RuntimeError):
    """A serialized engine did not deserialize: it must be rebuilt for this TensorRT version and GPU."""


# --- Is TensorRT here? ----------------------------------------------------------------------------


def tensorrt_status() -> tuple[bool, str]:
    """(usable, why): the real TensorRT runtime imports and a CUDA GPU is usable by torch."""
    if not tensorrt_runtime_present():
        return False, ("the TensorRT runtime is not installed (the `tensorrt` Python package with its libraries; "
                       "a stub-only package for type checking does not count)")
    try:
        import tensorrt as trt_mod
    except (ImportError, OSError) as err:  # a wheel whose libnvinfer does not load
        return False, f"`import tensorrt` failed: {err}"
    if not torch.cuda.is_available():
        return False, f"TensorRT {trt_mod.__version__} is installed but no CUDA GPU is usable by torch"
    return True, f"TensorRT {trt_mod.__version__} on {torch.cuda.get_device_name()}"


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, or ``TensorRTUnavailable`` saying why not and how to get it."""
    ok, why = tensorrt_status()
    if not ok:
        raise TensorRTUnavailable(f"TensorRT cannot run here: {why}. {_INSTALL_HINT}.")
    import tensorrt as trt_mod

    return trt_mod


def tensorrt_major() -> int | None:
    """TensorRT's major version (10, 11), or None without the runtime."""
    ok, _ = tensorrt_status()
    return int(str(import_tensorrt().__version__).split(".")[0]) if ok else None


# --- Optimization profiles ------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """An optimization profile for one input: shapes the engine accepts (min..max) and the one it is tuned for.

    TensorRT picks kernels for ``opt_shape``; any shape between ``min_shape`` and ``max_shape`` (each
    dimension) runs, others are refused at ``set_input_shape``."""

    input_name: str
    min_shape: tuple[int, ...]
    opt_shape: tuple[int, ...]
    max_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shapes = (self.min_shape, self.opt_shape, self.max_shape)
        if len({len(s) for s in shapes}) != 1:
            raise ValueError(f"Profile({self.input_name!r}): min/opt/max must have the same rank, got {shapes}")
        for lo, mid, hi in zip(*shapes, strict=True):
            if not 1 <= lo <= mid <= hi:
                raise ValueError(f"Profile({self.input_name!r}): need 1 <= min <= opt <= max in every dimension, "
                                 f"got min {self.min_shape}, opt {self.opt_shape}, max {self.max_shape}")

    def accepts(self, shape: Sequence[int]) -> bool:
        """True when an input of ``shape`` runs on an engine built with this profile."""
        return len(shape) == len(self.min_shape) and all(
            lo <= d <= hi for lo, d, hi in zip(self.min_shape, shape, self.max_shape, strict=True))

    def shapes_flag(self, which: str) -> str:
        """``input:1x3x224x224`` for trtexec's --minShapes/--optShapes/--maxShapes."""
        shape = {"min": self.min_shape, "opt": self.opt_shape, "max": self.max_shape}[which]
        return f"{self.input_name}:{'x'.join(map(str, shape))}"


def batch_profile(input_name: str, sample_shape: Sequence[int], min_batch: int = 1, opt_batch: int = 32,
                  max_batch: int = 128) -> Profile:
    """A profile over the batch dimension only: ``(batch, *sample_shape)`` with batch in min..max."""
    sample = tuple(int(d) for d in sample_shape)
    return Profile(input_name, (min_batch, *sample), (opt_batch, *sample), (max_batch, *sample))


# --- trtexec --------------------------------------------------------------------------------------


def trtexec_commands(onnx_path: str | os.PathLike[str], engine_path: str | os.PathLike[str], profile: Profile,
                     timing_cache: str | os.PathLike[str] | None = None,
                     workspace_bytes: int = WORKSPACE_BYTES, run_batch: int | None = None,
                     trtexec: str | os.PathLike[str] | None = None, major: int | None = None) -> dict[str, str]:
    """The ``trtexec`` lines that do what ``build_plan`` and the benchmark do (build, then time the engine).

    ``major``: the TensorRT major version (default: this machine's, else ``LATEST_MAJOR``): 10 gets ``--stronglyTyped
    --useCudaGraph --noDataTransfers``, which 11 deprecates. trtexec reports GPU compute time without the last two;
    they change what is timed (no host<->device copies, the engine launched as one CUDA graph), to time the engine
    alone as the course's benchmark does. ``trtexec``: the program to name (default: what
    ``lab_utils.course.probe.find_trtexec`` finds here, also off the PATH)."""
    major = major if major is not None else (tensorrt_major() or LATEST_MAJOR)
    legacy = major < 11
    if trtexec is None:  # plain `trtexec` when the PATH finds it (or nothing does: lines for another machine)
        trtexec = "trtexec" if shutil.which("trtexec") else find_trtexec() or "trtexec"
    program = str(trtexec)
    build = [program, f"--onnx={onnx_path}", f"--saveEngine={engine_path}", *(["--stronglyTyped"] if legacy else []),
             f"--minShapes={profile.shapes_flag('min')}", f"--optShapes={profile.shapes_flag('opt')}",
             f"--maxShapes={profile.shapes_flag('max')}", f"--memPoolSize=workspace:{workspace_bytes // 2**20}M"]
    if timing_cache is not None:
        build.append(f"--timingCacheFile={timing_cache}")
    batch = profile.opt_shape[0] if run_batch is None else run_batch
    shape = (batch, *profile.opt_shape[1:])
    if not profile.accepts(shape):
        raise ValueError(f"trtexec_commands(run_batch={run_batch}): shape {shape} is outside the profile "
                         f"{profile.min_shape}..{profile.max_shape}")
    run = [program, f"--loadEngine={engine_path}", f"--shapes={profile.input_name}:{'x'.join(map(str, shape))}",
           *(["--useCudaGraph", "--noDataTransfers"] if legacy else []), "--warmUp=500", "--duration=10"]
    return {"build": shlex.join(build), "run": shlex.join(run)}


# --- Build, save, load ----------------------------------------------------------------------------


@dataclass
class BuildResult:
    """A serialized engine and what it took to build it."""

    plan: bytes
    build_s: float
    profile: Profile
    onnx_path: str
    timing_cache_path: str | None = None
    timing_cache_reused: bool = False  # a cache file existed before this build and fitted this TensorRT and GPU
    tensorrt_version: str = ""
    timing_cache_note: str = ""  # what happened to the cache when it was not simply read and written


def _network_flags(trt_mod: Any) -> int:
    """Strongly typed: required on 10.x; on 11.x every network is, and the flag is accepted or absent."""
    flag = getattr(trt_mod.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(flag) if flag is not None else 0


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "unknown"


def timing_cache_file(folder: str | os.PathLike[str], version: str | None = None, gpu: str | None = None) -> Path:
    """Where to keep the timing cache of one TensorRT version on one GPU model: ``timing-trt10.14.1-NVIDIA-H200.cache``.

    A cache holds kernel timings of one GPU measured by one TensorRT; named after both, a cache never meets
    another GPU or TensorRT (which would refuse it, see ``build_plan``). ``version``/``gpu`` default to this
    machine's TensorRT and GPU."""
    if version is None:
        ok, _ = tensorrt_status()
        version = str(import_tensorrt().__version__) if ok else "unknown"
    if gpu is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no-gpu"
    return Path(folder) / f"timing-trt{_slug(version)}-{_slug(gpu)}.cache"


def _attach_timing_cache(trt_mod: Any, config: trt.IBuilderConfig, cache_path: Path) -> tuple[bool, str]:
    """Give ``config`` the timing cache in ``cache_path`` (created empty when there is none); returns (whether
    the file's timings are used, a note when they are not).

    ``set_timing_cache(cache, ignore_mismatch=False)`` returns False for a cache written by another GPU or
    TensorRT version; such a cache (or a damaged file) is replaced by a fresh one, which the build then fills."""
    note = ""
    if data := (cache_path.read_bytes() if cache_path.exists() else b""):
        try:
            cache: trt.ITimingCache | None = config.create_timing_cache(data)
        except Exception:  # a damaged file: some versions raise, others return None
            cache = None
        if cache is not None and config.set_timing_cache(cache, False):
            return True, ""
        note = (f"the timing cache {cache_path.name} does not fit TensorRT {trt_mod.__version__} on this GPU (another "
                "GPU or TensorRT wrote it, or it is damaged): started a new one")
    fresh = config.create_timing_cache(b"")
    if fresh is None or not config.set_timing_cache(fresh, False):
        raise EngineBuildError(f"TensorRT {trt_mod.__version__} could not attach an empty timing cache")
    return False, note


def _save_timing_cache(config: trt.IBuilderConfig, cache_path: Path) -> str:
    """Write the config's timing cache to ``cache_path`` (atomically); a note when there is none to write."""
    if (cache := config.get_timing_cache()) is None:  # documented: None when the config holds no cache
        return f"the builder returned no timing cache, so {cache_path.name} was not written"
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_name(cache_path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(bytes(cache.serialize()))
    tmp.replace(cache_path)
    return ""


def build_plan(onnx_path: str | os.PathLike[str], profile: Profile,
               timing_cache_path: str | os.PathLike[str] | None = None,
               workspace_bytes: int = WORKSPACE_BYTES, verbose: bool = False) -> BuildResult:
    """Parse ``onnx_path`` into a strongly typed network and build a serialized engine for ``profile``.

    Precision is what the ONNX graph says (FP32, AutoCast FP16, INT8/FP8 Q/DQ). The timing cache, when a
    path is given (``timing_cache_file`` names one per TensorRT version and GPU), is read before and written
    after the build: a rebuild on the same GPU and TensorRT skips re-timing the kernels it has already timed.
    A cache that does not fit this GPU and TensorRT is replaced, and ``timing_cache_note`` says so."""
    trt_mod = import_tensorrt()
    logger = trt_mod.Logger(trt_mod.Logger.VERBOSE if verbose else trt_mod.Logger.WARNING)
    builder: trt.Builder = trt_mod.Builder(logger)
    network: trt.INetworkDefinition = builder.create_network(_network_flags(trt_mod))
    parser: trt.OnnxParser = trt_mod.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT {trt_mod.__version__} could not parse {onnx_path}: {errors}")
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    if profile.input_name not in names:
        raise EngineBuildError(f"the profile is for input {profile.input_name!r}, but {onnx_path} has inputs {names}")
    config: trt.IBuilderConfig = builder.create_builder_config()
    config.set_memory_pool_limit(trt_mod.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    opt_profile: trt.IOptimizationProfile = builder.create_optimization_profile()
    opt_profile.set_shape(profile.input_name, trt_mod.Dims(list(profile.min_shape)),
                          trt_mod.Dims(list(profile.opt_shape)), trt_mod.Dims(list(profile.max_shape)))
    config.add_optimization_profile(opt_profile)
    cache_path = Path(timing_cache_path) if timing_cache_path is not None else None
    reused, notes = False, []
    if cache_path is not None:
        reused, note = _attach_timing_cache(trt_mod, config, cache_path)
        notes.append(note)
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    build_s = time.perf_counter() - t0
    if plan is None:
        raise EngineBuildError(f"TensorRT {trt_mod.__version__} failed to build an engine from {onnx_path} "
                               "(its log above says which layer); check the profile and the workspace size")
    if cache_path is not None:
        notes.append(_save_timing_cache(config, cache_path))
    return BuildResult(bytes(plan), build_s, profile, str(onnx_path), str(cache_path) if cache_path else None,
                       reused, str(trt_mod.__version__), "; ".join(n for n in notes if n))


def save_engine(result: BuildResult, path: str | os.PathLike[str]) -> Path:
    """Write the serialized engine (a "plan" file) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(result.plan)
    return path


@dataclass
class LoadedEngine:
    """A deserialized engine with the runtime that owns it (the runtime must outlive the engine)."""

    engine: trt.ICudaEngine
    runtime: trt.Runtime
    source: str


def load_engine(plan: bytes | str | os.PathLike[str]) -> LoadedEngine:
    """Deserialize an engine from a plan file (or its bytes).

    An engine runs only on the TensorRT version and the GPU model it was built for; any other gives
    ``EngineLoadError`` telling to rebuild it from its ONNX file."""
    trt_mod = import_tensorrt()
    source = "engine bytes" if isinstance(plan, bytes) else str(plan)
    data = plan if isinstance(plan, bytes) else Path(plan).read_bytes()
    logger = trt_mod.Logger(trt_mod.Logger.ERROR)
    runtime: trt.Runtime = trt_mod.Runtime(logger)
    why = ""
    try:
        engine = runtime.deserialize_cuda_engine(data)
    except Exception as err:  # some versions raise instead of returning None
        engine, why = None, f" ({type(err).__name__}: {err})"
    if engine is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        raise EngineLoadError(
            f"{source} did not deserialize with TensorRT {trt_mod.__version__} on {gpu}{why}. A TensorRT engine is "
            "tied to the TensorRT version and the GPU model that built it (or the file is damaged): rebuild it "
            "from the ONNX file with build_plan(...) or `trtexec --onnx=... --saveEngine=...` on this machine.")
    return LoadedEngine(engine, runtime, source)


# --- Run ------------------------------------------------------------------------------------------


def _dims(d: trt.Dims) -> tuple[int, ...]:
    """A TensorRT Dims as a tuple of ints (-1 for a dynamic dimension)."""
    return tuple(int(d[i]) for i in range(len(d)))


def torch_dtype(dtype: trt.DataType) -> torch.dtype:
    """The torch dtype of a TensorRT tensor type."""
    table = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT8": torch.int8,
             "INT32": torch.int32, "INT64": torch.int64, "BOOL": torch.bool, "UINT8": torch.uint8,
             "FP8": torch.float8_e4m3fn}
    if dtype.name not in table:
        raise TypeError(f"TensorRT type {dtype.name} has no torch equivalent here")
    return table[dtype.name]


def engine_io(loaded: LoadedEngine) -> list[dict[str, Any]]:
    """Each I/O tensor of the engine: name, input or output, type, shape (-1 = dynamic) and, for inputs,
    the profile's min/opt/max shapes."""
    trt_mod = import_tensorrt()
    engine = loaded.engine
    rows: list[dict[str, Any]] = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt_mod.TensorIOMode.INPUT
        row: dict[str, Any] = {"name": name, "mode": "input" if is_input else "output",
                               "dtype": engine.get_tensor_dtype(name).name,
                               "shape": _dims(engine.get_tensor_shape(name))}
        if is_input:
            lo, opt, hi = engine.get_tensor_profile_shape(name, 0)
            row.update(min=_dims(lo), opt=_dims(opt), max=_dims(hi))
        rows.append(row)
    return rows


@dataclass
class TrtRunner:
    """Runs one engine from torch tensors on its own CUDA stream.

    ``bind(x)`` sets the input shape and the device addresses of the input and of freshly allocated outputs
    (returned); ``run()`` enqueues one execution with ``execute_async_v3``; ``infer(x)`` does both and
    waits. Benchmarks call ``bind`` once and time ``run``: no allocation in the timed loop."""

    loaded: LoadedEngine
    context: trt.IExecutionContext = field(init=False)
    stream: torch.cuda.Stream = field(init=False)
    input_name: str = field(init=False)
    output_names: list[str] = field(init=False)
    _bound: dict[str, Any] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        trt_mod = import_tensorrt()
        engine = self.loaded.engine
        self.context = engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt_mod.TensorIOMode.INPUT]
        if len(inputs) != 1:
            raise ValueError(f"TrtRunner handles engines with one input; this one has {inputs}")
        self.input_name = inputs[0]
        self.output_names = [n for n in names if n not in inputs]
        self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call,unused-ignore]  # torch leaves it unannotated

    def bind(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Set the input shape and all tensor addresses for ``x``; returns the output tensors ``run`` fills."""
        engine = self.loaded.engine
        want = torch_dtype(engine.get_tensor_dtype(self.input_name))
        x = x.to(device="cuda", dtype=want).contiguous()
        if not self.context.set_input_shape(self.input_name, tuple(x.shape)):
            lo, opt, hi = engine.get_tensor_profile_shape(self.input_name, 0)
            raise ValueError(f"input shape {tuple(x.shape)} is outside the engine's optimization profile "
                             f"(min {_dims(lo)}, opt {_dims(opt)}, max {_dims(hi)}): rebuild with a wider profile")
        outputs: dict[str, torch.Tensor] = {}
        for name in self.output_names:
            shape = _dims(self.context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=torch_dtype(engine.get_tensor_dtype(name)), device="cuda")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        self.context.set_tensor_address(self.input_name, x.data_ptr())
        self._bound = {"input": x, **outputs}  # keeps the memory alive as long as the addresses are set
        return outputs

    def run(self) -> None:
        """Enqueue one execution on the runner's stream, ordered after the current stream's work and before
        whatever the current stream does next (so CUDA events on the current stream time it correctly)."""
        if not self._bound:
            raise RuntimeError("TrtRunner.run(): call bind(x) first")
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("execute_async_v3 returned False: see TensorRT's log above")
        current.wait_stream(self.stream)

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """Run ``x`` through the engine and return the (first) output, after the stream has finished."""
        outputs = self.bind(x)
        self.run()
        self.stream.synchronize()
        return outputs[self.output_names[0]]


def time_engine(runner: TrtRunner, sample_shape: Sequence[int], batches: Sequence[int], reps: int = 50,
                warmup: int = 10, seed: int = 0) -> list[dict[str, Any]]:
    """p50/p90 latency (ms, GPU time between CUDA events) and images/s of ``runner`` at each batch size.

    Random inputs (not zeros), bound once per batch size; only ``execute_async_v3`` is timed."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows: list[dict[str, Any]] = []
    for batch in batches:
        x = torch.randn((int(batch), *sample_shape), generator=gen)
        runner.bind(x)
        t = benchmark(runner.run, reps=reps, warmup=warmup, device="cuda", name=f"trt-b{batch}")
        rows.append({"batch": int(batch), "p50_ms": t.median_ms, "p90_ms": t.p90_ms,
                     "images_per_s": batch / (t.median_ms / 1e3), "timing": t})
    return rows


# --- What runs here instead -----------------------------------------------------------------------


def substitution_plan(gpu: bool, tensorrt_ok: bool, tensorrt_why: str) -> list[dict[str, str]]:
    """For each thing TensorRT does in this lab: what runs on this machine, and why."""
    if tensorrt_ok:
        return [{"TensorRT step": s, "runs here": "TensorRT", "why": tensorrt_why}
                for s in ("parse ONNX into a strongly typed network", "fuse layers", "lower precision (from the graph)",
                          "pick the fastest kernels (tactics), timing cache", "engine file, profile, execute_async_v3")]
    why = tensorrt_why
    if gpu:
        rows = [("parse ONNX into a strongly typed network", "ONNX Runtime (CPU) runs the same ONNX files", why),
                ("fuse layers", "torch.compile (Inductor) fuses into generated kernels; ONNX Runtime's optimized "
                 "graph shows the node-level fusions", why),
                ("lower precision (from the graph)", "torch.autocast BF16/FP16 on the GPU for speed; the ModelOpt "
                 "FP16/INT8/FP8 ONNX models in ONNX Runtime for accuracy", why),
                ("pick the fastest kernels (tactics), timing cache", "torch.compile(mode='max-autotune') times "
                 "kernel candidates; cudnn.benchmark picks convolution algorithms", why),
                ("engine file, profile, execute_async_v3", "CUDA graphs: one replay per batch instead of hundreds of "
                 "launches; trtexec lines are shown to run elsewhere", why)]
    else:
        rows = [("parse ONNX into a strongly typed network", "ONNX Runtime on the CPU runs the same ONNX files",
                 f"no GPU here; {why}"),
                ("fuse layers", "ONNX Runtime's graph optimization levels (basic, extended, layout): node counts "
                 "before and after", "no GPU here"),
                ("lower precision (from the graph)", "the ModelOpt FP16 and INT8 Q/DQ models in ONNX Runtime "
                 "(accuracy real; speed is the CPU's, not a GPU's)", "no GPU here"),
                ("pick the fastest kernels (tactics), timing cache", "not on a CPU: ONNX Runtime's CPU kernels are "
                 "fixed; the H200 reference run's numbers stand beside", "no GPU here"),
                ("engine file, profile, execute_async_v3", "the trtexec lines are shown to run on a GPU machine",
                 "no GPU here")]
    return [{"TensorRT step": a, "runs here": b, "why": c} for a, b, c in rows]
