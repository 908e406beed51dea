"""What a lab's setup cell calls: probe once, print the tier table, hand back the lab's context."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .catalog import lab_by_number
from .env import EnvReport, LabTier, probe
from .report import print_report
from .results import Recorder

QUICK_ENV = "NVLAB_QUICK"


def quick_mode() -> bool:
    """True when ``NVLAB_QUICK=1``: CI's small sizes for runs that cannot pass papermill parameters."""
    return os.environ.get(QUICK_ENV, "").lower() in ("1", "true", "yes")


@dataclass
class LabContext:
    """The lab's view of the machine: its tier, the device to run on, and the results recorder."""

    number: str
    report: EnvReport
    tier: LabTier
    device: str  # "cuda" or "cpu"
    recorder: Recorder

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def device_name(self) -> str:
        return _device_name(self.report, self.device)

    def record(self, name: str, value: float, unit: str, note: str = "") -> None:
        """Record one measurement of this lab (see ``lab_utils.results``)."""
        self.recorder.record(name, value, unit, note)


def _device_name(report: EnvReport, device: str) -> str:
    if device == "cuda" and report.gpus:
        return report.gpus[0].name
    return report.host.get("cpu") or "cpu"


def _versions(report: EnvReport) -> dict[str, Any]:
    t = report.torch or {}
    return {"driver": report.driver_version, "cuda_ceiling": report.cuda_ceiling, "torch": t.get("version"),
            "cuda_runtime": t.get("cuda"), "cudnn": t.get("cudnn"), "nccl": t.get("nccl"),
            "python": report.host.get("python")}


def start_lab(number: str, show: bool = True) -> LabContext:
    """Probe the machine, print the tier table (this lab highlighted), and return the lab's context."""
    lab = lab_by_number(number)
    report = probe()
    tier = next(t for t in report.tiers if t.lab == lab.number)
    device = "cuda" if report.gpu_usable else "cpu"
    if show:
        print_report(report, highlight=lab.number, brief=True)
    recorder = Recorder(lab.number, tier.tier, _device_name(report, device), _versions(report))
    return LabContext(lab.number, report, tier, device, recorder)
