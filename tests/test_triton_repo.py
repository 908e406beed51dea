"""Model configurations checked with Triton's own protobuf schema and the semantic checks; the repository
builder; the python-backend model's engines against the NumPy reference. No server is started here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lab_utils.serving import repository as triton_repo
from lab_utils.serving.backend import model as triton_model
from lab_utils.serving.repository import (
    ConfigError,
    check_model_config,
    config_text,
    mlp_config,
    parse_config,
    validate_config,
)

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"INPUT__0": ["batch", 64]}  # what the exported ONNX model declares


def fields(problems):
    return [f for f, _ in problems]


def test_values_round_trip_through_pbtxt():
    cfg = mlp_config("mlp", dynamic_batching={"preferred_batch_size": [8, 16], "max_queue_delay_microseconds": 200},
                     instances=2, version_policy={"specific": {"versions": [1, 3]}})
    text = config_text(cfg)
    assert 'backend: "python"' in text and "max_queue_delay_microseconds: 200" in text
    assert "preferred_batch_size: 8" in text and "kind: KIND_CPU" in text and "count: 2" in text
    back = triton_repo.parse_config(text)
    assert back.dynamic_batching.max_queue_delay_microseconds == 200
    assert list(back.version_policy.specific.versions) == [1, 3]
    assert list(back.input[0].dims) == [64]


@pytest.mark.parametrize(("bad", "field"), [
    ('name: "m"\nmax_batch: 8', "max_batch"),
    ('name: "m"\ninstance_group [{ kind: KIND_TPU }]', "kind"),
    ('name: "m"\ninput [{ name: "x" data_type: FP32 dims: [4] }]', "data_type"),
    ('name: "m"\nmax_batch_size: "eight"', "max_batch_size"),
])
def test_schema_refuses_with_the_field_named(bad, field):
    with pytest.raises(ConfigError) as err:
        parse_config(bad, where="m/config.pbtxt")
    assert field in str(err.value) and "m/config.pbtxt" in str(err.value)
    assert err.value.problems and field in err.value.problems[0][0] + str(err.value)


def test_values_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="max_batch"):
        parse_config({"name": "m", "max_batch": 8})
    with pytest.raises(ConfigError, match="KIND_TPU"):
        parse_config({"name": "m", "instance_group": [{"kind": "KIND_TPU"}]})


def test_semantic_checks():
    ok = mlp_config("mlp", dynamic_batching={"preferred_batch_size": [8, 16]})
    assert check_model_config(ok, gpus=0, model_shapes=SHAPES) == []
    # batch dimension written into dims although max_batch_size adds it
    cfg = mlp_config("mlp")
    cfg["input"][0]["dims"] = [-1, 64]
    problems = check_model_config(cfg, gpus=0, model_shapes=SHAPES)
    assert fields(problems) == ["input[0].dims"] and "includes the batch dimension" in problems[0][1]
    assert "[64]" in problems[0][1]
    # max_batch_size 0 needs the full shape
    cfg = mlp_config("mlp", max_batch_size=0)
    cfg["input"][0]["dims"] = [64]
    problems = check_model_config(cfg, gpus=0, model_shapes=SHAPES)
    assert fields(problems) == ["input[0].dims"] and "[-1, 64]" in problems[0][1]
    # preferred size above the maximum; dynamic batching without batching
    bad = mlp_config("mlp", max_batch_size=8, dynamic_batching={"preferred_batch_size": [4, 16]})
    assert fields(check_model_config(bad, gpus=0)) == ["dynamic_batching.preferred_batch_size[1]"]
    bad = mlp_config("mlp", max_batch_size=0, dynamic_batching=True)
    assert "dynamic_batching" in fields(check_model_config(bad, gpus=0))
    # KIND_GPU where there is no GPU; a GPU index that does not exist
    problems = check_model_config(mlp_config("mlp", kind="KIND_GPU"), gpus=0)
    assert fields(problems) == ["instance_group[0].kind"] and "KIND_CPU" in problems[0][1]
    assert check_model_config(mlp_config("mlp", kind="KIND_GPU"), gpus=1) == []
    two = mlp_config("mlp", kind="KIND_GPU")
    two["instance_group"][0]["gpus"] = [1]
    assert fields(check_model_config(two, gpus=1)) == ["instance_group[0].gpus"]
    # the rest: no backend, a contradicting backend, duplicate names, a zero dimension
    assert "backend" in fields(check_model_config({"name": "m", "max_batch_size": 1, "input": ok["input"],
                                             "output": ok["output"]}, gpus=0))
    clash = dict(ok, platform="onnxruntime_onnx")
    assert "backend" in fields(check_model_config(clash, gpus=0))
    dup = mlp_config("mlp")
    dup["input"].append(dict(dup["input"][0]))
    assert "input[1].name" in fields(check_model_config(dup, gpus=0))
    zero = mlp_config("mlp")
    zero["input"][0]["dims"] = [0]
    assert "input[0].dims[0]" in fields(check_model_config(zero, gpus=0))


def test_validate_config_lists_every_problem():
    bad = mlp_config("mlp", max_batch_size=4, kind="KIND_GPU", dynamic_batching={"preferred_batch_size": [8]})
    with pytest.raises(ConfigError) as err:
        validate_config(bad, gpus=0, where="repo/mlp/config.pbtxt")
    text = str(err.value)
    assert "instance_group[0].kind" in text and "preferred_batch_size[0]" in text
    assert text.startswith("model 'mlp' (repo/mlp/config.pbtxt) is invalid")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    triton_repo.build_mlp_model(repo, "mlp", versions=(1, 2), preset={"in_features": 64, "width": 16, "depth": 2,
                                                                      "out_features": 10}, gpus=0)
    return repo


def test_built_repository_validates(built):
    entries = triton_repo.validate_repository(built, gpus=0)
    assert entries["mlp"].versions == [1, 2]
    for v in (1, 2):
        assert {p.name for p in (built / "mlp" / str(v)).iterdir()} >= {"model.py", "model.onnx", "weights.npz"}
    assert triton_repo.onnx_input_shapes(built / "mlp" / "1" / "model.onnx") == {"INPUT__0": ["batch", 64]}


def test_repository_problems_named(built, tmp_path):
    import shutil

    repo = tmp_path / "r"
    shutil.copytree(built, repo)
    (repo / "mlp" / "2" / "model.py").unlink()
    with pytest.raises(ConfigError, match=r"version 2: model\.py is missing"):
        triton_repo.validate_repository(repo, gpus=0)
    # with version_policy latest-1 only version 2 is served; policy 'specific: [1]' serves version 1 only
    triton_repo.write_config(repo / "mlp", mlp_config("mlp", version_policy={"specific": {"versions": [1]}}), gpus=0)
    triton_repo.validate_repository(repo, gpus=0)
    with pytest.raises(ConfigError, match="version 3 has no folder"):
        triton_repo.write_config(repo / "mlp", mlp_config("mlp", version_policy={"specific": {"versions": [3]}}),
                                 gpus=0)
    cfg = mlp_config("mlp")
    cfg["input"][0]["dims"] = [-1, 64]
    (repo / "mlp" / "config.pbtxt").write_text(config_text(cfg))
    with pytest.raises(ConfigError, match="includes the batch dimension"):
        triton_repo.validate_repository(repo, gpus=0)
    (repo / "mlp" / "config.pbtxt").write_text(config_text(mlp_config("other")))
    with pytest.raises(ConfigError, match="differs from its folder"):
        triton_repo.validate_repository(repo, gpus=0)
    (repo / "mlp" / "config.pbtxt").unlink()
    with pytest.raises(ConfigError, match="no config.pbtxt"):
        triton_repo.validate_repository(repo, gpus=0)
    with pytest.raises(ConfigError, match="no model folder 'nope'"):
        triton_repo.validate_repository(built, models=["nope"], gpus=0)


def test_write_config_writes_nothing_when_invalid(tmp_path):
    d = tmp_path / "mlp"
    with pytest.raises(ConfigError):
        triton_repo.write_config(d, mlp_config("mlp", kind="KIND_GPU"), gpus=0)
    assert not (d / "config.pbtxt").exists()


def test_ngc_configurations_validate(tmp_path, built):
    out = triton_repo.write_ngc_repository(tmp_path, built / "mlp" / "1" / "model.onnx")
    onnx_cfg = parse_config((out["onnx"] / "config.pbtxt").read_text())
    trt_cfg = parse_config((out["trt"] / "config.pbtxt").read_text())
    assert onnx_cfg.platform == "onnxruntime_onnx" and trt_cfg.platform == "tensorrt_plan"
    # the ONNX model's shapes agree with the config (the batch dimension left out)
    triton_repo.validate_model_dir(out["onnx"], gpus=1)
    assert triton_repo.model_file(trt_cfg) == "model.plan"


def test_every_committed_config_validates():
    files = subprocess.run(["git", "ls-files", "*config.pbtxt"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert files, "the course commits the NGC repository's configurations"
    for f in files:
        path = ROOT / f
        cfg = validate_config(path.read_text(), gpus=1, model_dir=path.parent, where=f)
        assert cfg.name == path.parent.name


def test_committed_ngc_configs_are_what_the_builder_writes(tmp_path):
    out = triton_repo.write_ngc_repository(tmp_path)
    for d in out.values():
        committed = ROOT / "lab_utils" / "data" / "triton_ngc" / d.name / "config.pbtxt"
        assert committed.read_text() == (d / "config.pbtxt").read_text(), "regenerate: triton_repo.write_ngc_repository"


# --- the python-backend model ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["onnxruntime", "torch", "numpy"])
def test_model_engines_match_the_reference(built, engine):
    vdir = built / "mlp" / "1"
    runner = triton_model.MlpRunner(vdir, engine=engine, device="cpu")
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    np.testing.assert_allclose(runner(x), triton_repo.reference_mlp(vdir, x), rtol=1e-4, atol=1e-5)
    assert triton_model.MlpRunner(vdir, engine="auto", device="cpu").engine == "onnxruntime"


def test_versions_differ(built):
    x = np.ones((1, 64), np.float32)
    assert not np.allclose(triton_repo.reference_mlp(built / "mlp" / "1", x),
                           triton_repo.reference_mlp(built / "mlp" / "2", x))


class _FakeTensor:
    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    def as_numpy(self):
        return np.zeros_like(self.a)  # what Triton 2.51's stub gives with NumPy 2


class _Capsule:
    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kw):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # CPU


class _FakePb:
    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        @classmethod
        def from_dlpack(cls, name, capsule):
            return cls(name, np.from_dlpack(_Capsule(capsule)).copy())

    class InferenceResponse:
        def __init__(self, tensors):
            self.tensors = tensors

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request[name]


def test_execute_batches_requests_and_crosses_by_dlpack(built, monkeypatch):
    import json
    import sys

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _FakePb)
    m = triton_model.TritonPythonModel()
    cfg = json.loads(json.dumps({"input": [{"name": "INPUT__0", "dims": ["64"]}], "output": [{"name": "OUTPUT__0"}],
                                 "parameters": {"engine": {"string_value": "onnxruntime"}}}))
    m.initialize({"model_config": json.dumps(cfg), "model_instance_kind": "CPU", "model_instance_device_id": "0",
                  "model_repository": str(built / "mlp"), "model_version": "1"})
    calls = []
    real = m.model.__call__
    monkeypatch.setattr(m, "model", lambda x: calls.append(x.shape) or real(x))
    xs = [np.random.rand(n, 64).astype(np.float32) for n in (1, 3, 2)]
    out = m.execute([{"INPUT__0": _FakeTensor(x)} for x in xs])
    assert calls == [(6, 64)]  # one run for the three requests
    for x, resp in zip(xs, out, strict=True):
        np.testing.assert_allclose(resp.tensors[0].array, triton_repo.reference_mlp(built / "mlp" / "1", x),
                                   rtol=1e-4, atol=1e-5)


def test_python_model_without_torch(tmp_path):
    """What the lab's checks deploy: NumPy weights, the course's model.py on its numpy engine, a valid config."""
    sizes = {"in_features": 4, "width": 8, "depth": 2, "out_features": 3}
    cfg = mlp_config("small", in_features=4, out_features=3, max_batch_size=8)
    cfg["parameters"]["engine"] = {"string_value": "numpy"}
    model_dir = triton_repo.write_python_model(tmp_path, cfg, sizes=sizes, seed=2)
    assert sorted(p.name for p in (model_dir / "1").iterdir()) == ["__pycache__", "model.py", "weights.npz"]
    # compiled beside it: the stub writes no bytecode into the folder, so an unchanged model is not reloaded
    assert list((model_dir / "1" / "__pycache__").glob(f"model.{sys.implementation.cache_tag}.pyc"))
    assert (model_dir / "1" / "model.py").read_text() == triton_model.source()
    triton_repo.validate_model_dir(model_dir, gpus=0)
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    y = triton_model.MlpRunner(model_dir / "1", engine="numpy")(x)
    assert y.shape == (5, 3) and y.dtype == np.float32 and 0.01 < np.abs(y).max() < 10  # activations of order one
    np.testing.assert_allclose(y, triton_repo.reference_mlp(model_dir / "1", x), rtol=1e-5, atol=1e-6)
    again = triton_repo.save_mlp_weights(tmp_path / "again", seed=2, **sizes)
    with np.load(again) as a, np.load(model_dir / "1" / "weights.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in b.files)  # seeded
