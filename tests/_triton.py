"""Shared by the Triton tests: the server requirement (skip, or fail under NVLAB_REQUIRE_TRITON=1) and a tiny
python-backend model repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab_utils.procs import env_flag
from lab_utils.serving import repository as triton_repo
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


def require_service():
    """What lab 07's service needs (a Triton server, nginx, the python backend's NumPy-1 environment): skip without
    it, fail where CI requires it. Returns the server's source."""
    from lab_utils.compat import numpy1_env
    from lab_utils.serving import nginx as nginx_mod

    source = require_server()
    if not nginx_mod.available(show=False):
        if env_flag(nginx_mod.REQUIRE_ENV):
            pytest.fail(f"{nginx_mod.REQUIRE_ENV}=1 but {nginx_mod.missing()}")
        pytest.skip(f"nginx is not installed: {nginx_mod.missing()}")
    try:
        numpy1_env.stub_env(source, build=True)
    except (RuntimeError, OSError) as err:
        if env_flag(REQUIRE_ENV):
            pytest.fail(f"the python backend's NumPy-1 environment cannot be built: {err}")
        pytest.skip(f"the python backend's NumPy-1 environment is not built and cannot be: {err}")
    return source


class KernelOutput:
    """An ``execute_interactive`` output hook: the kernel's text and tracebacks, joined in ``text``."""

    def __init__(self):
        self.text = ""

    def __call__(self, msg):
        c = msg.get("content", {})
        self.text += c.get("text", "") + "".join(c.get("traceback", []) or [])
