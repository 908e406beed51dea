"""The GPUs and the driver of this machine: NVML (``nvidia-ml-py``) first, ``nvidia-smi`` as the fallback, and
the parsers of what ``nvidia-smi`` prints (also run on the H200 captures in lab 00); versions and which CUDA
architectures run on a GPU (``arch_support``)."""

from __future__ import annotations

import contextlib
import csv
import io
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lab_utils.course.programs import run_text

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


# --- NVML, else nvidia-smi -----------------------------------------------------------------------

_NVML_WHY = {
    "LIBRARY_NOT_FOUND": "libnvidia-ml.so was not found: no NVIDIA driver is installed (normal without an NVIDIA GPU)",
    "DRIVER_NOT_LOADED": "the NVIDIA kernel driver is not loaded: check `lsmod | grep nvidia`, or that the "
    "container was started with `--gpus all`",
    "NO_PERMISSION": "no permission to open /dev/nvidia*: run as a user in the video group, or fix the "
    "container's device mounts",
    "LIB_RM_VERSION_MISMATCH": "the driver library and the loaded kernel module differ in version: reboot "
    "after the driver update (or reload the nvidia modules)"}


def nvml_error_text(err: Exception) -> str:
    import pynvml

    for key, why in _NVML_WHY.items():
        if getattr(err, "value", None) == getattr(pynvml, f"NVML_ERROR_{key}", object()):
            return f"NVML could not initialise: {why}"
    return f"NVML could not initialise ({err})"


def nvml_text(v: Any) -> str:
    """An NVML string: older pynvml versions return bytes, newer ones str."""
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_start() -> str | None:
    """Initialise NVML (the caller shuts it down): None when it started, else why it cannot, in one line."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install nvidia-ml-py), so NVML cannot be used"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return nvml_error_text(err)
    return None


def probe_nvml(notes: list[str]) -> tuple[str | None, str | None, list[GpuInfo], dict[str, Any] | None] | None:
    if (why := nvml_start()) is not None:
        notes.append(why)
        return None
    import pynvml

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

            def cell(i: int, j: int) -> str:
                if i == j:
                    return "X"
                if (a := gpus[i].nvlinks_active) and (b := gpus[j].nvlinks_active):
                    # Through NVSwitch every link reaches every peer: nvidia-smi prints NV<links>.
                    return f"NV{min(a, b)}"
                return _TOPO_LEVEL.get(opt(pynvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j]), "?")

            matrix = [[cell(i, j) for j in range(len(handles))] for i in range(len(handles))]
            topo = {"labels": [f"GPU{g.index}" for g in gpus], "matrix": matrix, "source": "NVML"}
        return driver, ceiling, gpus, topo
    finally:
        pynvml.nvmlShutdown()


def probe_smi(notes: list[str]) -> tuple[str | None, str | None, list[GpuInfo], dict[str, Any] | None] | None:
    if not (smi := shutil.which("nvidia-smi")):
        notes.append("nvidia-smi is not on the PATH: no NVIDIA driver tools on this machine")
        return None
    if (text := run_text([smi, f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"])) is None:
        notes.append("nvidia-smi is present but failed: the driver is not working (try `nvidia-smi` in a shell)")
        return None
    gpus = parse_smi_csv(text)
    header = parse_smi_header(run_text([smi]) or "")
    if (driver := header["driver_version"]) is None:
        row = next(csv.reader(io.StringIO(text)), [])
        driver = row[-1].strip() if row else None
    return driver, header["cuda_ceiling"], gpus, smi_topology(smi) if len(gpus) > 1 else None


def smi_topology(smi: str) -> dict[str, Any] | None:
    """The matrix ``nvidia-smi topo -m`` prints; None when it fails or prints none."""
    with contextlib.suppress(ValueError):
        if text := run_text([smi, "topo", "-m"]):
            return parse_topology(text)
    return None
