"""Lab 03 TensorRT: the type check against tensorrt-stubs, the removed-API guard, and engines where TensorRT runs.

Tests that need the TensorRT runtime (and a GPU) skip with the reason when it is absent; with
``NVLAB_REQUIRE_TENSORRT=1`` (GPU runners in an NGC image) they fail instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab_utils.compat import tensorrt_stubs
from lab_utils.course import programs
from lab_utils.course.catalog import NOTEBOOK_GLOB
from lab_utils.inference import tensorrt as trt_engine
from lab_utils.inference import trt_check

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "NVLAB_REQUIRE_TENSORRT"


@pytest.fixture
def trt_runtime():
    """The tensorrt module, or a skip (a failure under NVLAB_REQUIRE_TENSORRT=1) saying why it cannot run."""
    ok, why = trt_engine.tensorrt_status()
    if not ok:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but TensorRT cannot run here: {why}")
        pytest.skip(f"TensorRT runtime absent: {why} (set {REQUIRE_ENV}=1 to make this a failure)")
    return trt_engine.import_tensorrt()


# --- the type check against tensorrt-stubs -----------------------------------------------------------------


def repaired_tensorrt_stubs(dst: Path) -> Path:
    """The installed tensorrt-stubs, repaired for mypy (lab_utils.inference.trt_check, which lab 03's builder
    exercise uses too); a failure here, not a skip, when they are missing."""
    try:
        return trt_check.repaired_stubs(dst)
    except trt_check.TypeCheckUnavailable as err:
        pytest.fail(f"{err} (the type check of lab_utils/inference/tensorrt.py needs it)")


MYPY_CONFIG = """\
[mypy]
strict = True
follow_imports = silent
warn_unused_configs = False
[mypy-tensorrt,tensorrt.*,tensorrt_bindings,tensorrt_bindings.*]
ignore_errors = True
[mypy-torch,torch.*,numpy,numpy.*,pandas,pandas.*,lab_utils.course.probe,lab_utils.timing]
follow_imports = skip
"""

# Calls from older tutorials: each line must be an error against the stubs (proof the stubs are live).
REMOVED_API_PROBE = """\
from __future__ import annotations

import tensorrt as trt


def old_style(builder: trt.Builder, config: trt.IBuilderConfig, network: trt.INetworkDefinition,
              engine: trt.ICudaEngine, context: trt.IExecutionContext) -> None:
    builder.max_batch_size = 8  # E1
    config.max_workspace_size = 1 << 30  # E2
    builder.build_engine(network, config)  # E3
    engine.get_binding_shape(0)  # E4
    context.execute_async_v2([], 0)  # E5
"""


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory):
    pytest.importorskip("mypy")
    tmp = tmp_path_factory.mktemp("mypy")
    stubs = repaired_tensorrt_stubs(tmp / "stubs")
    (tmp / "mypy.ini").write_text(MYPY_CONFIG)
    probe = tmp / "old_tutorial.py"
    probe.write_text(REMOVED_API_PROBE)
    env = {**os.environ, "MYPYPATH": str(stubs)}
    cache = ROOT / ".mypy_cache" / "lab03-tensorrt-stubs"
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(tmp / "mypy.ini"), "--cache-dir",
                          str(cache), "--no-error-summary", "lab_utils/inference/tensorrt.py", str(probe)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    return out, probe


def test_trt_engine_type_checks_against_tensorrt_stubs(mypy_run):
    out, probe = mypy_run
    mine = [ln for ln in out.stdout.splitlines() if ln.startswith("lab_utils/")]
    assert not mine, "mypy --strict against tensorrt-stubs:\n" + "\n".join(mine)
    assert "error" not in out.stderr.lower(), out.stderr


def test_the_stubs_reject_removed_calls(mypy_run):
    out, probe = mypy_run
    # by file name: mypy's incremental cache may report a cached module under the path of an earlier run
    errors = [ln for ln in out.stdout.splitlines() if Path(ln.split(":")[0]).name == probe.name and ": error:" in ln]
    lines = {int(ln.split(":")[1]) for ln in errors}
    probe_lines = REMOVED_API_PROBE.splitlines()
    expected = {i + 1 for i, ln in enumerate(probe_lines) if "# E" in ln}
    assert lines == expected, out.stdout


# --- no removed TensorRT API anywhere ----------------------------------------------------------------------

# Removed in TensorRT 10 or 11 (REFERENCE §5): the table lab 03's builder exercise checks students' code with.
# `max_batch_size =` is Triton's field name too, so that pattern is checked only where TensorRT itself is used (a
# file that imports it, or lab 03's notebooks).
REMOVED = sorted({f"{r.shown}(" if r.name.startswith("build_") else r.shown
                  for r in trt_check.REMOVED_API if r.name != "max_batch_size"})
TRT_ONLY = ["max_batch_size ="]
BOX = re.compile(r"<!-- WHAT CHANGED -->.*?<!-- END WHAT CHANGED -->", re.S)


# The one module that names every removed call, to find them in a student's code (lab 03's builder exercise).
NAMES_REMOVED_CALLS = "lab_utils/inference/trt_check.py"


def _sources() -> list[tuple[str, str, bool]]:
    """(file, text outside the "what changed" box, uses TensorRT) for every file the course ships code in."""
    found = []
    for p in sorted([*(ROOT / "lab_utils").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"),
                     *(ROOT / "scripts").rglob("*.sh")]):
        if str(p.relative_to(ROOT)) == NAMES_REMOVED_CALLS:
            continue
        text = p.read_text()
        found.append((str(p.relative_to(ROOT)), text, "import tensorrt" in text))
    for folder in ("solutions", "labs"):
        for p in sorted((ROOT / folder).glob(NOTEBOOK_GLOB)):
            cells = json.loads(p.read_text())["cells"]
            text = "\n".join("".join(c["source"]) for c in cells)
            found.append((f"{folder}/{p.name}", BOX.sub("", text), p.name.startswith("03_")))
    return found


def test_no_removed_tensorrt_api_is_used():
    hits = []
    for name, text, uses_trt in _sources():
        for pattern in REMOVED + (TRT_ONLY if uses_trt else []):
            for i, line in enumerate(text.splitlines(), 1):
                if pattern in line:
                    hits.append(f"{name}:{i}: {pattern!r}: {line.strip()}")
    assert not hits, "removed TensorRT APIs (see lab 03's 'What changed'):\n" + "\n".join(hits)


def test_the_what_changed_box_names_each_removed_call():
    nb = json.loads((ROOT / "solutions" / "03_tensorrt.ipynb").read_text())
    boxes = [m.group(0) for c in nb["cells"] if c["cell_type"] == "markdown"
             for m in BOX.finditer("".join(c["source"]))]
    assert len(boxes) == 1
    for old in ("max_workspace_size", "build_engine(", "max_batch_size", "BuilderFlag.INT8", "BuilderFlag.FP16",
                "int8_calibrator", "execute_async_v2", "set_memory_pool_limit", "build_serialized_network",
                "execute_async_v3", "AutoCast", "Q/DQ"):
        assert old in boxes[0], old


def test_the_guard_sees_a_removed_call(tmp_path, monkeypatch):
    (tmp_path / "lab_utils").mkdir()
    (tmp_path / "lab_utils" / "old.py").write_text("import tensorrt as trt\nbuilder.max_batch_size = 8\n")
    (tmp_path / "scripts").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    names = {n for n, _, uses in _sources() if uses}
    assert names == {"lab_utils/old.py"}


# --- without TensorRT ------------------------------------------------------------------------------------------


def test_status_says_why_and_import_refuses():
    ok, why = trt_engine.tensorrt_status()
    assert isinstance(why, str) and why
    if ok:
        pytest.skip("TensorRT is present here")
    with pytest.raises(trt_engine.TensorRTUnavailable, match="NGC"):
        trt_engine.import_tensorrt()
    assert trt_engine.tensorrt_major() is None


def test_profile_checks_and_accepts():
    p = trt_engine.batch_profile("input", (3, 224, 224), 1, 16, 64)
    assert p.min_shape == (1, 3, 224, 224) and p.opt_shape == (16, 3, 224, 224)
    assert p.accepts((64, 3, 224, 224)) and p.accepts((1, 3, 224, 224))
    assert not p.accepts((65, 3, 224, 224)) and not p.accepts((8, 3, 256, 256)) and not p.accepts((8, 3, 224))
    assert p.shapes_flag("max") == "input:64x3x224x224"
    with pytest.raises(ValueError, match="min <= opt <= max"):
        trt_engine.batch_profile("input", (3, 8, 8), 4, 2, 8)
    with pytest.raises(ValueError, match="same rank"):
        trt_engine.Profile("input", (1, 3), (1, 3, 4), (1, 3, 4))


@pytest.fixture
def no_trtexec(monkeypatch, tmp_path):
    """A machine without trtexec: an empty PATH and no NGC location."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(programs, "TRTEXEC_CANDIDATES", ())


def _fake_trtexec(folder: Path, executable: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / "trtexec"
    fake.write_text("#!/bin/sh\necho '&&&& PASSED TensorRT.trtexec'\n")
    fake.chmod(0o755 if executable else 0o644)
    return fake


def test_trtexec_off_the_path_is_found_where_ngc_images_keep_it(no_trtexec, monkeypatch, tmp_path):
    assert programs.find_trtexec() is None
    not_executable = _fake_trtexec(tmp_path / "opt" / "tensorrt" / "bin", executable=False)
    ngc = _fake_trtexec(tmp_path / "usr" / "src" / "tensorrt" / "bin")
    monkeypatch.setattr(programs, "TRTEXEC_CANDIDATES", (tmp_path / "missing" / "trtexec", not_executable, ngc))
    assert programs.find_trtexec() == str(ngc)  # the missing and the non-executable candidates are passed over
    p = trt_engine.batch_profile("input", (1, 8, 8), 1, 16, 64)
    lines = trt_engine.trtexec_commands("m.onnx", "m.plan", p)
    assert lines["build"].startswith(f"{ngc} --onnx=m.onnx") and lines["run"].startswith(f"{ngc} --loadEngine=")
    ran = subprocess.run(shlex.split(lines["build"])[:1], capture_output=True, text=True, timeout=10)
    assert ran.stdout.startswith("&&&& PASSED")  # the line's program is the executable found


def test_trtexec_on_the_path_comes_first(no_trtexec, monkeypatch, tmp_path):
    on_path = _fake_trtexec(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.setattr(programs, "TRTEXEC_CANDIDATES", (_fake_trtexec(tmp_path / "opt"),))
    assert programs.find_trtexec() == str(on_path)
    p = trt_engine.batch_profile("input", (1, 8, 8), 1, 16, 64)
    assert trt_engine.trtexec_commands("m.onnx", "m.plan", p)["build"].startswith("trtexec --onnx=")


def test_trtexec_command_lines(no_trtexec):
    p = trt_engine.batch_profile("input", (3, 224, 224), 1, 32, 128)
    lines = trt_engine.trtexec_commands("m.onnx", "m.plan", p, timing_cache="t.cache", workspace_bytes=2 << 30,
                                        major=10)
    assert lines["build"] == ("trtexec --onnx=m.onnx --saveEngine=m.plan --stronglyTyped "
                              "--minShapes=input:1x3x224x224 --optShapes=input:32x3x224x224 "
                              "--maxShapes=input:128x3x224x224 --memPoolSize=workspace:2048M --timingCacheFile=t.cache")
    assert lines["run"].startswith("trtexec --loadEngine=m.plan --shapes=input:32x3x224x224 --useCudaGraph "
                                   "--noDataTransfers")
    assert "--shapes=input:8x3x224x224" in trt_engine.trtexec_commands("m.onnx", "m.plan", p, run_batch=8)["run"]
    with pytest.raises(ValueError, match="outside the profile"):
        trt_engine.trtexec_commands("m.onnx", "m.plan", p, run_batch=256)
    named = trt_engine.trtexec_commands("m.onnx", "m.plan", p, trtexec="/opt/x/trtexec")
    assert named["build"].startswith("/opt/x/trtexec --onnx=") and named["run"].startswith("/opt/x/trtexec ")


def test_trtexec_lines_for_tensorrt_11_leave_out_its_deprecated_no_ops(no_trtexec):
    p = trt_engine.batch_profile("input", (1, 8, 8), 1, 16, 64)
    eleven = trt_engine.trtexec_commands("m.onnx", "m.plan", p, major=11)
    text = " ".join(eleven.values())
    for flag in ("--stronglyTyped", "--useCudaGraph", "--noDataTransfers"):
        assert flag not in text, flag
    assert eleven["run"] == "trtexec --loadEngine=m.plan --shapes=input:16x1x8x8 --warmUp=500 --duration=10"
    if trt_engine.tensorrt_major() is None:  # no TensorRT here: the lines are for the newest major version
        assert trt_engine.trtexec_commands("m.onnx", "m.plan", p) == eleven


def test_network_flags_on_tensorrt_10_and_11():
    ten = SimpleNamespace(NetworkDefinitionCreationFlag=SimpleNamespace(STRONGLY_TYPED=1))
    eleven = SimpleNamespace(NetworkDefinitionCreationFlag=SimpleNamespace())  # strongly typed always, no flag
    assert trt_engine._network_flags(ten) == 2 and trt_engine._network_flags(eleven) == 0


def test_substitution_plan_says_what_and_why():
    for gpu, ok, runs in ((True, False, "torch.compile"), (False, False, "ONNX Runtime"), (True, True, "TensorRT")):
        rows = trt_engine.substitution_plan(gpu, ok, "the reason")
        assert len(rows) == 5 and all(r["why"] for r in rows)
        assert any(runs in r["runs here"] for r in rows)
        assert all("the reason" in r["why"] for r in rows) if gpu else "the reason" in rows[0]["why"]


# --- with TensorRT (GPU runners in an NGC image) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_plan(tmp_path_factory):
    ok, _ = trt_engine.tensorrt_status()
    if not ok:
        return None
    from _lab03_data import digits_onnx

    _, onnx_path, _ = digits_onnx()
    tmp = tmp_path_factory.mktemp("trt")
    profile = trt_engine.batch_profile("input", (1, 8, 8), 1, 16, 64)
    built = trt_engine.build_plan(onnx_path, profile, timing_cache_path=tmp / "timing.cache")
    return built, trt_engine.save_engine(built, tmp / "digits.plan"), onnx_path, tmp


def test_build_save_load_and_run_matches_onnx_runtime(trt_runtime, digits_plan):
    import numpy as np
    import torch

    from lab_utils import models
    from lab_utils.inference import onnx

    built, plan, onnx_path, tmp = digits_plan
    assert plan.stat().st_size > 0 and built.build_s > 0 and (tmp / "timing.cache").stat().st_size > 0
    runner = trt_engine.TrtRunner(trt_engine.load_engine(plan))
    x = models.digits_arrays()["x_test"][:10]
    out = runner.infer(torch.from_numpy(x)).float().cpu().numpy()
    ref = onnx.ort_predict(onnx.ort_session(onnx_path), x)
    assert out.shape == (10, 10) and np.abs(out - ref).max() < 5e-2  # TF32 convolutions allowed in FP32 engines
    io = trt_engine.engine_io(runner.loaded)
    assert io[0]["mode"] == "input" and io[0]["min"] == (1, 1, 8, 8) and io[0]["max"] == (64, 1, 8, 8)
    rebuilt = trt_engine.build_plan(onnx_path, built.profile, timing_cache_path=tmp / "timing.cache")
    assert rebuilt.timing_cache_reused


def test_the_profile_refuses_a_batch_over_max(trt_runtime, digits_plan):
    import torch

    runner = trt_engine.TrtRunner(trt_engine.load_engine(digits_plan[1]))
    with pytest.raises(ValueError, match="outside the engine's optimization profile"):
        runner.bind(torch.zeros(65, 1, 8, 8))


def test_a_foreign_engine_says_rebuild(trt_runtime, tmp_path):
    bad = tmp_path / "other-gpu.plan"
    bad.write_bytes(b"not an engine for this GPU")
    with pytest.raises(trt_engine.EngineLoadError, match="rebuild it"):
        trt_engine.load_engine(bad)


def test_int8_engine_keeps_accuracy_and_timing_rows(trt_runtime, digits_plan, tmp_path):
    import torch

    from lab_utils import models
    from lab_utils.inference import compare, onnx, quantize

    data = models.digits_arrays()
    _, _, onnx_path, _ = digits_plan
    int8 = quantize.quantize_onnx(onnx_path, tmp_path / "int8.onnx", data["x_train"][:256], high_precision="fp16")
    built = trt_engine.build_plan(int8, trt_engine.batch_profile("input", (1, 8, 8), 1, 256, 512))
    runner = trt_engine.TrtRunner(trt_engine.load_engine(built.plan))
    logits = runner.infer(torch.from_numpy(data["x_test"])).float().cpu().numpy()
    fp32 = onnx.ort_predict(onnx.ort_session(onnx_path), data["x_test"])
    assert abs(compare.accuracy(logits, data["y_test"]) - compare.accuracy(fp32, data["y_test"])) <= 0.01
    rows = trt_engine.time_engine(runner, (1, 8, 8), (1, 64), reps=5, warmup=2)
    assert [r["batch"] for r in rows] == [1, 64] and all(r["p50_ms"] > 0 for r in rows)


def test_stub_repair_is_minimal():
    line = "    def f(self: X, in: list[int], out: int = 0, last: int) -> None:"
    repair = tensorrt_stubs.repair_stub_line
    assert repair(line) == "    def f(self: X, in_: list[int], out: int = 0, last: int = ...) -> None:"
    assert repair("x: int = 3") == "x: int = 3"
    # a Dims parameter takes a tuple or list too, as the runtime converts them
    assert repair("    def set_shape(self, input: str, min: Dims, opt: Dims, max: Dims) -> None:") == (
        "    def set_shape(self, input: str, min: Dims | typing.Sequence[int], opt: Dims | typing.Sequence[int], "
        "max: Dims | typing.Sequence[int]) -> None:")
    returns_dims = "    def get_tensor_shape(self, name: str) -> Dims:"
    assert repair(returns_dims) == returns_dims


def test_the_guard_looks_for_the_calls_tutorials_still_show():
    for old in ("max_workspace_size", "build_engine(", "BuilderFlag.FP16", "BuilderFlag.INT8", "execute_async_v2",
                "NetworkDefinitionCreationFlag.EXPLICIT_BATCH", "IInt8EntropyCalibrator2", "int8_calibrator"):
        assert old in REMOVED, old


# --- reading a student's TensorRT code ----------------------------------------------------------------------------

GOOD_BUILDER = """
def build(path, batches):
    import tensorrt as trt
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(path):
        print([parser.get_error(i) for i in range(parser.num_errors)])
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
    profile = builder.create_optimization_profile()
    profile.set_shape("input", (1, 1, 8, 8), (8, 1, 8, 8), (8, 1, 8, 8))
    config.add_optimization_profile(profile)
    engine = trt.Runtime(logger).deserialize_cuda_engine(builder.build_serialized_network(network, config))
    context = engine.create_execution_context()
    context.set_input_shape("input", (1, 1, 8, 8))
    context.set_tensor_address("input", 0)
    context.execute_async_v3(0)
"""


def test_removed_calls_are_found_with_their_line_and_what_changed():
    code = GOOD_BUILDER.replace("config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)",
                                "config.max_workspace_size = 1 << 30\n    config.set_flag(trt.BuilderFlag.FP16)")
    found = trt_check.removed_calls(code)
    assert [f.line for f in found] == [11, 12]
    assert "set_memory_pool_limit" in found[0].message and "AutoCast" in found[1].message
    assert trt_check.removed_calls(GOOD_BUILDER) == []
    assert trt_check.removed_calls("flags = trt.BuilderFlag.VERSION_COMPATIBLE\nx.FP16 = 1") == []  # other owners


def test_missing_steps_in_build_order():
    assert trt_check.missing_steps(GOOD_BUILDER) == []
    code = GOOD_BUILDER.replace("context.execute_async_v3(0)", "").replace(
        "print([parser.get_error(i) for i in range(parser.num_errors)])", "pass")
    missing = [s.what for s in trt_check.missing_steps(code)]
    assert missing == ["the parser's errors printed", "an execution on a stream"]
    flagged = GOOD_BUILDER.replace("1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)",
                                   'getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")')
    assert trt_check.missing_steps(flagged) == []


def test_a_student_function_is_type_checked_with_its_cell_lines(tmp_path):
    pytest.importorskip("mypy")
    module = tmp_path / "cell.py"
    module.write_text("import numpy as np\nhelper = 3\n\n" + GOOD_BUILDER.replace(
        "context.execute_async_v3(0)", "context.execute_async_v3(0)\n    context.execute_async_v2([], 0)"))
    spec = importlib.util.spec_from_file_location("cell", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = trt_check.function_source(mod.build)
    assert src.first_line == 5 and "import tensorrt" not in src.header  # imported inside the function
    report = trt_check.type_check_source(src.checked)
    assert len(report.errors) == 1 and "execute_async_v2" in report.errors[0].message
    assert src.cell_line(report.errors[0].line) == 23  # the line in the student's file
    assert report.stubs == trt_check.stubs_version()



# --- the timing cache, with a stand-in for TensorRT's Python API ----------------------------------------------------


class _FakeCache:
    def __init__(self, data: bytes):
        self.data = data

    def serialize(self):
        return memoryview(b"timings of this GPU")


class _FakeConfig:
    """Accepts a cache it wrote itself (b"timings of this GPU") or an empty one; refuses another GPU's; a damaged
    file makes create_timing_cache raise."""

    def __init__(self, no_cache_back: bool):
        self.no_cache_back, self.cache = no_cache_back, None

    def set_memory_pool_limit(self, pool, size):
        pass

    def add_optimization_profile(self, profile):
        pass

    def create_timing_cache(self, data):
        if data == b"damaged":
            raise RuntimeError("not a timing cache")
        return _FakeCache(bytes(data))

    def set_timing_cache(self, cache, ignore_mismatch):
        assert ignore_mismatch is False
        fits = cache.data in (b"", b"timings of this GPU")
        self.cache = cache if fits else self.cache
        return fits

    def get_timing_cache(self):
        return None if self.no_cache_back else self.cache


def _fake_tensorrt(no_cache_back: bool = False) -> SimpleNamespace:
    config = _FakeConfig(no_cache_back)
    network = SimpleNamespace(num_inputs=1, get_input=lambda i: SimpleNamespace(name="input"))
    builder = SimpleNamespace(create_network=lambda flags: network, create_builder_config=lambda: config,
                              create_optimization_profile=lambda: SimpleNamespace(set_shape=lambda *a: None),
                              build_serialized_network=lambda n, c: b"plan")
    parser = SimpleNamespace(parse_from_file=lambda path: True, num_errors=0)
    return SimpleNamespace(__version__="10.99.1", Logger=SimpleNamespace(WARNING=2, VERBOSE=4, __call__=None),
                           Builder=lambda logger: builder, OnnxParser=lambda net, logger: parser,
                           MemoryPoolType=SimpleNamespace(WORKSPACE=0), Dims=list,
                           NetworkDefinitionCreationFlag=SimpleNamespace(STRONGLY_TYPED=1), config=config)


@pytest.fixture
def fake_trt(monkeypatch):
    def install(**kwargs):
        fake = _fake_tensorrt(**kwargs)
        fake.Logger = lambda level: None
        fake.Logger.WARNING, fake.Logger.VERBOSE = 2, 4
        monkeypatch.setattr(trt_engine, "import_tensorrt", lambda: fake)
        return fake

    return install


def _build(tmp_path, cache: Path):
    profile = trt_engine.batch_profile("input", (1, 8, 8), 1, 16, 64)
    return trt_engine.build_plan(tmp_path / "m.onnx", profile, timing_cache_path=cache)


def test_a_new_timing_cache_is_written(fake_trt, tmp_path):
    fake_trt()
    cache = tmp_path / "caches" / "timing.cache"
    built = _build(tmp_path, cache)
    assert built.plan == b"plan" and not built.timing_cache_reused and built.timing_cache_note == ""
    assert cache.read_bytes() == b"timings of this GPU" and not list(cache.parent.glob("*.tmp"))
    again = _build(tmp_path, cache)
    assert again.timing_cache_reused and again.timing_cache_note == ""


@pytest.mark.parametrize("content", [b"timings of another GPU", b"damaged"])
def test_a_timing_cache_that_does_not_fit_is_rebuilt(fake_trt, tmp_path, content):
    fake_trt()
    cache = tmp_path / "timing.cache"
    cache.write_bytes(content)
    built = _build(tmp_path, cache)
    assert not built.timing_cache_reused
    assert "does not fit TensorRT 10.99.1 on this GPU" in built.timing_cache_note and "started a new one" in \
        built.timing_cache_note
    assert cache.read_bytes() == b"timings of this GPU"  # replaced by this GPU's own


def test_no_timing_cache_back_from_the_builder_is_said_not_crashed(fake_trt, tmp_path):
    fake_trt(no_cache_back=True)
    cache = tmp_path / "timing.cache"
    built = _build(tmp_path, cache)
    assert "returned no timing cache" in built.timing_cache_note and not cache.exists()


def test_the_timing_cache_file_is_named_after_tensorrt_and_the_gpu(tmp_path):
    path = trt_engine.timing_cache_file(tmp_path, version="10.14.1.48", gpu="NVIDIA H200 NVL")
    assert path == tmp_path / "timing-trt10.14.1.48-NVIDIA-H200-NVL.cache"
    if not trt_engine.tensorrt_status()[0]:
        assert trt_engine.timing_cache_file(tmp_path).name.startswith("timing-trtunknown-")


# --- nvlab doctor: which TensorRT, and where from ----------------------------------------------------------------


def test_doctor_says_no_tensorrt_and_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(programs, "TRTEXEC_CANDIDATES", ())
    if programs.tensorrt_runtime_present():
        pytest.skip("TensorRT is installed here")
    c = programs._tensorrt_component()
    assert not c.present and c.where is None
    assert "pip install tensorrt-cu13" in c.note and "NGC" in c.note
    if importlib.util.find_spec("tensorrt") is not None:
        assert "only tensorrt-stubs" in c.note


def test_doctor_names_the_module_and_trtexec_it_found(monkeypatch, tmp_path):
    package = tmp_path / "site" / "tensorrt"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '10.99.1'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)  # ModelOpt may have imported the stub package
    tool = _fake_trtexec(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tool.parent))
    c = programs._tensorrt_component()
    assert c.present and c.where == str(package)
    assert f"Python module {package}" in c.note and f"trtexec {tool}" in c.note


def test_doctor_with_trtexec_but_no_python_module(monkeypatch, tmp_path):
    if programs.tensorrt_runtime_present():
        pytest.skip("TensorRT is installed here")
    tool = _fake_trtexec(tmp_path / "usr" / "src" / "tensorrt" / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(programs, "TRTEXEC_CANDIDATES", (tool,))
    c = programs._tensorrt_component()
    assert not c.present and c.where == str(tool) and "but no Python module" in c.note


# --- ./course's TensorRT step ---------------------------------------------------------------------------------------


def _course_step(env_extra: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ./course's install_tensorrt alone (sourced: the script only defines its steps), with this venv's Python
    first on the PATH and pip pointed at an index that cannot answer (nothing is installed or fetched)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "NVLAB_TENSORRT"))}
    env.update(PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin", PIP_CONFIG_FILE=os.devnull,
               PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_DEFAULT_TIMEOUT="5",
               PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", TMPDIR=str(tmp_path), **env_extra)
    return subprocess.run(["bash", "-c", 'source ./course && install_tensorrt && echo "setup goes on"'], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)


def test_course_tensorrt_step_offline_says_so_in_one_line_and_goes_on(tmp_path):
    if programs.tensorrt_runtime_present():
        pytest.skip("TensorRT is installed here: the step has nothing to do")
    out = _course_step({"NVLAB_TENSORRT": "1"}, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "setup goes on", out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    # what it is doing (pip can take a while), then the outcome in one line
    assert len(lines) == 2 and lines[0].startswith("course: installing TensorRT (tensorrt-cu13>="), out.stderr
    from lab_utils.course.stack import pinned_image

    assert lines[1].startswith("course: TensorRT not installed: pip could not install tensorrt-cu13>=")
    assert pinned_image("pytorch") in lines[1] and lines[1].endswith("setup goes on without it")
    assert not list(tmp_path.iterdir())  # pip's log removed
    assert not programs.tensorrt_runtime_present()


@pytest.mark.parametrize("asked", ["", "0"])
def test_course_tensorrt_step_does_nothing_without_a_gpu_or_when_told_not_to(tmp_path, asked):
    out = _course_step({"NVLAB_TENSORRT": asked} if asked else {}, tmp_path)  # no nvidia-smi on this PATH
    assert out.returncode == 0 and out.stdout.strip() == "setup goes on" and out.stderr == "", out.stderr


def test_pyproject_tensorrt_extras_are_what_the_course_installs():
    out = subprocess.run(["bash", "-c", "source ./course && extra_requirements tensorrt && "
                                        "extra_requirements tensorrt-cu12"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    cu13, cu12 = out.stdout.split()
    assert cu13.startswith("tensorrt-cu13>=") and cu12.startswith("tensorrt-cu12>=")
