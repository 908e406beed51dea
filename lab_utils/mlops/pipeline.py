"""The retraining pipeline, small and explicit: check the new data, train, evaluate (a gate), log the run, register
the model, set the ``challenger`` alias. What Kubeflow or Airflow would run as a DAG on new data, here one function
whose steps are recorded (name, start, duration, outcome, details) so a student sees one loop of the lifecycle.

``retrain(tracking, x_new, y_new, x_val, y_val, ...) -> PipelineRecord``; ``record.table()`` is one row per step;
``record.ok``; ``record.raise_for_failure()``. A failed step stops the pipeline: later steps are not run, nothing is
registered, and the failure (its exception in words) is in the record."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.mlops import tracking as tr


class PipelineError(RuntimeError):
    """A pipeline step failed; the message names the step and why."""


@dataclass
class Step:
    """One step's record: what ran, when (unix s), how long (s), whether it passed, and what it produced."""

    name: str
    started_at: float
    duration_s: float
    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass
class PipelineRecord:
    """Every step the pipeline ran, in order, and what it registered."""

    steps: list[Step] = field(default_factory=list)
    run_id: str | None = None
    version: str | None = None
    alias: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(s.ok for s in self.steps)

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"step": s.name, "ok": s.ok, "duration_s": round(s.duration_s, 3),
                              "detail": ", ".join(f"{k}={v}" for k, v in s.detail.items()) or s.error}
                             for s in self.steps], columns=["step", "ok", "duration_s", "detail"])

    def raise_for_failure(self) -> None:
        if (bad := next((s for s in self.steps if not s.ok), None)) is not None:
            raise PipelineError(f"step {bad.name!r} failed: {bad.error}")


STEPS = ("check data", "train", "evaluate", "log run", "register", "set alias")


def retrain(tracking: Any, x_new: np.ndarray, y_new: np.ndarray, x_val: np.ndarray, y_val: np.ndarray, *,
            epochs: int = 4, min_accuracy: float = 0.8, log: Callable[[str], None] | None = print) -> PipelineRecord:
    """Train on the new data (raw digits (N, 8, 8), 0..16), gate on ``min_accuracy`` (0..1) on ``x_val``/``y_val``,
    log the run to MLflow, register it as a new version of the service's model and point ``challenger`` at it.
    ``log`` gets one line per step (None: silent). Returns the record; a failure stops the pipeline and is
    recorded, not raised."""
    name, alias = tr.REGISTERED_MODEL, "challenger"
    rec = PipelineRecord()
    state: dict[str, Any] = {}

    def run(step: str, fn: Callable[[], dict[str, Any]]) -> bool:
        t0, wall = time.perf_counter(), time.time()
        try:
            detail = fn()
            s = Step(step, wall, time.perf_counter() - t0, True, detail)
        except Exception as err:  # recorded: the pipeline's record is its result
            s = Step(step, wall, time.perf_counter() - t0, False, {}, f"{type(err).__name__}: {err}")
        rec.steps.append(s)
        if log is not None:
            what = ", ".join(f"{k}={v}" for k, v in s.detail.items()) if s.ok else f"FAILED: {s.error}"
            log(f"[pipeline] {step:<10} {s.duration_s:6.2f} s  {what}")
        return s.ok

    def check() -> dict[str, Any]:
        x, y = tr._check_images(x_new, y_new, "retrain(x_new, y_new)")
        tr._check_images(x_val, y_val, "retrain(x_val, y_val)")
        if missing := sorted(set(range(10)) - set(np.unique(y).tolist())):
            raise ValueError(f"the new data has no example of class(es) {missing}: the model would never predict "
                             "them; collect labelled examples of every digit first")
        return {"images": len(y), "data_sha256": tr.dataset_sha256(x, y)[:12]}

    def train() -> dict[str, Any]:
        state["result"] = res = tr.train_digits(x_new, y_new, x_val, y_val, epochs=epochs)
        return {"epochs": epochs, "train_s": round(res.train_s, 2)}

    def evaluate() -> dict[str, Any]:
        acc = state["result"].metrics["val_accuracy"]
        if not acc >= min_accuracy:
            raise ValueError(f"val_accuracy {acc:.3f} is below the gate {min_accuracy}: not registered")
        return {"val_accuracy": round(acc, 4), "gate": min_accuracy}

    def log_run() -> dict[str, Any]:
        r = tr.log_run(tracking, state["result"], data_name="digits-retrain", tags={"pipeline": "retrain"})
        rec.run_id = r.run_id
        return {"run_id": r.run_id, "git_commit": r.git_commit[:12]}

    def register() -> dict[str, Any]:
        rec.version = tr.register_run(tracking, str(rec.run_id), name, description="retrained by the pipeline")
        return {"model": name, "version": rec.version}

    def set_alias() -> dict[str, Any]:
        tr.set_alias(tracking, name, alias, str(rec.version))
        rec.alias = alias
        return {"alias": alias, "version": rec.version}

    for step, fn in zip(STEPS, (check, train, evaluate, log_run, register, set_alias), strict=True):
        if not run(step, fn):
            break
    return rec
