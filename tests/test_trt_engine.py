"""Lab 03 TensorRT: the type check against tensorrt-stubs, the removed-API guard, and engines where TensorRT runs.

Tests that need the TensorRT runtime (and a GPU) skip with the reason when it is absent; with
``NVLAB_REQUIRE_TENSORRT=1`` (GPU runners in an NGC image) they fail instead.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab_utils.inference import tensorrt as trt_engine

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


def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + ([cur] if cur.strip() else [])


def _repair_stub_line(line: str) -> str:
    """Two generator slips make tensorrt-stubs 10.13 unparsable: parameters named ``in`` and a parameter
    without a default after defaulted ones. Rename the first, give the second ``= ...``."""
    line = re.sub(r"([(,]\s*)in(\s*:)", r"\1in_\2", line)
    m = re.match(r"^(\s*def \w+\()(.*)(\)\s*->.*:\s*)$", line)
    if not m:
        return line
    params, defaulted = _split_params(m.group(2)), False
    for i, p in enumerate(params):
        name = p.split(":")[0].split("=")[0].strip()
        if name.startswith("*"):
            defaulted = False
        elif "=" in p:
            defaulted = True
        elif defaulted:
            params[i] = p + " = ..."
    return m.group(1) + ",".join(params) + m.group(3)


def repaired_tensorrt_stubs(dst: Path) -> Path:
    """A copy of the installed tensorrt-stubs that mypy can read: syntax repaired, the module-level ``bool``
    DataType (which shadows the builtin in every annotation) renamed, the import of the runtime-only
    ``tensorrt_libs`` dropped. The API surface is unchanged."""
    try:
        files = importlib.metadata.files("tensorrt-stubs") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("tensorrt-stubs is not installed: pip install --no-deps tensorrt-stubs "
                    "(the type check of lab_utils/inference/tensorrt.py needs it)")
    stubs = [f for f in files if str(f).endswith(".pyi")]
    assert any(str(f) == "tensorrt/__init__.pyi" for f in stubs), f"unexpected tensorrt-stubs layout: {stubs}"
    for f in stubs:
        text = "\n".join(_repair_stub_line(ln) for ln in Path(f.locate()).read_text().splitlines()) + "\n"
        text = re.sub(r"(?m)^import tensorrt_libs as tensorrt_libs\n", "", text)
        text = re.sub(r"(?m)^bool:", "bool_:", text)
        out = dst / str(f)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return dst


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

# Removed in TensorRT 10 or 11 (REFERENCE §5). `max_batch_size =` is Triton's field name too, so that pattern
# is checked only where TensorRT itself is used (a file that imports it, or lab 03's notebooks).
REMOVED = [
    "max_workspace_size", "build_engine(", "BuilderFlag.INT8", "BuilderFlag.FP16", "BuilderFlag.FP8",
    "BuilderFlag.BF16", "BuilderFlag.OBEY_PRECISION_CONSTRAINTS", "int8_calibrator", "IInt8EntropyCalibrator",
    "IInt8MinMaxCalibrator", "IInt8LegacyCalibrator", "IInt8Calibrator", "get_binding_shape",
    "get_binding_index", "binding_is_input", "set_binding_shape", "execute_async_v2", "num_bindings",
    "NetworkDefinitionCreationFlag.EXPLICIT_BATCH", "platform_has_fast_fp16", "platform_has_fast_int8",
]
TRT_ONLY = ["max_batch_size ="]
BOX = re.compile(r"<!-- WHAT CHANGED -->.*?<!-- END WHAT CHANGED -->", re.S)


def _sources() -> list[tuple[str, str, bool]]:
    """(file, text outside the "what changed" box, uses TensorRT) for every file the course ships code in."""
    found = []
    for p in sorted([*(ROOT / "lab_utils").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"),
                     *(ROOT / "scripts").rglob("*.sh")]):
        text = p.read_text()
        found.append((str(p.relative_to(ROOT)), text, "import tensorrt" in text))
    for folder in ("solutions", "labs"):
        for p in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
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
    monkeypatch.setattr(trt_engine, "TRTEXEC_CANDIDATES", ())


def _fake_trtexec(folder: Path, executable: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / "trtexec"
    fake.write_text("#!/bin/sh\necho '&&&& PASSED TensorRT.trtexec'\n")
    fake.chmod(0o755 if executable else 0o644)
    return fake


def test_trtexec_off_the_path_is_found_where_ngc_images_keep_it(no_trtexec, monkeypatch, tmp_path):
    assert trt_engine.find_trtexec() is None
    not_executable = _fake_trtexec(tmp_path / "opt" / "tensorrt" / "bin", executable=False)
    ngc = _fake_trtexec(tmp_path / "usr" / "src" / "tensorrt" / "bin")
    monkeypatch.setattr(trt_engine, "TRTEXEC_CANDIDATES", (tmp_path / "missing" / "trtexec", not_executable, ngc))
    assert trt_engine.find_trtexec() == ngc  # the missing and the non-executable candidates are passed over
    p = trt_engine.batch_profile("input", (1, 8, 8), 1, 16, 64)
    lines = trt_engine.trtexec_commands("m.onnx", "m.plan", p)
    assert lines["build"].startswith(f"{ngc} --onnx=m.onnx") and lines["run"].startswith(f"{ngc} --loadEngine=")
    ran = subprocess.run(shlex.split(lines["build"])[:1], capture_output=True, text=True, timeout=10)
    assert ran.stdout.startswith("&&&& PASSED")  # the line's program is the executable found


def test_trtexec_on_the_path_comes_first(no_trtexec, monkeypatch, tmp_path):
    on_path = _fake_trtexec(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.setattr(trt_engine, "TRTEXEC_CANDIDATES", (_fake_trtexec(tmp_path / "opt"),))
    assert trt_engine.find_trtexec() == on_path
    p = trt_engine.batch_profile("input", (1, 8, 8), 1, 16, 64)
    assert trt_engine.trtexec_commands("m.onnx", "m.plan", p)["build"].startswith("trtexec --onnx=")


def test_trtexec_command_lines(no_trtexec):
    p = trt_engine.batch_profile("input", (3, 224, 224), 1, 32, 128)
    lines = trt_engine.trtexec_commands("m.onnx", "m.plan", p, timing_cache="t.cache", workspace_bytes=2 << 30)
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
    assert _repair_stub_line(line) == "    def f(self: X, in_: list[int], out: int = 0, last: int = ...) -> None:"
    assert _repair_stub_line("x: int = 3") == "x: int = 3"
