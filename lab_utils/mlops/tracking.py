"""Experiment tracking and a model registry, for real: an owned MLflow tracking server, training runs of the service's
digits classifier logged to it, runs compared, the best registered, aliases, and lineage back from a served version to
its run, data hash and commit.

``TrackingServer(port=None, workers=1, startup_timeout_s=120)`` is the owned server (a context manager). Runs:
``train_digits``, ``log_run``, ``log_training_run``, ``compare_runs``, ``metric_history``. Registry: ``register_run``,
``register_best``, ``set_alias``, ``lineage``, ``download_onnx``. Identity: ``dataset_sha256``, ``git_commit``.
``tracking`` is a ``TrackingServer``, its URL, or an ``mlflow.MlflowClient``. Units are in names (``_s`` seconds).

Design notes: docs/internals.md#lab_utilsmlopstrackingpy"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.args import check_int
from lab_utils.owned import OwnedServer
from lab_utils.procs import http_ok, owned_tempdir, temporary_folder, who_listens
from lab_utils.serving.ensemble import digits_raw_split, export_classifier

MLFLOW_INSTALL = "pip install 'mlflow>=2.16' (or the course's lab extra: pip install -e '.[lab]')"
EXPERIMENT = "digits"
REGISTERED_MODEL = "digits_classifier"
MODEL_ARTIFACT = "model"  # the run's artifact folder holding model.onnx
ONNX_FILE = "model.onnx"
NOT_GIT = "not a git checkout"
DEFAULT_STARTUP_TIMEOUT_S = 120.0  # a first start creates the SQLite schema (~30 migrations): 6-15 s on 2 busy cores
DEFAULT_STOP_GRACE_S = 5.0  # uvicorn finishes in-flight requests on SIGTERM; then the group gets SIGKILL
METRIC = "val_accuracy"


class TrackingError(RuntimeError):
    """The tracking server could not be started or used; the message says why and what to do."""


class MlflowMissing(TrackingError):
    """mlflow is not installed in this Python: the message says how to install it."""


def mlflow_missing() -> str | None:
    """Why this Python cannot run an MLflow server (with the install line), or None when it can."""
    if importlib.util.find_spec("mlflow") is None:
        return f"mlflow is not installed in {sys.executable}: {MLFLOW_INSTALL}"
    return None


# --- the server ----------------------------------------------------------------------------------------------


class TrackingServer(OwnedServer):
    """One ``mlflow server`` (the CLI and its uvicorn server) owned by this interpreter.

    >>> with TrackingServer() as server:   # doctest: +SKIP
    ...     run = log_training_run(server, epochs=3, lr=0.05)"""

    error = TrackingError
    watchdog_s = (2.0, 3.0)  # uvicorn is the CLI's child: the kernel's PDEATHSIG does not reach it
    poll_s = 0.1

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, workers: int = 1,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, stop_grace_s: float = DEFAULT_STOP_GRACE_S):
        check_int(workers, "workers", "TrackingServer", 1, 16,
                  what="1 is plenty for a lab: each worker is a Python process of ~200 MB")
        if port is not None:
            check_int(port, "port", "TrackingServer", 1, 65535, what="a TCP port, or None for a free one")
        super().__init__(host=host, ports={"port": port}, startup_timeout_s=startup_timeout_s,
                         stop_grace_s=stop_grace_s)
        self.workers = workers
        self.port: int | None = None

    # where things are -------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: the tracking URI clients use."""
        if self.port is None:
            raise TrackingError("the tracking server is not started: call start() (or `with TrackingServer() as s:`)")
        return f"http://{self.host}:{self.port}"

    @property
    def backend_store_uri(self) -> str:
        return f"sqlite:///{self._need_folder() / 'mlflow.db'}"

    @property
    def artifacts_path(self) -> Path:
        return self._need_folder() / "artifacts"

    @property
    def log_path(self) -> Path | None:
        return self.folder / "mlflow.log" if self.folder else None

    def _need_folder(self) -> Path:
        if self.folder is None:
            raise TrackingError("the tracking server is not started: call start() first")
        return self.folder

    def ready(self) -> bool:
        """True when ``/health`` answers ``OK`` now."""
        return self.port is not None and http_ok(f"{self.url}/health", timeout_s=2.0,
                                                 check=lambda body: body.strip() == b"OK")[0]

    def client(self) -> Any:
        """An ``mlflow.MlflowClient`` for this server."""
        return _client(self.url)

    def __repr__(self) -> str:
        where = f"http://{self.host}:{self.port}" if self.port else "no port yet"
        return f"TrackingServer({self._state()}, {where}, folder={self.folder})"

    # lifecycle: see OwnedServer ---------------------------------------------------------------------------
    def _check(self) -> None:
        if why := mlflow_missing():
            raise MlflowMissing(f"the MLflow tracking server cannot start: {why}")

    def _prepare(self) -> dict[str, Any]:
        self.folder = owned_tempdir("mlflow")
        self.artifacts_path.mkdir()
        env = dict(os.environ)
        # MLflow 3's job runner starts a huey consumer pool (7 more processes) and a queue folder in /dev/shm that
        # a killed server leaves behind; the lab runs no server-side jobs.
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("MLFLOW_TRACKING_URI", None)  # the server's own store is the one given on its command line
        return {"env": env, "cwd": str(self.folder)}

    def _command(self) -> list[str]:
        # `python -m mlflow`: this interpreter's mlflow, whatever is first on the PATH.
        return [sys.executable, "-m", "mlflow", "server",
                "--backend-store-uri", self.backend_store_uri,
                # served through the server (mlflow-artifacts:/): clients need no access to this folder
                "--serve-artifacts", "--artifacts-destination", str(self.artifacts_path),
                "--host", self.host, "--port", str(self.port), "--workers", str(self.workers)]

    def _ready_url(self) -> str:
        return f"{self.url}/health"

    def _give_up(self) -> bool:
        """A uvicorn that could not bind exits, but the CLI above it waits on: read it from the log."""
        return bool(re.search(r"address already in use", self.log_tail(60), re.I))

    def _failure(self, timed_out: bool, code: int | None, text: str) -> Exception:
        if timed_out:
            return TrackingError(f"the MLflow server did not answer GET /health within {self.startup_timeout_s:g} s "
                                 f"(a busy machine? raise startup_timeout_s). Its log:\n{text}")
        how = f"exited with code {code}" if code is not None else "failed"
        return TrackingError(f"the MLflow server {how} before it was ready ({self._reason(text)}). Its log:\n{text}")

    def _reason(self, text: str) -> str:
        if re.search(r"address already in use", text, re.I):
            return f"port {self.port} is already in use {who_listens(int(self.port or 0))}"
        return f"a module is missing: {MLFLOW_INSTALL}" if "No module named" in text else "see the log below"


def _client(tracking: Any) -> Any:
    """An MlflowClient from a TrackingServer, a URL or a client."""
    from mlflow import MlflowClient

    if isinstance(tracking, MlflowClient):
        return tracking
    if isinstance(tracking, TrackingServer):
        tracking = tracking.url
    if isinstance(tracking, str) and re.match(r"^https?://", tracking):
        return MlflowClient(tracking_uri=tracking, registry_uri=tracking)
    raise TypeError(f"tracking={tracking!r}: give a started TrackingServer, its URL (http://127.0.0.1:PORT) or an "
                    "mlflow.MlflowClient")


# --- what identifies a run: data and code ---------------------------------------------------------------------


def dataset_sha256(*arrays: np.ndarray) -> str:
    """sha256 (hex) over the arrays' dtypes, shapes and bytes (C order): the same data always gives the same hash,
    one changed pixel or label another."""
    if not arrays:
        raise ValueError("dataset_sha256(): give the arrays, e.g. dataset_sha256(x_train, y_train)")
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def git_commit(path: str | os.PathLike[str] | None = None) -> tuple[str, bool | None]:
    """(``git rev-parse HEAD`` of the checkout holding ``path`` (default: this package), whether its work tree has
    uncommitted changes); (``"not a git checkout"``, None) outside one or without git."""
    where = Path(path) if path else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return NOT_GIT, None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return NOT_GIT, None
    return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None


# --- training the service's classifier ------------------------------------------------------------------------


def digits_data() -> dict[str, Any]:
    """The service's digits as raw pixels 0..16: ``x_train`` (1440, 8, 8), ``y_train``, ``x_test`` (357, 8, 8),
    ``y_test``, and the normalization (``mean``, ``std``) the service's preprocessing applies."""
    return digits_raw_split()


@dataclass
class TrainResult:
    """A trained classifier: the model (eval mode), one row per epoch, the recipe, and the data's hashes."""

    model: Any
    history: list[dict[str, float]]
    params: dict[str, Any]
    data_sha256: str
    val_sha256: str
    train_s: float

    @property
    def metrics(self) -> dict[str, float]:
        """The last epoch's metrics."""
        return {k: v for k, v in self.history[-1].items() if k != "epoch"}


def _check_images(x: Any, y: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim == 4 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim != 3 or x.shape[1:] != (8, 8):
        raise ValueError(f"{what}: images of shape (N, 8, 8) with raw pixel values 0..16 expected, got shape "
                         f"{x.shape} (digits_data() gives them)")
    if y.shape != (len(x),):
        raise ValueError(f"{what}: {len(x)} images but labels of shape {y.shape}: one label per image")
    if len(x) == 0:
        raise ValueError(f"{what}: no images")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() > 9:
        raise ValueError(f"{what}: labels must be integers 0..9 (got {y.dtype}, {y.min()}..{y.max()})")
    if float(np.max(x)) > 16.5 or float(np.min(x)) < -0.5:
        raise ValueError(f"{what}: pixel values {float(np.min(x)):.3g}..{float(np.max(x)):.3g}; expected raw 0..16 "
                         "(not normalized: the service's preprocessing normalizes)")
    return x.astype(np.float32), y.astype(np.int64)


def train_digits(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray, *, epochs: int = 4,
                 lr: float = 0.05, seed: int = 0, width: int = 32, batch_size: int = 64, mean: float | None = None,
                 std: float | None = None, on_epoch: Callable[[dict[str, float]], None] | None = None) -> TrainResult:
    """Train the service's DigitsCNN on raw images (N, 8, 8), values 0..16, normalized with the service's
    ``mean``/``std`` (default: the original training set's, which the preprocessing model applies, so a retrained
    model fits the same service). SGD with momentum 0.9, cross-entropy, CPU, one thread (seconds).

    ``history``: per epoch ``train_loss``, ``val_loss``, ``val_accuracy`` (0..1); ``on_epoch(row)`` after each."""
    import torch

    from lab_utils.models import fit_digits_cnn  # lazy: pulls torch

    epochs, batch_size, width = (check_int(v, n, "train_digits") for v, n in
                                 ((epochs, "epochs"), (batch_size, "batch_size"), (width, "width")))
    if not (isinstance(lr, (int, float)) and 0 < lr < 10):
        raise ValueError(f"train_digits: lr={lr!r}; a learning rate such as 0.05")
    x_train, y_train = _check_images(x_train, y_train, "train_digits(x_train, y_train)")
    x_val, y_val = _check_images(x_val, y_val, "train_digits(x_val, y_val)")
    if mean is None or std is None:
        ref = digits_data()
        mean, std = ref["mean"], ref["std"]
    params = {"epochs": epochs, "lr": float(lr), "seed": seed, "width": width, "batch_size": batch_size,
              "optimizer": "SGD(momentum=0.9)", "train_images": len(y_train), "val_images": len(y_val),
              "norm_mean": float(mean), "norm_std": float(std)}
    xt = torch.from_numpy((x_train[:, None] - mean) / std)
    xv = torch.from_numpy((x_val[:, None] - mean) / std)
    t0 = time.perf_counter()
    model, history = fit_digits_cnn(xt, torch.from_numpy(y_train), epochs=epochs, lr=lr, seed=seed, width=width,
                                    batch_size=batch_size, val=(xv, torch.from_numpy(y_val)), on_epoch=on_epoch)
    return TrainResult(model, history, params, dataset_sha256(x_train, y_train), dataset_sha256(x_val, y_val),
                       time.perf_counter() - t0)


# --- runs -----------------------------------------------------------------------------------------------------


@dataclass
class RunRecord:
    """A logged run: its ids, final metrics, data hash and commit."""

    run_id: str
    run_name: str
    experiment_id: str
    metrics: dict[str, float]
    data_sha256: str
    git_commit: str
    artifact_uri: str
    result: TrainResult | None = field(default=None, repr=False)


def _experiment_id(client: Any, experiment: str) -> str:
    if (exp := client.get_experiment_by_name(experiment)) is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(experiment)
    except Exception:  # created meanwhile by another client: read it back
        if (exp := client.get_experiment_by_name(experiment)) is None:
            raise
        return exp.experiment_id


def log_run(tracking: Any, result: TrainResult, *, experiment: str = EXPERIMENT, run_name: str | None = None,
            data_name: str = "digits", tags: Mapping[str, str] | None = None) -> RunRecord:
    """Log a trained ``result`` as one MLflow run: params, per-epoch metrics (step = epoch), the exports under
    ``model/`` (``model.onnx`` and any external-data file beside it, and ``model.pt``, TorchScript), and tags
    ``data_sha256``, ``val_sha256``, ``data_name``, ``git_commit``, ``git_dirty``.
    A failure marks the run FAILED (never left RUNNING)."""
    from mlflow.entities import Metric, Param

    client = _client(tracking)
    exp_id = _experiment_id(client, experiment)
    sha, dirty = git_commit()
    all_tags = {"data_sha256": result.data_sha256, "val_sha256": result.val_sha256, "data_name": data_name,
                "git_commit": sha, "git_dirty": str(dirty).lower() if dirty is not None else "unknown",
                **(tags or {})}
    run = client.create_run(exp_id, run_name=run_name, tags=all_tags)
    run_id = run.info.run_id
    try:
        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now_ms, int(row["epoch"])) for row in result.history
                   for k, v in row.items() if k != "epoch"]
        metrics.append(Metric("train_s", result.train_s, now_ms, 0))
        client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in result.params.items()])
        with temporary_folder("mlflow-export") as tmp:
            # model.pt (TorchScript) beside model.onnx: a GPU deployment serves it with torch (ensemble's engines)
            export_classifier(result.model, tmp, torchscript=True)
            # the whole folder: torch's exporter may keep the weights beside the graph (model.onnx.data)
            client.log_artifacts(run_id, str(tmp), artifact_path=MODEL_ARTIFACT)
        client.set_terminated(run_id, "FINISHED")
    except BaseException:
        with contextlib.suppress(Exception):
            client.set_terminated(run_id, "FAILED")
        raise
    run = client.get_run(run_id)
    return RunRecord(run_id, run.info.run_name, exp_id, result.metrics, result.data_sha256, sha,
                     run.info.artifact_uri, result)


def log_training_run(tracking: Any, *, y_train: np.ndarray | None = None, epochs: int = 4, lr: float = 0.05,
                     seed: int = 0, width: int = 32, run_name: str | None = None,
                     data_name: str = "digits") -> RunRecord:
    """Train on the service's training digits, labelled ``y_train`` (default: their own labels), validate on the
    held-out digits, and log it (``log_run``)."""
    data = digits_data()
    y_train = data["y_train"] if y_train is None else y_train
    result = train_digits(data["x_train"], y_train, data["x_test"], data["y_test"], epochs=epochs, lr=lr, seed=seed,
                          width=width, mean=data["mean"], std=data["std"])
    return log_run(tracking, result, run_name=run_name, data_name=data_name)


def compare_runs(tracking: Any, experiment: str = EXPERIMENT, metric: str = METRIC) -> pd.DataFrame:
    """The experiment's finished runs, best ``metric`` first: run_id, run_name, the params, the final metrics,
    data_sha256, git_commit, start time (UTC)."""
    client = _client(tracking)
    if (exp := client.get_experiment_by_name(experiment)) is None:
        raise TrackingError(f"no experiment {experiment!r} on {client.tracking_uri}: log a run first")
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'", max_results=1000)
    df = pd.DataFrame([{"run_id": r.info.run_id, "run_name": r.info.run_name,
                        **{k: _num(v) for k, v in r.data.params.items() if k not in ("optimizer",)}, **r.data.metrics,
                        "data_sha256": r.data.tags.get("data_sha256", ""),
                        "git_commit": r.data.tags.get("git_commit", ""),
                        "start_time": pd.to_datetime(r.info.start_time, unit="ms", utc=True)} for r in runs])
    if df.empty or metric not in df.columns:
        return df
    return df.sort_values(metric, ascending=False, kind="stable").reset_index(drop=True)


def _num(text: str) -> Any:
    for cast in (int, float):
        with contextlib.suppress(ValueError):
            return cast(text)
    return text


def metric_history(tracking: Any, run_id: str, key: str = METRIC) -> pd.DataFrame:
    """One metric of one run over its steps (epochs): columns ``step`` and ``value``."""
    hist = _client(tracking).get_metric_history(run_id, key)
    return pd.DataFrame([{"step": m.step, "value": m.value} for m in hist], columns=["step", "value"])


# --- the registry ----------------------------------------------------------------------------------------------


def register_run(tracking: Any, run_id: str, name: str = REGISTERED_MODEL, alias: str | None = None,
                 description: str = "") -> str:
    """Register the ONNX file of run ``run_id`` as a new version of ``name`` (created if new); optionally set
    ``alias`` on it. Returns the version (a string, as MLflow gives it)."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking)
    run = client.get_run(run_id)
    if not any(f.path == f"{MODEL_ARTIFACT}/{ONNX_FILE}" for f in client.list_artifacts(run_id, MODEL_ARTIFACT)):
        raise TrackingError(f"run {run_id} has no {MODEL_ARTIFACT}/{ONNX_FILE}: log it with log_run() first")
    try:
        client.get_registered_model(name)
    except MlflowException:
        with contextlib.suppress(MlflowException):  # created meanwhile
            client.create_registered_model(name, description="The service's digits classifier (ONNX)")
    mv = client.create_model_version(name, source=f"runs:/{run_id}/{MODEL_ARTIFACT}", run_id=run_id,
                                     tags={k: run.data.tags.get(k, "") for k in ("data_sha256", "git_commit")},
                                     description=description or None)
    if alias:
        set_alias(client, name, alias, mv.version)
    return str(mv.version)


def register_best(tracking: Any, experiment: str = EXPERIMENT, name: str = REGISTERED_MODEL,
                  metric: str = METRIC, alias: str | None = "champion") -> tuple[str, str]:
    """Register the experiment's run with the highest ``metric``; (run_id, version)."""
    df = compare_runs(tracking, experiment, metric)
    if df.empty or metric not in df.columns or df[metric].isna().all():
        raise TrackingError(f"experiment {experiment!r} has no finished run with metric {metric!r}")
    run_id = str(df.dropna(subset=[metric]).iloc[0]["run_id"])
    return run_id, register_run(tracking, run_id, name, alias)


def set_alias(tracking: Any, name: str, alias: str, version: str | int) -> None:
    """Point ``alias`` (``champion``, ``challenger``...) of model ``name`` at ``version`` (moved if it was set)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", alias or "") or re.fullmatch(r"[vV]\d+|latest", alias):
        raise ValueError(f"alias={alias!r}: a name such as 'champion' (letters, digits, _ and -; not 'latest' or "
                         "'v<N>', which MLflow reserves)")
    _client(tracking).set_registered_model_alias(name, alias, str(version))


@dataclass
class Lineage:
    """Where a registered model version came from: its run, data and code."""

    name: str
    version: str
    aliases: list[str]
    run_id: str
    run_name: str
    experiment: str
    data_sha256: str
    val_sha256: str
    data_name: str
    git_commit: str
    git_dirty: str
    source: str
    artifact_uri: str
    params: dict[str, str]
    metrics: dict[str, float]

    def table(self) -> pd.DataFrame:
        """Two columns, what and value: the answer to "which data and which code produced this model"."""
        rows = [("model", f"{self.name} version {self.version}"), ("aliases", ", ".join(self.aliases) or "-"),
                ("run", f"{self.run_name} ({self.run_id})"), ("experiment", self.experiment),
                ("data", f"{self.data_name}, sha256 {self.data_sha256}"), ("git commit", self.git_commit),
                ("uncommitted changes", self.git_dirty), ("artifact", self.source),
                *((f"param {k}", v) for k, v in sorted(self.params.items())),
                *((f"metric {k}", f"{v:.4g}") for k, v in sorted(self.metrics.items()))]
        return pd.DataFrame(rows, columns=["what", "value"])


def _version(client: Any, name: str, version: str | int | None, alias: str | None) -> Any:
    from mlflow.exceptions import MlflowException

    if (version is None) == (alias is None):
        raise ValueError("give exactly one of version= (e.g. 2) or alias= (e.g. 'champion')")
    try:
        if alias is not None:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, str(version))
    except MlflowException as err:
        what = f"alias {alias!r}" if alias is not None else f"version {version}"
        raise TrackingError(f"model {name!r} has no {what} on {client.tracking_uri}: {err.message}") from None


def lineage(tracking: Any, name: str = REGISTERED_MODEL, version: str | int | None = None,
            alias: str | None = None) -> Lineage:
    """From a served model (registry ``name`` and ``version`` or ``alias``) back to its run, data hash and commit."""
    client = _client(tracking)
    mv = _version(client, name, version, alias)
    if not mv.run_id:
        raise TrackingError(f"{name} version {mv.version} was registered without a run: no lineage to follow")
    run = client.get_run(mv.run_id)
    exp = client.get_experiment(run.info.experiment_id)
    tags = run.data.tags
    return Lineage(name, str(mv.version), list(getattr(mv, "aliases", []) or []), run.info.run_id, run.info.run_name,
                   exp.name, tags.get("data_sha256", ""), tags.get("val_sha256", ""), tags.get("data_name", ""),
                   tags.get("git_commit", ""), tags.get("git_dirty", ""), mv.source, run.info.artifact_uri,
                   dict(run.data.params), dict(run.data.metrics))


def download_onnx(tracking: Any, name: str = REGISTERED_MODEL, version: str | int | None = None,
                  alias: str | None = None, dst: str | os.PathLike[str] = ".") -> Path:
    """The ``model.onnx`` of a registered version (by ``version`` or ``alias``), downloaded into ``dst`` with the
    files beside it (its external weights, when the exporter wrote them apart). Returns the ``.onnx`` path."""
    client = _client(tracking)
    mv = _version(client, name, version, alias)
    return Path(client.download_artifacts(mv.run_id, MODEL_ARTIFACT, str(dst))) / ONNX_FILE
