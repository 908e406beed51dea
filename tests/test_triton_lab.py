"""Lab 04 against the compose stack's server: where models are written, and what is deployed there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lab_utils.serving import repository as triton_repo
from lab_utils.serving import server as triton_server
from lab_utils.serving import steps as triton_lab


def test_own_server_writes_under_the_work_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(triton_server.URL_ENV, raising=False)
    monkeypatch.setenv(triton_lab.REPOSITORY_ENV, str(tmp_path / "ignored"))
    assert triton_lab.model_repository(tmp_path) == tmp_path / "models"


def test_external_server_uses_the_shared_repository(tmp_path, monkeypatch):
    monkeypatch.setenv(triton_server.URL_ENV, "http://triton:8000")
    monkeypatch.setenv(triton_lab.REPOSITORY_ENV, str(tmp_path))
    assert triton_lab.model_repository(tmp_path / "work") == tmp_path


def test_external_server_without_a_shared_repository_says_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.setenv(triton_server.URL_ENV, "http://triton:8000")
    monkeypatch.delenv(triton_lab.REPOSITORY_ENV, raising=False)
    with pytest.raises(RuntimeError, match="NVLAB_MODEL_REPOSITORY is not.*unset TRITON_URL"):
        triton_lab.model_repository(tmp_path)
    monkeypatch.setenv(triton_lab.REPOSITORY_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="not a writable folder"):
        triton_lab.model_repository(tmp_path)


def test_external_server_gets_the_onnx_runtime_form_of_the_model(tmp_path):
    cfg = triton_repo.mlp_config("mlp", kind="KIND_GPU", dynamic_batching={"max_queue_delay_microseconds": 200})
    own = triton_lab.serving_config(cfg, SimpleNamespace(external=False))
    assert own == cfg
    ngc = triton_lab.serving_config(cfg, SimpleNamespace(external=True))
    assert ngc["platform"] == "onnxruntime_onnx" and "backend" not in ngc and "parameters" not in ngc
    assert ngc["dynamic_batching"] == cfg["dynamic_batching"] and ngc["instance_group"] == cfg["instance_group"]
    # valid for Triton's schema and the semantic checks, and served from the model.onnx the builder writes
    triton_repo.validate_config(ngc, gpus=1)
    assert triton_repo.model_file(triton_repo.parse_config(ngc)) == "model.onnx"
