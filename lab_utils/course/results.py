"""Recorded measurements: each lab writes (name, value, unit, tier, device, versions) to a JSON file.

``nvlab run`` points ``NVLAB_RESULTS_DIR`` at its output folder; interactively the results go to
``./nvlab-results``. ``compare`` lines a run up against the committed reference GPU run as ratios."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from lab_utils.course.catalog import repo_root
from lab_utils.procs import EnvError

RESULTS_ENV = "NVLAB_RESULTS_DIR"
REFERENCE_ENV = "NVLAB_REFERENCE_DIR"


@dataclass
class Measurement:
    lab: str
    name: str
    value: float
    unit: str
    tier: str
    device: str
    versions: dict[str, Any]
    time_utc: str
    note: str = ""


def results_dir() -> Path:
    """Where this run's results go: ``$NVLAB_RESULTS_DIR`` or ``./nvlab-results``."""
    if (env := os.environ.get(RESULTS_ENV, "").strip()) and Path(env).exists() and not Path(env).is_dir():
        raise EnvError(f"{RESULTS_ENV}={env!r}: expected a folder for results_*.json, and that is a file "
                       "(or unset it for ./nvlab-results)")
    return Path(env or "nvlab-results")


def reference_dirs() -> list[Path]:
    """Every committed reference run (``h200`` for one-GPU labs, ``h200x2`` for lab 02), or the one in the env."""
    if env := os.environ.get(REFERENCE_ENV, "").strip():
        if not Path(env).is_dir():
            raise EnvError(f"{REFERENCE_ENV}={env!r}: expected a folder of a reference run (results_*.json), "
                           "e.g. reference_runs/h200; there is no such folder (or unset it for the committed runs)")
        return [Path(env)]
    return sorted(p for p in (repo_root() / "reference_runs").glob("*") if p.is_dir())


class Recorder:
    """Appends measurements of one lab to ``results_<lab>.json`` in ``results_dir()``."""

    def __init__(self, lab: str, tier: str, device: str, versions: dict[str, Any], directory: Path | None = None):
        self.lab, self.tier, self.device, self.versions = lab, tier, device, versions
        self.path = (directory or results_dir()) / f"results_{lab}.json"
        self._items: dict[str, Measurement] = {}

    def record(self, name: str, value: float, unit: str, note: str = "") -> Measurement:
        """Record one number (re-recording a name replaces it) and write the file."""
        if not isinstance(name, str) or not name:
            raise ValueError("record(name=...): name must be a non-empty string such as 'matmul_bf16_8192'")
        m = Measurement(self.lab, name, float(value), unit, self.tier, self.device, self.versions,
                        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), note)
        self._items[name] = m
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # JSON has no NaN: a skipped measurement is null
        rows = [{**asdict(x), "value": x.value if math.isfinite(x.value) else None} for x in self._items.values()]
        self.path.write_text(json.dumps(rows, indent=1) + "\n")
        return m

    def __len__(self) -> int:
        return len(self._items)


class ResultsError(ValueError):
    """A results file that cannot be read: the message names the file and what is wrong."""


FIELDS = ("lab", "name", "value", "unit", "tier", "device")


def _rows(path: Path) -> list[dict[str, Any]]:
    """The measurements of one ``results_*.json``, checked for the shape ``Recorder`` writes."""
    fix = "run the lab again or delete the file"
    try:
        rows = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ResultsError(f"{path}: not a text file; {fix}") from None
    except OSError as err:
        raise ResultsError(f"{path}: cannot read it ({err.strerror or err})") from None
    except json.JSONDecodeError as err:  # an interrupted write leaves a truncated file
        raise ResultsError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                           f"{fix}") from None
    if not isinstance(rows, list):
        raise ResultsError(f"{path}: a list of measurements expected, found a JSON {type(rows).__name__}; {fix}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ResultsError(f"{path}: measurement {i} is a JSON {type(r).__name__}, not an object; {fix}")
        if missing := [k for k in FIELDS if k not in r]:
            raise ResultsError(f"{path}: measurement {i} lacks {', '.join(missing)}; {fix}")
        v = r["value"]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ResultsError(f"{path}: measurement {i} ({r['name']}): value {v!r} is not a number; {fix}")
    return rows


def load(directory: Path | str, fix: str = "pass the folder `nvlab run` wrote") -> list[dict[str, Any]]:
    """Every measurement in ``results_*.json`` under ``directory``; ResultsError names a broken file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a folder of results: {fix}")
    return [row for p in sorted(directory.glob("results_*.json")) for row in _rows(p)]


COMPARE_COLUMNS = ["lab", "name", "unit", "value", "reference", "ratio", "tier", "device", "reference_device"]


def compare(run: Path | str, reference: Path | str | None = None) -> pd.DataFrame:
    """A table of each measurement in ``run`` beside the reference runs' value and their ratio (none between two
    dimensionless ratios of different tiers: each describes its own device).

    ``reference``: one run folder; by default every folder under ``reference_runs/``: for each measurement the
    first reference of the same tier as the run's (lab 02 on one GPU is ``partial``, on two ``full``), else the
    first holding it."""
    local = load(run)
    ref: dict[tuple[str, str], dict[str, Any]] = {}
    if reference:  # asked for by name: a missing or empty one is an error, not "-" in every row
        fix = "pass --reference a folder of reference_runs/ or one `nvlab run` wrote"
        if not (ref_rows := load(reference, fix)):
            raise FileNotFoundError(f"{reference} holds no results_*.json: {fix}")
    else:
        ref_rows = [r for d in reference_dirs() if d.is_dir() for r in load(d)]
    for r in ref_rows:
        ref.setdefault((r["lab"], r["name"], r.get("tier")), r)
        ref.setdefault((r["lab"], r["name"], None), r)
    rows = []
    for r in local:
        other = ref.get((r["lab"], r["name"], r.get("tier"))) or ref.get((r["lab"], r["name"], None))
        rv = other["value"] if other else None
        ratio = r["value"] / rv if (r["value"] is not None and rv) else None
        if other and r["unit"] == "ratio" and other.get("tier") != r.get("tier"):
            # a ratio of two timings describes its own device (a host clock without a synchronize sees the whole
            # matmul on a CPU, 2 % of it on an H200): over another tier's it is a ratio of ratios, not a comparison
            ratio = None
        rows.append({"lab": r["lab"], "name": r["name"], "unit": r["unit"], "value": r["value"], "reference": rv,
                     "ratio": ratio, "tier": r["tier"], "device": r["device"],
                     "reference_device": other["device"] if other else None})
    # the columns even when the run recorded nothing (a lab whose measuring sections all skipped), so that a
    # notebook's table[table["lab"] == ...] shows an empty table instead of raising KeyError: 'lab'
    return pd.DataFrame(rows, columns=COMPARE_COLUMNS)
