"""A lab session: probe once, print the environment report and tier table, hand back the lab's context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from lab_utils.course.catalog import lab_by_number
from lab_utils.course.probe import EnvReport, LabTier, probe
from lab_utils.course.results import Recorder
from lab_utils.procs import env_flag

QUICK_ENV = "NVLAB_QUICK"


def quick_mode() -> bool:
    """True when ``NVLAB_QUICK=1``: CI's small sizes for runs that cannot pass papermill parameters. Another value
    than 1/0/true/false/yes/no is an ``EnvError`` (a typo must not silently run the full sizes)."""
    return env_flag(QUICK_ENV)


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
        """Record one measurement of this lab (see ``lab_utils.course.results``)."""
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
        print_report(report, highlight=lab.number, brief=True, width=NOTEBOOK_WIDTH)
    recorder = Recorder(lab.number, tier.tier, _device_name(report, device), _versions(report))
    return LabContext(lab.number, report, tier, device, recorder)

def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        v = f"{v:g}"
    return f"{v}{unit}"


def gpu_rows(report: EnvReport) -> list[dict[str, str]]:
    """One row per GPU, values with units, for a table."""
    rows = []
    for g in report.gpus:
        pcie = f"gen{_fmt(g.pcie_gen)} x{_fmt(g.pcie_width)}"
        if g.pcie_gen_max:
            pcie += f" (max gen{g.pcie_gen_max} x{_fmt(g.pcie_width_max)})"
        rows.append({"GPU": str(g.index), "name": g.name, "CC": _fmt(g.compute_capability),
                     "memory": _fmt(g.memory_total_mib, " MiB"), "max SM clock": _fmt(g.max_sm_clock_mhz, " MHz"),
                     "power limit": _fmt(g.power_limit_w, " W"), "PCIe": pcie, "NVLinks": _fmt(g.nvlinks_active),
                     "MIG": _fmt(g.mig_mode), "ECC": _fmt(g.ecc_mode)})
    return rows


NOTEBOOK_WIDTH = 100  # characters: JupyterLab's output area at 1280 px with the file browser open (120 wrapped)


def print_report(report: EnvReport, highlight: str | None = None, brief: bool = False,
                 width: int = 120) -> None:
    """Print the report with rich: stack versions, GPUs, topology, components, verdict, lab tiers; ``width`` in
    characters (rich wraps text inside the columns; a notebook's output area wraps whole lines wider than itself)."""
    # Plain text in a notebook too (rich's Jupyter output carries ANSI codes in its text/plain copy); colour only
    # on a terminal.
    console = Console(width=width, force_jupyter=False)
    t = report.torch or {}
    head = Table(title="Stack", show_header=False, box=None)
    head.add_row("GPU source", report.source)
    head.add_row("driver", _fmt(report.driver_version))
    head.add_row("driver's CUDA ceiling", _fmt(report.cuda_ceiling))
    head.add_row("torch", f"{_fmt(t.get('version'))} (CUDA runtime {_fmt(t.get('cuda'))}, "
                 f"cuDNN {_fmt(t.get('cudnn'))}, NCCL {_fmt(t.get('nccl'))})")
    head.add_row("host", f"{report.host.get('cpu')} · {report.host.get('cpu_threads')} threads · "
                 f"{report.host.get('memory_gib')} GiB · Python {report.host.get('python')}")
    console.print(head)
    if report.gpus:
        rows = gpu_rows(report)
        table = Table(*rows[0], title="GPUs")
        for r in rows:
            table.add_row(*r.values())
        console.print(table)
    if report.topology and not brief:
        topo = Table("", *report.topology["labels"], title=f"Topology ({report.topology['source']})")
        for lab, row in zip(report.topology["labels"], report.topology["matrix"], strict=False):
            topo.add_row(lab, *row)
        console.print(topo)
    if not brief:
        comp = Table("component", "present", "version", "where", "note", title="Components")
        for c in report.components.values():
            comp.add_row(c.name, "yes" if c.present else "no", _fmt(c.version), _fmt(c.where), c.note)
        console.print(comp)
    verdict = {True: "[green]compatible[/]", False: "[red]not compatible[/]", None: "no GPU"}[report.compatible]
    console.print(f"Verdict: {verdict}")
    for r in report.reasons:
        console.print(f"  - {r}")
    for n in report.notes:
        console.print(f"  [dim]note: {n}[/]")
    if report.missing:
        console.print(f"[red]missing required packages: {', '.join(report.missing)}[/] "
                      "(pip install -e '.[lab]' from the course folder)")
    tiers = Table("lab", "title", "tier", "runs", "stands in", title="Lab tiers on this machine")
    for lt in report.tiers:
        style = "bold" if lt.lab == highlight else ("dim" if not lt.notebook else "")
        title = lt.title if lt.notebook else f"{lt.title} (not in this release)"
        tiers.add_row(lt.lab, title, lt.tier.upper(), lt.runs, lt.substitutes or "-", style=style)
    console.print(tiers)
