"""Environment probe: GPUs, driver, CUDA ceiling, torch, topology, components, and each lab's tier; and where
the programs the course runs are (``find_prometheus``, ``find_trtexec``, ``find_nginx``, ``find_perf_analyzer``,
``find_jupyter_lab``: a path, or None).

NVML (``nvidia-ml-py``) is the primary source; ``nvidia-smi`` CSV is the fallback; with neither the
report says why and every lab runs in its CPU tier. Nothing here raises on a machine without a GPU."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from lab_utils import DATA_DIR
from lab_utils.course.catalog import LABS, repo_root
from lab_utils.course.stack import dist_version, manifest, ngc_images, pinned_release
from lab_utils.procs import EnvError, env_url

REQUIRED = ("numpy", "pandas", "matplotlib", "torch", "papermill", "nbformat", "ipykernel")

# NVML topology levels -> the abbreviations `nvidia-smi topo -m` prints.
_TOPO_LEVEL = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

_SMI_FIELDS = ("index,name,uuid,pci.bus_id,compute_cap,memory.total,clocks.max.sm,clocks.max.mem,power.limit,"
               "pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max,"
               "mig.mode.current,ecc.mode.current,driver_version")


@dataclass
class GpuInfo:
    index: int
    name: str
    uuid: str | None = None
    bus_id: str | None = None
    compute_capability: str | None = None  # "9.0"
    memory_total_mib: int | None = None
    max_sm_clock_mhz: int | None = None
    max_mem_clock_mhz: int | None = None
    power_limit_w: float | None = None
    pcie_gen: int | None = None  # current link; idle GPUs train down, so max is recorded too
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    nvlinks_active: int | None = None
    mig_mode: str | None = None  # "enabled", "disabled", or None where not supported
    ecc_mode: str | None = None


@dataclass
class Component:
    name: str
    present: bool
    version: str | None = None
    where: str | None = None
    note: str = ""


@dataclass
class LabTier:
    lab: str
    title: str
    tier: str  # "full", "partial", "cpu"
    runs: str  # what it runs here
    substitutes: str  # what stands in for what is missing ("" in the full tier)
    notebook: bool  # whether the notebook exists in this checkout


@dataclass
class EnvReport:
    source: str  # "nvml", "nvidia-smi" or "none"
    driver_version: str | None
    cuda_ceiling: str | None  # newest CUDA the driver supports, "13.0"
    gpus: list[GpuInfo]
    topology: dict[str, Any] | None  # {"labels": [...], "matrix": [[...]], "source": ...}
    torch: dict[str, Any] | None
    components: dict[str, Component]
    compatible: bool | None  # None: no GPU to be compatible with
    reasons: list[str]
    notes: list[str]
    missing: list[str]  # required Python packages not importable
    tiers: list[LabTier] = field(default_factory=list)
    host: dict[str, Any] = field(default_factory=dict)

    @property
    def gpu_usable(self) -> bool:
        """True when torch can run CUDA work on the GPUs found."""
        return bool(self.gpus and self.torch and self.torch.get("cuda_available") and self.compatible)

    @property
    def can_run(self) -> bool:
        """True when every lab can run in some tier: Python and the required packages are there."""
        return not self.missing and sys.version_info >= (3, 10)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_usable"] = self.gpu_usable
        d["can_run"] = self.can_run
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


# --- parsing what nvidia-smi prints (also used on the H200 captures in lab 00) -------------------


def parse_smi_header(text: str) -> dict[str, str | None]:
    """Driver version and CUDA ceiling from the banner of plain ``nvidia-smi`` output."""
    drv = re.search(r"Driver Version:\s*([\d.]+)", text)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", text)
    return {"driver_version": drv.group(1) if drv else None, "cuda_ceiling": cuda.group(1) if cuda else None}


def _num(text: str | None, kind: type = int) -> Any:
    if text is None:
        return None
    if (t := text.strip().split(" ")[0]) in ("", "[N/A]", "N/A", "[Not Supported]", "Not", "[Unknown"):
        return None
    try:
        return kind(float(t)) if kind is int else kind(t)
    except ValueError:
        return None


def _mode(text: str | None) -> str | None:
    t = (text or "").strip().lower()
    return t if t in ("enabled", "disabled") else None


def parse_smi_csv(text: str) -> list[GpuInfo]:
    """GPUs from ``nvidia-smi --query-gpu=<_SMI_FIELDS> --format=csv`` (header optional, units optional)."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r and any(c.strip() for c in r)]
    if rows and not rows[0][0].strip().isdigit():
        header = [h.strip().split(" ")[0] for h in rows[0]]
        rows = rows[1:]
    else:
        header = _SMI_FIELDS.split(",")
    gpus = []
    for i, row in enumerate(rows):
        f = {h: c.strip() for h, c in zip(header, row, strict=False)}
        gpus.append(GpuInfo(index=_num(f.get("index")) if f.get("index") else i, name=f.get("name", "?"),
                            uuid=f.get("uuid"), bus_id=f.get("pci.bus_id"), compute_capability=f.get("compute_cap"),
                            memory_total_mib=_num(f.get("memory.total")), max_sm_clock_mhz=_num(f.get("clocks.max.sm")),
                            max_mem_clock_mhz=_num(f.get("clocks.max.mem")),
                            power_limit_w=_num(f.get("power.limit"), float),
                            pcie_gen=_num(f.get("pcie.link.gen.current")),
                            pcie_width=_num(f.get("pcie.link.width.current")),
                            pcie_gen_max=_num(f.get("pcie.link.gen.max")),
                            pcie_width_max=_num(f.get("pcie.link.width.max")),
                            mig_mode=_mode(f.get("mig.mode.current")), ecc_mode=_mode(f.get("ecc.mode.current"))))
    return gpus


def parse_topology(text: str) -> dict[str, Any]:
    """The device matrix of ``nvidia-smi topo -m``: labels (GPU0, NIC0, ...) and cells (X, NV18, PIX, SYS...)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    if (header_i := next((i for i, ln in enumerate(lines) if re.match(r"^\s+(GPU|NIC)\d", ln)), None)) is None:
        raise ValueError("no topology matrix found: expected the output of `nvidia-smi topo -m`")
    labels = [t for t in lines[header_i].split() if re.fullmatch(r"(GPU|NIC)\d+", t)]
    matrix = []
    for ln in lines[header_i + 1 :]:
        cells = ln.split()
        if not cells or cells[0] not in labels:
            break
        matrix.append(cells[1 : 1 + len(labels)])
    return {"labels": labels[: len(matrix)], "matrix": matrix, "source": "nvidia-smi topo -m"}


def decode_cuda_version(v: int) -> str:
    """NVML's integer CUDA version (e.g. 13000, 12040) as "13.0", "12.4"."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def version_tuple(v: str | None) -> tuple[int, ...]:
    """"12.10" -> (12, 10): numeric, so 12.10 sorts after 12.4 (a string comparison gets this wrong)."""
    return tuple(int(p) for p in re.findall(r"\d+", v or ""))


def _arch_cc(entry: str) -> tuple[str, int, int, str] | None:
    """'sm_86' -> ('sm', 8, 6, ''); 'compute_90a' -> ('compute', 9, 0, 'a'); 'sm_120' -> ('sm', 12, 0, '')."""
    m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", entry.strip())
    return (m[1], int(m[2]), int(m[3]), m[4]) if m else None


def arch_support(compute_capability: str | tuple[int, int], arch_list: Sequence[str]) -> tuple[str, str | None]:
    """Whether code built for ``arch_list`` (``torch.cuda.get_arch_list()``) runs on a GPU of ``compute_capability``.

    Returns ``("native", entry)`` when a cubin (SASS) runs on it, ``("ptx", entry)`` when only PTX does (the driver
    JIT-compiles it at first use: a slow first start), ``("none", None)`` when nothing does (CUDA's "no kernel image
    is available"). CUDA's binary compatibility: a cubin for X.y runs on X.z with z >= y (same major), so sm_80 runs
    on an A10 (8.6) and an L40S (8.9); an arch-specific cubin (sm_90a) runs only on X.y itself, a family-specific
    one (sm_100f) on X.z, z >= y. PTX for X.y is JIT-compiled for any GPU at or above X.y, across majors too."""
    cc = compute_capability if isinstance(compute_capability, tuple) else version_tuple(compute_capability)[:2]
    major, minor = cc
    native, ptx = [], []
    for entry in arch_list:
        parsed = _arch_cc(entry)
        if parsed is None:
            continue
        kind, x, y, suffix = parsed
        if suffix == "a":  # arch-specific features: that exact compute capability only
            runs = (x, y) == (major, minor)
        elif kind == "sm":
            runs = x == major and y <= minor
        else:
            runs = (x, y) <= (major, minor)
        if runs:
            (native if kind == "sm" else ptx).append(((x, y), entry))
    if native:
        return "native", max(native)[1]
    if ptx:
        return "ptx", max(ptx)[1]  # the newest PTX at or below the GPU: what the JIT starts from
    return "none", None


# --- sources -----------------------------------------------------------------------------------


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


_NVML_WHY = {
    "LIBRARY_NOT_FOUND": "libnvidia-ml.so was not found: no NVIDIA driver is installed (normal without an NVIDIA GPU)",
    "DRIVER_NOT_LOADED": "the NVIDIA kernel driver is not loaded: check `lsmod | grep nvidia`, or that the "
    "container was started with `--gpus all`",
    "NO_PERMISSION": "no permission to open /dev/nvidia*: run as a user in the video group, or fix the "
    "container's device mounts",
    "LIB_RM_VERSION_MISMATCH": "the driver library and the loaded kernel module differ in version: reboot "
    "after the driver update (or reload the nvidia modules)"}


def _nvml_error_text(err: Exception) -> str:
    import pynvml

    for key, why in _NVML_WHY.items():
        if getattr(err, "value", None) == getattr(pynvml, f"NVML_ERROR_{key}", object()):
            return f"NVML could not initialise: {why}"
    return f"NVML could not initialise ({err})"


def nvml_text(v: Any) -> str:
    """An NVML string: older pynvml versions return bytes, newer ones str."""
    return v.decode() if isinstance(v, bytes) else str(v)


def _probe_nvml(notes: list[str]) -> tuple[str | None, str | None, list[GpuInfo], dict[str, Any] | None] | None:
    try:
        import pynvml
    except ImportError:
        notes.append("nvidia-ml-py is not installed (pip install nvidia-ml-py): NVML not used")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        notes.append(_nvml_error_text(err))
        return None
    try:
        driver = nvml_text(pynvml.nvmlSystemGetDriverVersion())
        ceiling = decode_cuda_version(pynvml.nvmlSystemGetCudaDriverVersion())

        def opt(fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except pynvml.NVMLError:  # NOT_SUPPORTED on this GPU or in this VM: leave the field empty
                return None

        gpus, handles = [], []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            handles.append(h)
            cc = opt(pynvml.nvmlDeviceGetCudaComputeCapability, h)
            mem = opt(pynvml.nvmlDeviceGetMemoryInfo, h)
            power = opt(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
            mig = opt(pynvml.nvmlDeviceGetMigMode, h)
            ecc = opt(pynvml.nvmlDeviceGetEccMode, h)
            pci = opt(pynvml.nvmlDeviceGetPciInfo, h)
            links = 0
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                if (state := opt(pynvml.nvmlDeviceGetNvLinkState, h, link)) is None:
                    break
                links += int(state == pynvml.NVML_FEATURE_ENABLED)
            gpus.append(GpuInfo(index=i, name=nvml_text(pynvml.nvmlDeviceGetName(h)),
                                uuid=nvml_text(opt(pynvml.nvmlDeviceGetUUID, h)),
                                bus_id=nvml_text(pci.busId) if pci else None,
                                compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
                                memory_total_mib=mem.total // 2**20 if mem else None,
                                max_sm_clock_mhz=opt(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
                                max_mem_clock_mhz=opt(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM),
                                power_limit_w=power / 1000 if power else None,
                                pcie_gen=opt(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                                pcie_width=opt(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                                pcie_gen_max=opt(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                                pcie_width_max=opt(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h), nvlinks_active=links,
                                mig_mode=None if mig is None else ("enabled" if mig[0] else "disabled"),
                                ecc_mode=None if ecc is None else ("enabled" if ecc[0] else "disabled")))
        topo = None
        if len(handles) > 1:
            labels = [f"GPU{g.index}" for g in gpus]
            matrix = []
            for i, hi in enumerate(handles):
                row = []
                for j, hj in enumerate(handles):
                    if i == j:
                        row.append("X")
                    elif gpus[i].nvlinks_active and gpus[j].nvlinks_active:
                        # Through NVSwitch every link reaches every peer: nvidia-smi prints NV<links>.
                        row.append(f"NV{min(gpus[i].nvlinks_active, gpus[j].nvlinks_active)}")
                    else:
                        lvl = opt(pynvml.nvmlDeviceGetTopologyCommonAncestor, hi, hj)
                        row.append(_TOPO_LEVEL.get(lvl, "?") if lvl is not None else "?")
                matrix.append(row)
            topo = {"labels": labels, "matrix": matrix, "source": "NVML"}
        return driver, ceiling, gpus, topo
    finally:
        pynvml.nvmlShutdown()


def _probe_smi(notes: list[str]) -> tuple[str | None, str | None, list[GpuInfo], dict[str, Any] | None] | None:
    if not (smi := shutil.which("nvidia-smi")):
        notes.append("nvidia-smi is not on the PATH: no NVIDIA driver tools on this machine")
        return None
    if (text := _run([smi, f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"])) is None:
        notes.append("nvidia-smi is present but failed: the driver is not working (try `nvidia-smi` in a shell)")
        return None
    gpus = parse_smi_csv(text)
    header = parse_smi_header(_run([smi]) or "")
    if (driver := header["driver_version"]) is None:
        row = next(csv.reader(io.StringIO(text)), [])
        driver = row[-1].strip() if row else None
    return driver, header["cuda_ceiling"], gpus, _smi_topology(smi) if len(gpus) > 1 else None


def _smi_topology(smi: str) -> dict[str, Any] | None:
    """The matrix ``nvidia-smi topo -m`` prints; None when it fails or prints none."""
    with contextlib.suppress(ValueError):
        if text := _run([smi, "topo", "-m"]):
            return parse_topology(text)
    return None


def _probe_torch(notes: list[str]) -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        notes.append("torch is not installed: pip install torch (not inside an NGC image, which has its own)")
        return None
    info: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda, "cudnn": None, "nccl": None,
                            "cuda_available": False, "device_count": 0, "arch_list": []}
    if torch.version.cuda:
        info["cuda_available"] = torch.cuda.is_available()
        info["device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
        info["arch_list"] = torch.cuda.get_arch_list() if info["cuda_available"] else []
        info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL (e.g. Windows): the report says "none"
            info["nccl"] = None
    return info


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


def _findable(module: str) -> bool:
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
    providers = ", ".join(ort.get_available_providers())
    return Component("ONNX Runtime", True, getattr(ort, "__version__", None), str(Path(ort.__file__).parent),
                     f"providers: {providers}")


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
    if lacking := [pip for module, pip in MODELOPT_ONNX_NEEDS.items() if not _findable(module)]:
        return Component("ModelOpt", False, version, where,
                         f"its ONNX path needs {', '.join(lacking)}: pip install {' '.join(lacking)}")
    return Component("ModelOpt", True, version, where, "ONNX path: AutoCast, INT8/FP8 quantization")


def _probe_components() -> dict[str, Component]:
    comps: dict[str, Component] = {}
    comps["tensorrt"] = _tensorrt_component()
    comps["onnxruntime"] = _onnxruntime_component()
    comps["modelopt"] = _modelopt_component()
    try:
        url, bad_url = env_url("TRITON_URL", default_port=8000), ""
    except EnvError as err:  # the report shows it; the lab's own read raises it
        url, bad_url = None, str(err)
    on_path = shutil.which("tritonserver")
    wheel = pytriton_server()
    if bad_url:
        comps["tritonserver"] = Component("Triton server", False, None, os.environ.get("TRITON_URL"), bad_url)
    elif url:
        comps["tritonserver"] = Component("Triton server", True, None, url, "external server (TRITON_URL)")
    elif on_path:
        comps["tritonserver"] = Component("Triton server", True, os.environ.get("TRITON_SERVER_VERSION"), on_path,
                                          "on the PATH")
    elif wheel:
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
        out = _run([prom, "--version"], timeout=10) or ""
        m = re.search(r"version\s+([\w.\-+]+)", out)
        how = f"${PROMETHEUS_ENV}" if os.environ.get(PROMETHEUS_ENV) else "on the PATH"
        comps["prometheus"] = Component("Prometheus", True, m.group(1) if m else None, prom, how + also)
    else:
        lacking = " and ".join(n for n, b in (("prometheus", prom), ("promtool", promtool)) if not b)
        comps["prometheus"] = Component("Prometheus", False, None, purl,
                                        f"{lacking} not found{also}. {PROMETHEUS_INSTALL}")
    return comps


def _compatibility(gpus: list[GpuInfo], ceiling: str | None,
                   torch: dict[str, Any] | None) -> tuple[bool | None, list[str]]:
    if not gpus:
        return None, ["no NVIDIA GPU found: every lab runs in its CPU tier"]
    if torch is None:
        return False, ["torch is not installed, so no lab can use the GPU"]
    if not torch["cuda"]:
        return False, [f"torch {torch['version']} is a CPU-only build: install a CUDA build to use the GPU"]
    reasons, ok = [], True
    runtime = torch["cuda"]
    if ceiling is None:
        reasons.append("the driver's CUDA ceiling is unknown (no NVML, no nvidia-smi banner)")
    elif version_tuple(runtime) <= version_tuple(ceiling):
        reasons.append(f"driver supports CUDA <= {ceiling}; torch's runtime is CUDA {runtime}: compatible")
    elif version_tuple(runtime)[:1] == version_tuple(ceiling)[:1]:
        reasons.append(f"torch's CUDA {runtime} is newer than the driver's ceiling {ceiling} within one major version: "
                       "it runs through minor-version compatibility, but kernels needing a newer driver can fail; "
                       "update the driver to be safe")
    else:
        ok = False
        reasons.append(
            f"torch's CUDA {runtime} is newer than the driver's ceiling {ceiling}: update the driver, install "
            f"a torch built for CUDA <= {ceiling}, or use an NGC container (forward compatibility, data-centre GPUs)")
    arch = torch.get("arch_list") or []
    for g in gpus:
        if not g.compute_capability or not arch:
            continue
        cc = version_tuple(g.compute_capability)
        sm = f"sm_{cc[0]}{cc[1]}"
        how, via = arch_support(g.compute_capability, arch)
        if how == "native":
            reasons.append(f"GPU{g.index} {g.name}: compute capability {g.compute_capability} runs {via} code "
                           + ("(built in)" if via == sm else "(binary compatible: same major, older minor)"))
        elif how == "ptx":
            reasons.append(f"GPU{g.index}: no cubin for {sm}, runs through PTX JIT from {via} (slow first start)")
        else:
            ok = False
            reasons.append(f"GPU{g.index} {g.name}: compute capability {g.compute_capability} is not supported by this "
                           f"torch (built for {', '.join(arch)}; a cubin runs only within its major version, "
                           f"at or above its minor): install a torch build that includes {sm}")
    if ok and not torch["cuda_available"]:
        ok = False
        reasons.append("torch.cuda.is_available() is False although a GPU is present: check CUDA_VISIBLE_DEVICES")
    return ok, reasons


def lab_tiers(report: EnvReport) -> list[LabTier]:
    """The tier each lab will run in here, what it runs, and what stands in for what is missing."""
    gpu = report.gpu_usable
    n_gpu = report.torch["device_count"] if gpu and report.torch else 0
    seen_gpu = bool(report.gpus)
    low = "partial" if seen_gpu else "cpu"  # the tier of a lab that cannot use the GPU here
    c = report.components
    trt, server, prom = c["tensorrt"].present, c["tritonserver"].present, c["prometheus"].present
    lab_dir = repo_root() / "solutions"
    rows: dict[str, tuple[str, str, str]] = {}
    if report.source == "nvml":
        rows["00"] = ("full", "NVML inventory, topology and compatibility of this machine", "")
    elif seen_gpu:
        rows["00"] = ("partial", "inventory from nvidia-smi", "NVML fields missing from nvidia-smi's CSV")
    else:
        rows["00"] = ("cpu", "the reading exercises", "H200 captures shipped with the course stand in for nvidia-smi")
    if gpu:
        rows["01"] = ("full", "cuBLAS matmul sweep, HBM copy, PCIe, CUDA graphs", "")
    else:
        why = "GPU not usable by torch: " if seen_gpu else ""
        rows["01"] = (low, "CPU BLAS and DRAM bandwidth with the same harness",
                      why + "the H200 reference run is shown beside")
    # Triton the kernel language (not the Triton server): found, not imported (importing it takes seconds)
    triton_lang = _findable("triton")
    if gpu and triton_lang:
        rows["01b"] = ("full", "your Triton kernels compiled for this GPU and timed beside torch and cuBLAS; the CUDA "
                       "C++ add through CuPy", "")
    elif triton_lang:
        why = "GPU not usable by torch: " if seen_gpu else ""
        rows["01b"] = (low, "your Triton kernels checked in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors",
                       why + "the H200 reference run's bandwidths and TFLOP/s stand in for the timings")
    else:
        rows["01b"] = (low, "the kernels' text and the questions only",
                       "triton is not installed: pip install -e '.[kernels]'")
    if n_gpu >= 2 and report.torch and report.torch.get("nccl"):
        rows["02"] = ("full", f"NCCL across {n_gpu} GPUs, DDP", "")
    elif gpu:
        rows["02"] = ("partial", "NCCL on 1 GPU, DDP", "gloo processes for multi-rank collectives")
    else:
        rows["02"] = ("cpu", "gloo process groups on CPU, DDP", "gloo stands in for NCCL")
    # A component is named in a row only when it imported here; a report built without it has it absent.
    ort = c.get("onnxruntime", Component("ONNX Runtime", False, note="not probed"))
    mo = c.get("modelopt", Component("ModelOpt", False, note="not probed"))
    no_mo = "" if mo.present else f"no ModelOpt, so its FP16, INT8 and FP8 models are skipped ({mo.note})"
    if not ort.present:
        rows["03"] = (low, "nothing yet: the lab runs its ONNX files in ONNX Runtime", ort.note)
    elif gpu and trt and mo.present:
        rows["03"] = ("full", "TensorRT engines from ModelOpt FP16/INT8/FP8 ONNX files", "")
    elif gpu and trt:
        rows["03"] = ("partial", "TensorRT engines from the FP32 ONNX file; ONNX Runtime", no_mo)
    elif gpu:
        rows["03"] = ("partial", ("ModelOpt ONNX models in ONNX Runtime; " if mo.present else "ONNX Runtime; ")
                      + "torch autocast, torch.compile, CUDA graphs",
                      "; ".join(filter(None, ["no TensorRT: torch.compile and CUDA graphs stand in for engines",
                                              no_mo])))
    else:
        rows["03"] = ("cpu", ("ModelOpt FP16/INT8 ONNX models; " if mo.present else "")
                      + "ONNX Runtime optimization levels",
                      "; ".join(filter(None, ["no GPU: ONNX Runtime on the CPU stands in for TensorRT", no_mo])))
    wheel_only = server and c["tritonserver"].where == str(pytriton_server())
    no_server = (low, "nothing yet: the lab needs a Triton server",
                 "no Triton server: pip install --no-deps nvidia-pytriton")
    via = "; the nvidia-pytriton server (python backend only) stands in for the NGC image" if wheel_only else ""
    if gpu and server and wheel_only:  # a stand-in is not the full lab: no ONNX Runtime/TensorRT backends
        rows["04"] = ("partial", "Triton server, KIND_GPU instances (torch on the GPU)", via.removeprefix("; "))
    elif gpu and server:
        rows["04"] = ("full", "Triton server, KIND_GPU instances (torch on the GPU)", "")
    elif server:
        rows["04"] = (low, "Triton server, KIND_CPU instances (ONNX Runtime)", "CPU instances" + via)
    else:
        rows["04"] = (low, "configuration checks only, no serving", "no Triton server: set TRITON_URL, use the NGC "
                      "tritonserver image, or pip install --no-deps nvidia-pytriton")
    if gpu and server and prom:
        rows["05"] = ("full", "Prometheus scraping Triton and the GPUs (NVML, DCGM), alerts, failure drill", "")
    elif server and prom:
        rows["05"] = (low, "Triton, Prometheus, PromQL, alerts and the failure drill",
                      "host CPU and memory stand in for GPU metrics")
    elif server:
        rows["05"] = (low, "Triton's /metrics, health checks and the watchdog; PromQL, alerts and their checks need "
                      "Prometheus", ("" if gpu else "host CPU and memory stand in for GPU metrics; ")
                      + f"Prometheus is missing. {PROMETHEUS_INSTALL}")
    else:
        rows["05"] = no_server
    ncu = shutil.which("ncu") is not None
    if gpu:
        rows["06"] = ("full", "torch.profiler traces with CUDA kernels; four bottlenecks fixed; OOM, memory snapshot "
                      "and async errors" + ("; ncu Speed of Light" if ncu else ""),
                      "" if ncu else "no ncu here: the H200 reference run's Speed-of-Light numbers are shown")
    else:
        rows["06"] = (low, "CPU traces; the data-loading fix; checkpointing and "
                      "gradient accumulation measured", "the H200 reference run's traces and numbers stand in for "
                                                        "the GPU-only bottlenecks, ncu and the memory snapshot")
    nginx = find_nginx() is not None
    if server and nginx:
        rows["07"] = ("full" if gpu and not wheel_only else low,
                      "nginx in front of two Triton servers, the image ensemble, open-loop load against the SLO, "
                      "hot updates", via.removeprefix("; ") if wheel_only else "")
    elif server:
        rows["07"] = (low, "one Triton server driven directly, the ensemble, open-loop "
                      "load", "nginx is missing (apt-get install nginx): no load balancer, API key or rate limit")
    else:
        rows["07"] = no_server
    mlflow = importlib.util.find_spec("mlflow") is not None
    if server and nginx and mlflow:
        rows["08"] = ("full" if gpu else low, "MLflow tracking and registry, canary "
                      "and A/B behind nginx, drift alerts, one retraining loop", "")
    else:
        lacking = [n for n, ok in (("tritonserver", server), ("nginx", nginx), ("mlflow", mlflow)) if not ok]
        rows["08"] = (low, "the statistics (A/B test, drift) only", f"missing: {', '.join(lacking)}")
    if gpu:
        rows["09"] = ("full", "the quiz; prefill and decode of the random-weight decoder on the GPU", "")
    else:
        rows["09"] = (low, "the quiz; prefill and decode on the CPU",
                      "the CPU stands in for the GPU; the H200's numbers come from its datasheet")
    return [LabTier(lab.number, lab.title, *rows[lab.number], notebook=(lab_dir / lab.filename).exists())
            for lab in LABS]


def _host() -> dict[str, Any]:
    mem_gib = None
    with contextlib.suppress(OSError, psutil.Error):
        mem_gib = round(psutil.virtual_memory().total / 2**30, 1)
    from lab_utils.timing import cpu_model  # lazy: pulls numpy, which the probe reports when missing

    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_model(),
            "cpu_threads": os.cpu_count(), "memory_gib": mem_gib}


def probe() -> EnvReport:
    """Look at this machine and return the full report (a few seconds; never raises for a missing GPU)."""
    notes: list[str] = []
    found = _probe_nvml(notes)
    source = "nvml"
    if found is None:
        found = _probe_smi(notes)
        source = "nvidia-smi"
    if found is None:
        found, source = (None, None, [], None), "none"
    driver, ceiling, gpus, topo = found
    if source == "nvml" and len(gpus) > 1 and shutil.which("nvidia-smi"):
        # nvidia-smi's own matrix is the reference reading (NVML cannot see through every switch setup).
        topo = _smi_topology("nvidia-smi") or topo
    torch = _probe_torch(notes)
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    ok, reasons = _compatibility(gpus, ceiling, torch)
    report = EnvReport(source, driver, ceiling, gpus, topo, torch, _probe_components(), ok, reasons, notes,
                       missing, host=_host())
    report.tiers = lab_tiers(report)
    return report


# --- lab 00: captures, the stack on this machine, containers ------------------------------------

CAPTURES = {
    "nvidia-smi": "nvidia-smi.txt",
    "query-gpu": "query-gpu.csv",
    "topo": "topo-x2.txt",
    "triton-metrics": "triton-metrics.txt",
    "nccl-debug": "nccl-debug-x2.txt",  # NCCL_DEBUG=INFO of a 2-rank all_reduce on 2 x H200 (NV18)
    "mig-profiles": "mig-lgip.txt",  # `nvidia-smi mig -lgip` on the H200 (MIG off, nothing changed), 2026-12-04
}

# The NGC images the course uses and the CUDA runtime inside each come from the version manifest
# (lab_utils/data/stack/versions.json, read through lab_utils.course.stack), which the container stack also reads.


def capture(name: str) -> str:
    """A raw capture from the course's reference H200 runner (``nvidia-smi``, ``query-gpu``, ``topo``...)."""
    if name not in CAPTURES:
        raise ValueError(f"capture({name!r}): known captures are {sorted(CAPTURES)}")
    return (DATA_DIR / "h200" / CAPTURES[name]).read_text()


def live_or_capture(kind: str) -> tuple[str, str]:
    """(text, source): this machine's ``nvidia-smi`` (or ``nvidia-smi topo -m``) output, else the H200 capture."""
    if (cmd := {"nvidia-smi": ["nvidia-smi"], "topo": ["nvidia-smi", "topo", "-m"]}.get(kind)) is None:
        raise ValueError(f"live_or_capture({kind!r}): use 'nvidia-smi' or 'topo'")
    text = _run(cmd) if shutil.which("nvidia-smi") else None
    return (text, "this machine") if text else (capture(kind), "H200 reference capture (no nvidia-smi here)")


def stack_table(report: EnvReport) -> list[dict[str, str]]:
    """The software stack's layers, each with what this machine has of it."""
    t = report.torch or {}
    c = report.components
    gpu = ", ".join(sorted({g.name for g in report.gpus})) or "none found"
    rows = [("GPU hardware", gpu), ("driver (kernel module + libcuda, NVML)", report.driver_version or "absent"),
            ("CUDA runtime (what torch ships)", t.get("cuda") or "none (CPU build of torch)"),
            ("CUDA-X: cuDNN", str(t.get("cudnn") or "absent")), ("CUDA-X: NCCL", str(t.get("nccl") or "absent")),
            ("CUDA-X: TensorRT", c["tensorrt"].version or ("present" if c["tensorrt"].present else "absent")),
            ("framework: PyTorch", t.get("version") or "absent"),
            ("platform: Triton server", (c["tritonserver"].version or "present") if c["tritonserver"].present
             else "absent"),
            ("operations: Prometheus", (c["prometheus"].version or "present") if c["prometheus"].present else "absent")]

    rel = pinned_release()
    in_image = "(in the image)"
    image = ["(the host's)", "(the host's, mapped in at start)", rel["cuda"], in_image, in_image, rel["tensorrt"],
             rel["torch"], f"{rel['triton_server']} (tritonserver image)", manifest()["services"]["prometheus"]]
    column = f"course image (NGC {rel['tag']})"
    return [{"layer": a, "on this machine": b, column: i} for (a, b), i in zip(rows, image, strict=True)]


def container_verdicts(cuda_ceiling: str, datacenter_gpu: bool = True) -> list[dict[str, str]]:
    """Whether each NGC image's CUDA runtime runs on a driver with ``cuda_ceiling``, and why."""
    rows = []
    for entry in ngc_images():
        cuda = entry["cuda"]
        if version_tuple(cuda) <= version_tuple(cuda_ceiling):
            verdict = "runs: the driver supports this CUDA"
        elif version_tuple(cuda)[:1] == version_tuple(cuda_ceiling)[:1]:  # same major: no compat package needed
            verdict = "runs through minor-version compatibility; some features need a newer driver"
        elif datacenter_gpu:
            verdict = "runs through the image's forward-compatibility libraries (data-centre GPUs only)"
        else:
            verdict = "fails: update the driver"
        rows.append({"image": entry["image"], "CUDA runtime": cuda, "driver ceiling": cuda_ceiling, "verdict": verdict})
    return rows
