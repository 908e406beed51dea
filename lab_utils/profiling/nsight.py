"""Nsight Systems and Nsight Compute where they are installed: a script run under ``nsys``/``ncu``, its report read
back. Elsewhere each function returns the command it would have run and why it did not.

``ncu`` always runs with ``--clock-control none``: its default locks the GPU's clocks to base for the
measurement, and a lab reads the GPU's state, it never changes it."""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab_utils.procs import temporary_folder

__all__ = ["ToolRun", "KERNELS_SCRIPT", "STEPS_SCRIPT", "ncu_command", "nsys_command", "run_ncu", "run_nsys",
           "kernel_work", "label_kernels", "duration_s", "parse_ncu_csv", "NCU_INSTALL", "NSYS_INSTALL"]

NCU_INSTALL = ("Nsight Compute (`ncu`) ships with the CUDA toolkit and the NGC PyTorch images; on another machine "
               "install the `nsight-compute` package of NVIDIA's CUDA repository")
NSYS_INSTALL = ("Nsight Systems (`nsys`) ships with the NGC PyTorch images; elsewhere install `nsight-systems` from "
                "NVIDIA's CUDA repository or developer site")

# One BF16 GEMM and one FP32 elementwise add, each once between cudaProfilerStart/Stop (ncu profiles only those),
# after warm-up calls that pick cuBLAS's kernel and load the modules.
KERNELS_SCRIPT = """\
import torch
n, numel = {n}, {numel}
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
x = torch.randn(numel, device="cuda")
y = torch.randn(numel, device="cuda")
for _ in range(3):
    a @ b
    x + y
torch.cuda.synchronize()
torch.cuda.profiler.start()
c = a @ b  # kernel 1: GEMM, 2n^3 FLOPs over 3 n^2 bf16 values
z = x + y  # kernel 2: elementwise, numel FLOPs over 3 numel fp32 values
torch.cuda.synchronize()
torch.cuda.profiler.stop()
"""

# A few training steps of a small model with NVTX ranges per phase, for nsys's timeline.
STEPS_SCRIPT = """\
import torch
from torch import nn
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(4096, 1024, device="cuda")
for step in range(20):
    torch.cuda.nvtx.range_push(f"step {{step}}")
    torch.cuda.nvtx.range_push("forward")
    loss = model(x).pow(2).mean()
    torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_push("backward")
    loss.backward()
    torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_push("optimizer")
    opt.step()
    opt.zero_grad()
    torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
"""


@dataclass
class ToolRun:
    """One profiler run: ``ran`` or why not, the command, its output, and what was read from the report."""

    tool: str
    command: list[str]
    ran: bool
    why_not: str = ""
    returncode: int | None = None
    output: str = ""
    rows: list[dict[str, Any]] = field(default_factory=list)

    def __str__(self) -> str:
        cmd = " ".join(self.command)
        if not self.ran:
            return f"{self.tool} did not run: {self.why_not}\n  command: {cmd}"
        return f"{self.tool} ran (exit {self.returncode}): {cmd}"


def ncu_command(script: str) -> list[str]:
    """The ``ncu`` command line: Speed-of-Light section, only kernels between cudaProfilerStart/Stop, clocks as
    they are, the details page as CSV."""
    return ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--section", "SpeedOfLight",
            "--print-units", "base", "--csv", "--page", "details", sys.executable, script]


def nsys_command(script: str, report: str) -> list[str]:
    """The ``nsys profile`` command line: CUDA API and kernels, NVTX ranges, OS runtime calls."""
    return ["nsys", "profile", "--trace=cuda,nvtx,osrt", "--force-overwrite=true", "-o", report, sys.executable, script]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Keep NVLink multicast off in the child too, as everywhere in the course.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    return env


def _why_not(tool: str, install: str) -> str | None:
    """Why ``tool`` cannot profile here (not on the PATH, no torch, no GPU), or None."""
    if shutil.which(tool) is None:
        return f"{tool} is not on the PATH. {install}"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "no CUDA GPU usable by torch here"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """Rows of ``ncu --csv --page details``, one dict per kernel: name, and each metric as ``metric [unit]``."""
    if (start := text.find('"ID"')) < 0:
        return []
    kernels: dict[str, dict[str, Any]] = {}
    for r in csv.DictReader(io.StringIO(text[start:])):
        k = kernels.setdefault(r["ID"], {"id": int(r["ID"]), "kernel": r.get("Kernel Name", "")[:80]})
        unit = r.get("Metric Unit", "")
        if (value := _number(r.get("Metric Value", ""))) is not None:
            k[f"{r['Metric Name']} [{unit}]" if unit else r["Metric Name"]] = value
    return list(kernels.values())


def run_ncu(n: int = 8192, numel: int = 2**28, timeout_s: float = 300.0) -> ToolRun:
    """Profile one BF16 GEMM (n³) and one FP32 add (``numel`` elements) with ncu's Speed-of-Light section."""
    with temporary_folder("ncu") as d:
        script = d / "kernels.py"
        script.write_text(KERNELS_SCRIPT.format(n=n, numel=numel))
        cmd = ncu_command(str(script))
        shown = [{str(script): "kernels.py", sys.executable: "python"}.get(c, c) for c in cmd]
        if why := _why_not("ncu", NCU_INSTALL):
            return ToolRun("ncu", shown, False, why)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=d, env=_env())
    out = proc.stdout + proc.stderr
    rows = parse_ncu_csv(proc.stdout)
    hint = ""
    if proc.returncode == 0 and rows:
        label_kernels(rows, n, numel)
    elif "ERR_NVGPUCTRPERM" in out:
        hint = (" (ERR_NVGPUCTRPERM: this user may not read the GPU's performance counters; an administrator "
                "allows it with the nvidia driver option NVreg_RestrictProfilingToAdminUsers=0)")
    return ToolRun("ncu", shown, True, returncode=proc.returncode, output=out[-3000:] + hint, rows=rows)


def label_kernels(rows: list[dict[str, Any]], n: int, numel: int) -> None:
    """Attach the op, FLOPs and bytes of KERNELS_SCRIPT to ncu's rows by kernel name: the elementwise kernel says
    so in its name; the GEMM is the longest of the others (a library may add a small helper kernel)."""
    gemm, add = kernel_work(n, numel)
    for r in rows:
        if "elementwise" in r.get("kernel", "").lower():
            r.update(add)
    others = [r for r in rows if "op" not in r]
    dur = [k for k in (others[0] if others else {}) if k.startswith("Duration")]
    if others and dur:
        max(others, key=lambda r: r.get(dur[0], 0.0)).update(gemm)


def duration_s(row: dict[str, Any]) -> float | None:
    """A row's kernel duration in seconds, whatever unit ncu printed; None when it has none."""
    scale = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
             "second": 1.0, "s": 1.0}
    for k, v in row.items():
        if k.startswith("Duration"):
            unit = k[k.find("[") + 1:k.find("]")] if "[" in k else "second"
            if unit in scale:
                return float(v) * scale[unit]
    return None


def kernel_work(n: int, numel: int) -> list[dict[str, Any]]:
    """FLOPs and minimum bytes moved by KERNELS_SCRIPT's two kernels, in launch order."""
    return [{"op": f"GEMM bf16 {n}³", "flops": 2 * n**3, "bytes": 3 * n * n * 2},
            {"op": f"add fp32 {numel:,}", "flops": numel, "bytes": 3 * numel * 4}]


def run_nsys(timeout_s: float = 300.0) -> ToolRun:
    """Run STEPS_SCRIPT under ``nsys profile`` and read ``nsys stats`` (NVTX ranges and GPU kernels) back."""
    with temporary_folder("nsys") as d:
        script = d / "steps.py"
        script.write_text(STEPS_SCRIPT)
        report = str(Path(d) / "steps")
        cmd = nsys_command(str(script), report)
        shown = ["python" if c == sys.executable else c.replace(str(d) + os.sep, "") for c in cmd]
        if why := _why_not("nsys", NSYS_INSTALL):
            return ToolRun("nsys", shown, False, why)
        prof = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=d, env=_env())
        if prof.returncode != 0:
            return ToolRun("nsys", shown, True, returncode=prof.returncode, output=(prof.stdout + prof.stderr)[-3000:])
        stats = subprocess.run(["nsys", "stats", "--report", "nvtx_sum,cuda_gpu_kern_sum", "--format", "csv",
                                "--output", "-", report + ".nsys-rep"], capture_output=True, text=True,
                               timeout=timeout_s, cwd=d)
    return ToolRun("nsys", shown, True, returncode=stats.returncode, output=stats.stdout[-6000:])
