"""Environment probe: GPUs, driver, CUDA ceiling, torch, topology, components, and each lab's tier (``probe()``).

The GPUs come from ``course.gpus`` (NVML, else ``nvidia-smi``), the programs and components from ``course.programs``
(``find_<program>()``: a path, or None); both are importable from here too. With neither NVML nor ``nvidia-smi`` the
report says why and every lab runs in its CPU tier. Nothing here raises on a machine without a GPU."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from lab_utils import DATA_DIR
from lab_utils.course.catalog import LABS, repo_root
from lab_utils.course.gpus import (  # noqa: F401 (the names callers use from here)
    GpuInfo,
    arch_support,
    decode_cuda_version,
    nvml_error_text,
    nvml_text,
    parse_smi_csv,
    parse_smi_header,
    parse_topology,
    probe_nvml,
    probe_smi,
    smi_topology,
    version_tuple,
)
from lab_utils.course.programs import (  # noqa: F401 (the names callers use from here)
    MODELOPT_INSTALL,
    MODELOPT_ONNX_NEEDS,
    NGINX_ENV,
    NGINX_SEARCH,
    PROMETHEUS_ENV,
    PROMETHEUS_INSTALL,
    TRTEXEC_CANDIDATES,
    Component,
    find_jupyter_lab,
    find_nginx,
    find_perf_analyzer,
    find_prometheus,
    find_trtexec,
    findable,
    probe_components,
    pytriton_server,
    run_text,
    tensorrt_runtime_present,
)
from lab_utils.course.stack import manifest, pinned_release

REQUIRED = ("numpy", "pandas", "matplotlib", "torch", "papermill", "nbformat", "ipykernel")


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
        return {**asdict(self), "gpu_usable": self.gpu_usable, "can_run": self.can_run}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


def _probe_torch(notes: list[str]) -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        notes.append("torch is not installed: pip install torch (not inside an NGC image, which has its own)")
        return None
    info: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda, "cudnn": None, "nccl": None,
                            "cuda_available": False, "device_count": 0, "arch_list": []}
    if torch.version.cuda:
        if torch.cuda.is_available():
            info.update(cuda_available=True, device_count=torch.cuda.device_count(),
                        arch_list=torch.cuda.get_arch_list())
        info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        with contextlib.suppress(Exception):  # a build without NCCL (e.g. Windows): the report says "none"
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


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
    unusable = "GPU not usable by torch: " if seen_gpu else ""  # where a GPU is here that torch cannot use
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
        rows["01"] = (low, "CPU BLAS and DRAM bandwidth with the same harness",
                      unusable + "the H200 reference run is shown beside")
    # Triton the kernel language (not the Triton server): found, not imported (importing it takes seconds)
    triton_lang = findable("triton")
    if gpu and triton_lang:
        rows["01b"] = ("full", "your Triton kernels compiled for this GPU and timed beside torch and cuBLAS; the CUDA "
                       "C++ add through CuPy", "")
    elif triton_lang:
        rows["01b"] = (low, "your Triton kernels checked in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors",
                       unusable + "the H200 reference run's bandwidths and TFLOP/s stand in for the timings")
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
    source, found = "nvml", probe_nvml(notes)
    if found is None:
        source, found = "nvidia-smi", probe_smi(notes)
    if found is None:
        source, found = "none", (None, None, [], None)
    driver, ceiling, gpus, topo = found
    if source == "nvml" and len(gpus) > 1 and shutil.which("nvidia-smi"):
        # nvidia-smi's own matrix is the reference reading (NVML cannot see through every switch setup).
        topo = smi_topology("nvidia-smi") or topo
    torch = _probe_torch(notes)
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    ok, reasons = _compatibility(gpus, ceiling, torch)
    report = EnvReport(source, driver, ceiling, gpus, topo, torch, probe_components(), ok, reasons, notes,
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
    text = run_text(cmd) if shutil.which("nvidia-smi") else None
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
