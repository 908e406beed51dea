"""Reading TensorRT code without running it: the calls TensorRT 10 and 11 removed (and what replaced them), the
steps an engine build needs, and a type check against ``tensorrt-stubs`` with mypy.

Where TensorRT cannot run (no GPU, or no TensorRT runtime), lab 03's builder exercise is graded this way: the
student's function is read for removed calls and missing steps and type-checked against the stubs; the
course's own ``lab_utils.inference.tensorrt`` is type-checked the same way by its tests. Where TensorRT runs,
the exercise builds and runs the student's engine as well.

No torch, no TensorRT: mypy runs in a subprocess, against a copy of the installed ``tensorrt-stubs`` (TensorRT
10.13's API) that ``lab_utils.compat.tensorrt_stubs`` repairs, kept in the course's cache folder."""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab_utils.compat import tensorrt_stubs
from lab_utils.course.stack import dist_version
from lab_utils.procs import EnvError, owned_tempdir

STUBS_DIST = "tensorrt-stubs"
STUBS_INSTALL = "pip install --no-deps tensorrt-stubs==10.13.0.35.1 mypy"

# --- What TensorRT 10 and 11 removed --------------------------------------------------------------


@dataclass(frozen=True)
class Removed:
    """An API older tutorials use: the attribute (``owner.name`` when only that owner's is meant), the release
    that removed it, and what replaced it."""

    name: str
    removed_in: str
    instead: str
    owner: str = ""  # "BuilderFlag": only ``BuilderFlag.FP16``, not every attribute called FP16

    @property
    def shown(self) -> str:
        return f"{self.owner}.{self.name}" if self.owner else self.name

    def message(self) -> str:
        return f"`{self.shown}` is gone ({self.removed_in}): {self.instead}"


_PRECISION = ("networks are strongly typed: precision is written in the ONNX graph (ModelOpt AutoCast for "
              "FP16/BF16, Q/DQ nodes from ModelOpt quantization for INT8/FP8), never set by a builder flag")
_UNTYPED = "removed in TensorRT 11; a strongly typed network refuses it in 10"
_TENSORS = ("tensors are addressed by name: `engine.get_tensor_name(i)`, `context.set_input_shape(name, shape)`, "
            "`context.set_tensor_address(name, ptr)`, `context.execute_async_v3(stream)`")

_TRT10, _TRT11 = "removed in TensorRT 10", "removed in TensorRT 11"
_CALIBRATE = ("implicit INT8 calibration is gone: ModelOpt's `quantize(..., calibration_data=...)` writes calibrated "
              "Q/DQ scales into the ONNX file")

REMOVED_API: tuple[Removed, ...] = (
    Removed("EXPLICIT_BATCH", "deprecated and ignored since TensorRT 10, removed in 11",
            "every network has an explicit batch dimension; create it strongly typed with "
            "`builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))` (TensorRT 11: "
            "every network is)", "NetworkDefinitionCreationFlag"),
    Removed("max_batch_size", _TRT10, "implicit batch is gone: the batch is dimension 0 of the ONNX input, and an "
            "optimization profile (`profile.set_shape(name, min, opt, max)`) gives its range"),
    Removed("max_workspace_size", _TRT10, "use `config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, n_bytes)`"),
    Removed("build_engine", _TRT10, "use `builder.build_serialized_network(network, config)`, then "
            "`trt.Runtime(logger).deserialize_cuda_engine(plan)`"),
    Removed("build_cuda_engine", "removed in TensorRT 8", "use `builder.build_serialized_network(network, config)`"),
    *(Removed(flag, _UNTYPED, _PRECISION, "BuilderFlag") for flag in ("FP16", "BF16", "INT8", "FP8", "INT4", "FP4")),
    *(Removed(flag, _UNTYPED, "strong typing always obeys the graph's types", "BuilderFlag")
      for flag in ("OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS")),
    Removed("int8_calibrator", _TRT11, _CALIBRATE),
    *(Removed(c, _TRT11, _CALIBRATE) for c in ("IInt8EntropyCalibrator2", "IInt8EntropyCalibrator",
                                               "IInt8MinMaxCalibrator", "IInt8LegacyCalibrator", "IInt8Calibrator")),
    *(Removed(b, _TRT10, _TENSORS) for b in ("execute_async_v2", "get_binding_shape", "get_binding_index",
                                            "get_binding_name", "get_binding_dtype", "binding_is_input",
                                            "set_binding_shape", "num_bindings")),
    *(Removed(p, _TRT10, "strongly typed networks make the question moot: the graph says which precision runs")
      for p in ("platform_has_fast_fp16", "platform_has_fast_int8")))


@dataclass(frozen=True)
class Finding:
    """One problem found in a piece of source: its line (1-based, in that source) and what to do (a removed call's
    replacement, or mypy's message with its code)."""

    line: int
    message: str


def removed_calls(source: str) -> list[Finding]:
    """Each use of an API in ``REMOVED_API`` in ``source`` (attributes, flags, names), in line order."""
    tree = ast.parse(textwrap.dedent(source))
    found: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            # the owner: ``BuilderFlag`` of ``trt.BuilderFlag.FP16`` and of ``BuilderFlag.FP16``; "" for a call's result
            name, owner = node.attr, getattr(node.value, "attr", "") or getattr(node.value, "id", "")
        elif isinstance(node, ast.Name):
            name, owner = node.id, ""
        else:
            continue
        found += [Finding(node.lineno, r.message()) for r in REMOVED_API if r.name == name and r.owner in ("", owner)]
    return sorted(set(found), key=lambda f: f.line)


# --- The steps an engine build needs --------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of building and running an engine: any of ``names`` used in the code counts."""

    what: str
    names: tuple[str, ...]
    how: str


BUILD_STEPS: tuple[Step, ...] = (
    Step("a logger", ("Logger",), "`logger = trt.Logger(trt.Logger.WARNING)`"),
    Step("a builder", ("Builder",), "`builder = trt.Builder(logger)`"),
    Step("a strongly typed network", ("STRONGLY_TYPED",),
         "`builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))`: without the flag "
         "TensorRT 10 builds a weakly typed network, which ignores the precision written in the graph"),
    Step("the ONNX parser", ("OnnxParser",), "`parser = trt.OnnxParser(network, logger)`, then "
         "`parser.parse_from_file(path)`"),
    Step("the parser's errors printed", ("get_error", "num_errors"),
         "when `parse_from_file` returns False, print `parser.get_error(i)` for i in `range(parser.num_errors)`: "
         "otherwise a failed parse says nothing about why"),
    Step("a workspace limit", ("set_memory_pool_limit",),
         "`config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, n_bytes)`"),
    Step("an optimization profile", ("create_optimization_profile",),
         "the input's batch is dynamic, so the build needs `profile = builder.create_optimization_profile()`, "
         "`profile.set_shape(name, min, opt, max)` and `config.add_optimization_profile(profile)`"),
    Step("the profile added to the config", ("add_optimization_profile",),
         "`config.add_optimization_profile(profile)`: a profile the config does not hold is not used"),
    Step("the build", ("build_serialized_network",), "`plan = builder.build_serialized_network(network, config)`"),
    Step("the engine deserialized", ("deserialize_cuda_engine",),
         "`engine = trt.Runtime(logger).deserialize_cuda_engine(plan)`"),
    Step("an execution context", ("create_execution_context",), "`context = engine.create_execution_context()`"),
    Step("the input shape set", ("set_input_shape",),
         "`context.set_input_shape(name, tuple(x.shape))` before each run: the engine's batch is dynamic"),
    Step("the tensor addresses set", ("set_tensor_address",),
         "`context.set_tensor_address(name, tensor.data_ptr())` for the input and the output"),
    Step("an execution on a stream", ("execute_async_v3",), "`context.execute_async_v3(stream.cuda_stream)`, then "
         "wait for the stream (`stream.synchronize()`) before reading the output"))


def missing_steps(source: str, steps: Sequence[Step] = BUILD_STEPS) -> list[Step]:
    """The steps of ``steps`` that ``source`` never takes (by the names it uses), in build order."""
    used: set[str] = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            used.add(node.value)  # getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return [s for s in steps if not used & set(s.names)]


# --- tensorrt-stubs, repaired for mypy (lab_utils.compat.tensorrt_stubs) --------------------------


def stubs_version() -> str | None:
    """The installed tensorrt-stubs version, or None."""
    return dist_version(STUBS_DIST)


def cache_root() -> Path:
    """The course's cache folder: ``$NVLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/nvlab``, else ``~/.cache/nvlab``;
    where that cannot be written (a read-only home in CI), a temporary folder removed when Python exits."""
    named = os.environ.get("NVLAB_CACHE_DIR")
    wanted = Path(named) if named else Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "nvlab"
    with contextlib.suppress(OSError):
        wanted.mkdir(parents=True, exist_ok=True)
        if os.access(wanted, os.W_OK):
            return wanted
    if named:  # asked for by name: say so rather than quietly use another folder
        raise EnvError(f"NVLAB_CACHE_DIR={named!r}: expected a folder this user can create and write (or unset it "
                       "for ~/.cache/nvlab)")
    return _temporary_cache()


@functools.lru_cache(maxsize=1)
def _temporary_cache() -> Path:
    return owned_tempdir("cache")


def repaired_stubs(dst: Path | None = None) -> Path:
    """A copy of the installed tensorrt-stubs that mypy can read (a folder to put on ``MYPYPATH``), repaired by
    ``lab_utils.compat.tensorrt_stubs``. Without ``dst``: kept in the course cache, one folder per stubs version,
    written once."""
    if (version := stubs_version()) is None:
        raise TypeCheckUnavailable(f"tensorrt-stubs is not installed: {STUBS_INSTALL}")
    files = importlib.metadata.files(STUBS_DIST) or []
    stubs = [f for f in files if str(f).endswith(".pyi")]
    if not any(str(f) == "tensorrt/__init__.pyi" for f in stubs):
        raise TypeCheckUnavailable(f"unexpected tensorrt-stubs {version} layout: {[str(f) for f in stubs][:5]}")
    if dst is not None:
        return tensorrt_stubs.write_repaired(stubs, dst, replace=True)
    cached = cache_root() / "tensorrt-typecheck" / f"stubs-{version}-{tensorrt_stubs.REVISION}"
    if (cached / "tensorrt" / "__init__.pyi").exists():
        return cached
    return tensorrt_stubs.write_repaired(stubs, cached)


# --- mypy -----------------------------------------------------------------------------------------


class TypeCheckUnavailable(RuntimeError):
    """mypy or tensorrt-stubs is missing: the message says what to install."""


# Stubs are checked only as far as the student's code uses them; torch and friends are Any.
STUDENT_MYPY_CONFIG = """\
[mypy]
check_untyped_defs = True
follow_imports = silent
ignore_missing_imports = True
warn_unused_configs = False
mypy_path = {stubs}
[mypy-tensorrt,tensorrt.*,tensorrt_bindings,tensorrt_bindings.*]
ignore_errors = True
[mypy-torch,torch.*,numpy,numpy.*,pandas,pandas.*,onnx,onnx.*,onnxruntime,onnxruntime.*,lab_utils,lab_utils.*]
follow_imports = skip
"""


@dataclass
class TypeCheckReport:
    """What mypy said about a piece of code: its errors, and against which stubs and mypy."""

    errors: list[Finding]  # mypy's, with the lines of the checked source
    stubs: str
    mypy: str

    @property
    def ok(self) -> bool:
        return not self.errors


def type_check_source(source: str, timeout_s: float = 180.0) -> TypeCheckReport:
    """mypy (``check_untyped_defs``, not strict: a student's function has no annotations) over ``source``
    against the repaired tensorrt-stubs; errors in ``source`` only, with its line numbers."""
    if (mypy := dist_version("mypy")) is None:
        raise TypeCheckUnavailable(f"mypy is not installed: {STUBS_INSTALL}")
    stubs = repaired_stubs()
    root = stubs.parent
    config = root / "student-mypy.ini"
    text = STUDENT_MYPY_CONFIG.format(stubs=stubs)
    if not config.exists() or config.read_text() != text:
        config.write_text(text)
    with tempfile.TemporaryDirectory(prefix="check-", dir=root) as tmp:
        path = Path(tmp) / "student_code.py"
        path.write_text(source)
        try:
            out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir",
                                  str(root / f"mypy-cache-{mypy}"), "--no-error-summary", "--show-error-codes",
                                  "--hide-error-context", str(path)],
                                 capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise TypeCheckUnavailable(f"mypy did not finish within {timeout_s:g} s") from None
    found = (re.match(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<msg>.*)$", ln) for ln in out.stdout.splitlines())
    errors = [Finding(int(m["line"]), m["msg"].strip()) for m in found if m and Path(m["file"]).name == path.name]
    if out.returncode not in (0, 1) or (out.returncode == 1 and not errors):
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise TypeCheckUnavailable(f"mypy failed to run (exit {out.returncode}): {' '.join(tail)}")
    return TypeCheckReport(errors, stubs_version() or "?", mypy)


# --- A function's source, as mypy should see it ---------------------------------------------------


@dataclass
class FunctionSource:
    """A function's own source (dedented), where it starts in its file or cell, and a header that gives mypy
    the module-level names it uses (modules imported as they are, anything else typed ``Any``)."""

    name: str
    source: str
    first_line: int  # line of the ``def`` in the student's cell or file
    header: str

    @property
    def checked(self) -> str:
        return self.header + self.source

    def cell_line(self, checked_line: int) -> int:
        """A line of ``checked`` as a line of the student's cell."""
        return checked_line - self.header.count("\n") + self.first_line - 1


def function_source(fn: Callable[..., Any]) -> FunctionSource:
    """``fn``'s source and the header mypy needs; ``OSError`` when Python has no source for it (defined by
    ``exec`` of a string, or in an interactive console)."""
    lines, first = inspect.getsourcelines(fn)
    source = textwrap.dedent("".join(lines))
    names = set(getattr(fn, "__code__", types.SimpleNamespace(co_names=())).co_names)
    names |= {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    glb = getattr(fn, "__globals__", {})
    header = ["from __future__ import annotations", "from typing import Any"]
    for name in sorted(names):
        if name not in glb or hasattr(builtins, name) or name == fn.__name__:
            continue
        value = glb[name]
        if isinstance(value, types.ModuleType):  # tensorrt too (even the stub-only namespace package)
            header.append(f"import {value.__name__} as {name}" if value.__name__ != name else f"import {name}")
        else:
            header.append(f"{name}: Any")
    return FunctionSource(getattr(fn, "__name__", "function"), source, first, "\n".join(header) + "\n\n")
