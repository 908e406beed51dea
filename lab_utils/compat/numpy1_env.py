"""Works around: the pytriton wheel's Triton 2.51 python-backend stub, built against NumPy 1, corrupts TYPE_STRING
tensors under NumPy 2. Goes when: the course serves from the NGC tritonserver image or a wheel built against NumPy 2.

The execution environment (``EXECUTION_ENV_PATH``) that lab 07's pre- and postprocessing models run in on the wheel's
server: a venv of this Python holding only NumPy 1, with this venv's packages after it. ``stub_env(source)`` gives it
to ``lab_utils.serving.ensemble`` (None where the server needs none); ``nvlab stub-env`` builds it
once (``./course`` does).

Design notes: docs/internals.md#lab_utilscompatnumpy1_envpy"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Protocol

import numpy as np

STUB_ENV_DIR = "nvlab-triton-stub-env"  # under sys.prefix: tied to this venv's packages
STUB_NUMPY = "numpy<2"
STUB_PTH = "nvlab_main_site.pth"  # adds this venv's packages after the environment's own NumPy


class Source(Protocol):
    """What is read of a ``lab_utils.serving.server.ServerSource``: its kind ("url", "path" or "wheel")."""

    @property
    def kind(self) -> str: ...


def stub_env_needed(source: Source | None) -> bool:
    """True when the server's python backend would run under NumPy 2 with a NumPy-1 stub: the wheel's server,
    whose stub uses this interpreter's packages, and NumPy 2 here."""
    return source is not None and source.kind == "wheel" and int(np.__version__.split(".")[0]) >= 2


def default_stub_env() -> Path:
    return Path(sys.prefix) / STUB_ENV_DIR


def stub_env_ready(path: str | Path | None = None) -> bool:
    path = Path(path or default_stub_env())
    site = _stub_site(path)
    return (path / "bin" / "activate").is_file() and (site / STUB_PTH).is_file() and \
        any(site.glob("numpy-1.*.dist-info"))


def _stub_site(path: Path) -> Path:
    v = sys.version_info
    return path / "lib" / f"python{v.major}.{v.minor}" / "site-packages"


def build_stub_env(path: str | Path | None = None, numpy_spec: str = STUB_NUMPY, timeout_s: float = 300) -> Path:
    """The python backend's execution environment (``EXECUTION_ENV_PATH``), built once: a venv of this Python
    holding only NumPy 1 (pip, from the package index) and a ``.pth`` line that adds this venv's packages after it
    (Pillow, ONNX Runtime). Triton sources its ``bin/activate`` before it starts the stub. Returns its folder."""
    path = Path(path or default_stub_env())
    if stub_env_ready(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a lab and a test building at once: one builds, the other waits
        if not stub_env_ready(path):
            _build_stub_env(path, numpy_spec, timeout_s)
    return path


def _build_stub_env(path: Path, numpy_spec: str, timeout_s: float) -> None:
    shutil.rmtree(path, ignore_errors=True)  # a half-built one (interrupted): start again
    # Built where it stays: bin/activate holds the venv's own path, which a rename would leave pointing nowhere.
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, capture_output=True,
                       text=True, timeout=timeout_s)
        site = _stub_site(path)
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                              numpy_spec], capture_output=True, text=True, timeout=timeout_s)
        if pip.returncode != 0:
            raise RuntimeError(f"pip could not install {numpy_spec!r} for the python backend's environment (it needs "
                               f"the package index): {(pip.stderr or pip.stdout).strip()[-600:]}")
        main_site = sysconfig.get_paths()["purelib"]
        # written last: stub_env_ready() looks for it
        (site / STUB_PTH).write_text(f"import site; site.addsitedir({main_site!r})\n")
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def stub_env(source: Source | None, *, build: bool = False) -> Path | None:
    """The execution environment the pre/postprocessing models need on this server, or None when they need none.

    Missing and ``build`` False: ``RuntimeError`` with the command that builds it."""
    if not stub_env_needed(source):
        return None
    if stub_env_ready():
        return default_stub_env()
    if build:
        return build_stub_env()
    raise RuntimeError(f"the wheel's Triton python backend needs NumPy 1 for TYPE_STRING tensors (this Python has "
                       f"NumPy {np.__version__}), and {default_stub_env()} is not built: run "
                       f"`nvlab stub-env` once (pip installs {STUB_NUMPY!r} there)")
