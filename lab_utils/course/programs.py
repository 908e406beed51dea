"""Where the programs the course runs are (``find_prometheus``, ``find_trtexec``, ``find_nginx``,
``find_perf_analyzer``, ``find_jupyter_lab``: a path, or None), and which components are installed here (TensorRT,
ONNX Runtime, ModelOpt, a Triton server, Prometheus), with what is missing and how to get it."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lab_utils.course.stack import dist_version
from lab_utils.procs import EnvError, env_url


@dataclass
class Component:
    name: str
    present: bool
    version: str | None = None
    where: str | None = None
    note: str = ""


def run_text(cmd: list[str], timeout: float = 20) -> str | None:
    """What ``cmd`` prints on stdout; None when it fails, cannot start or takes over ``timeout`` seconds."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


# --- programs: where each one the course runs is -------------------------------------------------
# One form, ``find_<program>(...) -> str | None``: the path of an executable, None when there is none. The modules
# that run a program import its finder from here.

PROMETHEUS_ENV = "NVLAB_PROMETHEUS"  # a prometheus binary off the PATH, or "none" to act as if none were installed
PROMETHEUS_INSTALL = ("Install Prometheus (it brings promtool): Debian/Ubuntu `sudo apt-get install prometheus`, "
                      "macOS `brew install prometheus`; the course container ships it, and the compose stack runs "
                      "it as its `prometheus` service")


def _executable(path: str | os.PathLike[str]) -> str | None:
    return str(path) if os.path.isfile(path) and os.access(path, os.X_OK) else None


def _find(name: str, setting: str = "", search: Sequence[str | os.PathLike[str]] = ()) -> str | None:
    """The program ``name``: ``setting`` (an env variable's value) when set, None unless it is an executable file
    ("none" hides the program, to try a lab's path without it); else on the PATH, else the first of ``search``."""
    if setting.lower() == "none":
        return None
    if setting:
        return _executable(setting)
    return shutil.which(name) or next(filter(None, map(_executable, search)), None)


def find_prometheus(name: str = "prometheus") -> str | None:
    """``prometheus`` or ``promtool`` (beside ``$NVLAB_PROMETHEUS`` when that is set), as ``_find``."""
    env = os.environ.get(PROMETHEUS_ENV, "").strip()
    if env and env.lower() != "none" and name != "prometheus":
        env = str(Path(env).with_name(name))
    return _find(name, env)


# Where NGC images (TensorRT, PyTorch) keep trtexec when it is not on the PATH: it ships with TensorRT's
# samples, outside the PATH in some images. Searched after the PATH, in this order.
TRTEXEC_CANDIDATES: tuple[Path, ...] = (Path("/opt/tensorrt/bin/trtexec"), Path("/usr/src/tensorrt/bin/trtexec"))


def find_trtexec() -> str | None:
    """``trtexec``, as ``_find``: None without TensorRT, or with a TensorRT installed as Python wheels only."""
    return _find("trtexec", search=TRTEXEC_CANDIDATES)


NGINX_ENV = "NVLAB_NGINX"  # the path of an nginx binary, or "none" to try a lab's no-nginx path
# Searched after the PATH: Debian puts nginx in /usr/sbin, which is not on a normal user's PATH.
NGINX_SEARCH = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx", "/opt/homebrew/bin/nginx")


def find_nginx() -> str | None:
    """``nginx`` (``$NVLAB_NGINX``, the PATH, ``NGINX_SEARCH``), as ``_find``."""
    return _find("nginx", os.environ.get(NGINX_ENV, "").strip(), NGINX_SEARCH)


def find_perf_analyzer() -> str | None:
    """``perf_analyzer`` inside its wheel (the wheel's console script drops the exit code), else on the PATH (NGC
    SDK image); whether it runs here is ``lab_utils.serving.perf_analyzer.perf_analyzer_status``."""
    try:
        spec = importlib.util.find_spec("perf_analyzer")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = os.path.join(folder, "bin", "perf_analyzer")
        if os.path.isfile(binary):
            return binary
    return shutil.which("perf_analyzer")


def find_jupyter_lab() -> str | None:
    """``jupyter-lab`` beside this interpreter (a venv used without activating it), else on PATH."""
    # not resolved: a venv's python is a symlink
    return _executable(Path(sys.executable).parent / "jupyter-lab") or shutil.which("jupyter-lab")


def pytriton_server() -> Path | None:
    """The ``tritonserver`` binary inside the installed ``nvidia-pytriton`` wheel, if any."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "tritonserver" / "bin" / "tritonserver"
    return binary if binary.exists() else None


def tensorrt_runtime_present() -> bool:
    """True when ``import tensorrt`` gives the real runtime, not ``tensorrt-stubs``' namespace folder (no origin)."""
    spec = importlib.util.find_spec("tensorrt")
    return spec is not None and spec.origin not in (None, "namespace")


def _tensorrt_component() -> Component:
    """Which TensorRT is here and where from: the Python module (its folder and the wheel that installed it) and
    trtexec; what is missing and how to get it otherwise."""
    trtexec = find_trtexec()
    tool = f"trtexec {trtexec}" if trtexec else ""
    if tensorrt_runtime_present():
        spec = importlib.util.find_spec("tensorrt")
        folder = str(Path(spec.origin).parent) if spec and spec.origin else "?"
        dists = [(n, v) for n in ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu13-bindings",
                                  "tensorrt-cu12-bindings") if (v := dist_version(n))]
        wheel = f"pip {dists[0][0]} {dists[0][1]}" if dists else "not from pip (a system or NGC install)"
        note = f"Python module {folder} ({wheel})" + (f"; {tool}" if tool else "; no trtexec")
        return Component("TensorRT", True, dists[0][1] if dists else None, folder, note)
    stubs = " (only tensorrt-stubs, type stubs, is installed)" if importlib.util.find_spec("tensorrt") else ""
    how = "./course installs it on a GPU machine (pip install tensorrt-cu13); in an NGC PyTorch image it is included"
    if trtexec:
        return Component("TensorRT", False, None, str(trtexec),
                         f"{tool} but no Python module{stubs}: the lab's engines need `import tensorrt`; {how}")
    return Component("TensorRT", False, None, None, f"not installed{stubs}; {how}")


MODELOPT_INSTALL = "pip install nvidia-modelopt"
# What ModelOpt's ONNX path imports besides modelopt itself (module -> pip name). Its wheel does not bring them, and
# nvidia-modelopt[onnx] would pull onnxruntime-gpu and cupy: the course installs them one by one (the lab extra).
MODELOPT_ONNX_NEEDS = {"onnx": "onnx", "onnxruntime": "onnxruntime", "onnx_graphsurgeon": "onnx-graphsurgeon",
                       "onnxconverter_common": "onnxconverter-common", "onnxslim": "onnxslim", "lief": "lief",
                       "polygraphy": "polygraphy"}


def _failure(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else '-'}"


def findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails to import; a module set to None in sys.modules
        return False


def _onnxruntime_component() -> Component:
    """ONNX Runtime, imported (a tenth of a second): lab 03 runs every ONNX file in it."""
    try:
        import onnxruntime as ort
    except Exception as err:  # ImportError, or a wheel whose shared library does not load
        return Component("ONNX Runtime", False, None, None,
                         f"`import onnxruntime` failed ({_failure(err)}): pip install onnxruntime")
    return Component("ONNX Runtime", True, getattr(ort, "__version__", None), str(Path(ort.__file__).parent),
                     f"providers: {', '.join(ort.get_available_providers())}")


def _modelopt_component() -> Component:
    """ModelOpt's ONNX path: ``import modelopt``, and each module that path imports found (importing ``modelopt.onnx``
    takes seconds: ``lab_utils.inference.quantize.modelopt_status`` does it where the lab quantizes)."""
    try:
        import modelopt
    except Exception as err:  # ImportError, or an install broken in another way: the reason is kept
        return Component("ModelOpt", False, None, None, f"`import modelopt` failed ({_failure(err)}): "
                                                        f"{MODELOPT_INSTALL}")
    if getattr(modelopt, "__file__", None) is None:  # a namespace package: a folder without ModelOpt's code
        return Component("ModelOpt", False, None, None, f"`modelopt` is an empty namespace package here: "
                                                        f"{MODELOPT_INSTALL}")
    version = getattr(modelopt, "__version__", None) or dist_version("nvidia-modelopt")
    where = str(Path(modelopt.__file__).parent)
    if lacking := [pip for module, pip in MODELOPT_ONNX_NEEDS.items() if not findable(module)]:
        return Component("ModelOpt", False, version, where,
                         f"its ONNX path needs {', '.join(lacking)}: pip install {' '.join(lacking)}")
    return Component("ModelOpt", True, version, where, "ONNX path: AutoCast, INT8/FP8 quantization")


def probe_components() -> dict[str, Component]:
    comps = {"tensorrt": _tensorrt_component(), "onnxruntime": _onnxruntime_component(),
             "modelopt": _modelopt_component()}
    try:
        url, bad_url = env_url("TRITON_URL", default_port=8000), ""
    except EnvError as err:  # the report shows it; the lab's own read raises it
        url, bad_url = None, str(err)
    if bad_url:
        comps["tritonserver"] = Component("Triton server", False, None, os.environ.get("TRITON_URL"), bad_url)
    elif url:
        comps["tritonserver"] = Component("Triton server", True, None, url, "external server (TRITON_URL)")
    elif on_path := shutil.which("tritonserver"):
        comps["tritonserver"] = Component("Triton server", True, os.environ.get("TRITON_SERVER_VERSION"), on_path,
                                          "on the PATH")
    elif wheel := pytriton_server():
        comps["tritonserver"] = Component("Triton server", True, f"nvidia-pytriton {dist_version('nvidia-pytriton')}",
                                          str(wheel), "binary from the nvidia-pytriton wheel (python backend only)")
    else:
        comps["tritonserver"] = Component("Triton server", False, None, None, "pip install nvidia-pytriton")
    # Lab 05 runs its own Prometheus (it kills and restarts its own Triton) and grades PromQL with promtool, so
    # "present" means both binaries; the compose stack's server ($PROMETHEUS_URL) is noted, not counted.
    try:
        purl = env_url("PROMETHEUS_URL", default_port=9090, path_ok=True)
        also = f"; PROMETHEUS_URL={purl} is the compose stack's server" if purl else ""
    except EnvError as err:
        purl, also = None, f"; {err}"
    prom, promtool = find_prometheus("prometheus"), find_prometheus("promtool")
    if prom and promtool:
        out = run_text([prom, "--version"], timeout=10) or ""
        m = re.search(r"version\s+([\w.\-+]+)", out)
        how = f"${PROMETHEUS_ENV}" if os.environ.get(PROMETHEUS_ENV) else "on the PATH"
        comps["prometheus"] = Component("Prometheus", True, m.group(1) if m else None, prom, how + also)
    else:
        lacking = " and ".join(n for n, b in (("prometheus", prom), ("promtool", promtool)) if not b)
        comps["prometheus"] = Component("Prometheus", False, None, purl,
                                        f"{lacking} not found{also}. {PROMETHEUS_INSTALL}")
    return comps
