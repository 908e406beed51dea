"""Shared by the Triton tests: the server requirement (skip, or fail under NVLAB_REQUIRE_TRITON=1) and a tiny
python-backend model repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab_utils.procs import env_flag
from lab_utils.serving import repository as triton_repo
from lab_utils.serving import server as triton_server
from lab_utils.serving.server import ServerNotFound, find_server

REQUIRE_ENV = "NVLAB_REQUIRE_TRITON"
TINY = {"in_features": 4, "width": 8, "depth": 1, "out_features": 3}


def require_server():
    """The local server binary; skips without one, fails when NVLAB_REQUIRE_TRITON=1 (CI installs it)."""
    try:
        return find_server(local=True)
    except ServerNotFound as err:
        if env_flag(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but no Triton server binary was found:\n{err}")
        pytest.skip(f"no Triton server binary: {err}")


def tiny_repo(root: Path, name: str = "tiny", **config) -> Path:
    """A repository with one tiny MLP (python backend, ONNX Runtime); built in about a second."""
    repo = root / "repo"
    triton_repo.build_mlp_model(repo, name, preset=TINY, gpus=0, **config)
    return repo


@pytest.fixture(autouse=True)
def quick_stop(monkeypatch):
    """Tests stop servers many times: a short grace before SIGKILL (what a stop leaves is tested, not its pace)."""
    monkeypatch.setattr(triton_server, "DEFAULT_STOP_GRACE_S", 0.3)
