"""Lab 05's operations: the model under load (phases of closed-loop clients), health checks, a watchdog that restarts a
dead or hung server with backoff, and the failure drill that kills the server under load and watches it recover.

The watchdog is an owned thread: it stops on ``stop()``, on context exit and at interpreter exit, and never stops the
server it watches. Every wait here is an Event wait (interruptible), never a sleep."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from lab_utils.monitoring.prometheus import TRITON_JOB, PromAPI
from lab_utils.owned import StartStop
from lab_utils.procs import Background, http_ok, release_at_exit, stop_at_exit, wait_until
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.repository import INPUT_NAME
from lab_utils.timing import Ticks

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# --- the lab's model ---------------------------------------------------------------------------------------

MODEL_NAME = "mm"

# Lab 04's model (``triton_model.py``: the MLP, requests crossing the python backend by DLPack), small, with
# an added service time so that queueing shows on any machine. One model file serves both labs.
MODEL_PRESET = {"in_features": 16, "width": 64, "depth": 2, "out_features": 16}


def write_model(repo: str | Path, *, gpu: bool = False, max_batch_size: int = 4, queue_delay_us: int = 500,
                base_ms: float = 4.0, per_item_ms: float = 1.0, gpu_matrix: int = 4096, gpu_reps: int = 1) -> Path:
    """Write the lab's model ``mm`` into ``repo`` (lab 04's python-backend MLP, dynamic batching, one instance);
    returns the repo.

    CPU instance: ONNX Runtime runs the MLP, then each execution waits ``base_ms + per_item_ms`` x batch (a
    simulated service time: a sleep leaves the machine's cores to the clients and Prometheus). GPU instance:
    torch runs the MLP, then ``gpu_reps`` x batch fp32 matmuls of ``gpu_matrix``^2, so the GPU metrics move."""
    repo = Path(repo)
    if gpu:
        service: dict[str, str | float] = {"gpu_matmul_n": gpu_matrix, "gpu_matmul_reps": gpu_reps}
    else:
        service = {"service_ms": float(base_ms), "service_per_item_ms": float(per_item_ms)}
    triton_repo.build_mlp_model(repo, MODEL_NAME, preset=MODEL_PRESET, gpus=1 if gpu else 0,
                                kind="KIND_GPU" if gpu else "KIND_CPU", max_batch_size=max_batch_size,
                                dynamic_batching={"max_queue_delay_microseconds": queue_delay_us}, parameters=service)
    return repo


def reference_output(repo: str | Path, x: np.ndarray) -> np.ndarray:
    """What ``mm`` must answer for ``x`` ([N, 16] float32), computed in NumPy from the deployed weights."""
    return triton_repo.reference_mlp(Path(repo) / MODEL_NAME / "1", x)


def make_inputs(features: int = MODEL_PRESET["in_features"]) -> Callable[[], dict[str, np.ndarray]]:
    """One request's inputs for ``mm``: a batch of one row of ``features`` floats."""
    rng = np.random.default_rng(0)
    return lambda: {INPUT_NAME: rng.standard_normal((1, features)).astype(np.float32)}


# --- load phases -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """A stretch of closed-loop load: ``concurrency`` clients for ``duration_s``."""

    name: str
    concurrency: int
    duration_s: float


def default_phases(quick: bool) -> list[Phase]:
    """Ramp, steady, overload. The overload runs many more clients than the model's instances can serve,
    so requests queue: the latency grows while the throughput stays flat."""
    if quick:
        # 16 x the steady clients in both sizes: in a closed loop the latency grows with the clients per request
        # served, and at 8 x on a busy 2-core machine the overload's p99 once stayed under twice the steady p99
        return [Phase("ramp", 1, 2), Phase("ramp", 2, 2), Phase("steady", 4, 6), Phase("overload", 64, 8)]
    return [Phase("ramp", 1, 10), Phase("ramp", 2, 10), Phase("ramp", 4, 10), Phase("steady", 4, 30),
            Phase("overload", 64, 30)]


def _field(res: Any, *names: str, default: Any = math.nan) -> Any:
    for n in names:
        if isinstance(res, Mapping) and n in res:
            return res[n]
        if hasattr(res, n):
            return getattr(res, n)
    return default


def run_phases(phases: Sequence[Phase], load: Callable[[int, float], Any],
               progress: Callable[..., Iterable[Any]] | None = None) -> pd.DataFrame:
    """Run each phase with ``load(concurrency, duration_s)`` (lab 04's ``run_load``, bound to a model);
    a data frame with each phase's wall-clock start and end (unix seconds, for the PromQL range queries) and
    results. ``progress``: a ``progress(iterable, total=, desc=)`` wrapper over the phases
    (``lab_utils.widgets.progress``); None shows nothing."""
    rows = []
    for ph in progress(phases, total=len(phases), desc="load phases") if progress else phases:
        start = time.time()
        res = load(ph.concurrency, ph.duration_s)
        end = time.time()
        rows.append({"phase": ph.name, "concurrency": ph.concurrency, "start": start, "end": end,
                     "requests": _field(res, "requests"),
                     "errors": _field(res, "errors", default=0),
                     "throughput_rps": _field(res, "throughput_infer_s"),
                     "p50_ms": _field(res, "p50_ms"), "p99_ms": _field(res, "p99_ms"), "result": res})
    return pd.DataFrame(rows)


def chunked_load(target: Callable[[], str], load: Callable[[str, int, float], Any], concurrency: int,
                 duration_s: float | None = None, chunk_s: float = 1.0,
                 stop: threading.Event | None = None) -> pd.DataFrame:
    """Closed-loop load in chunks of ``chunk_s``, each aimed at ``target()`` (the server's current address, so
    the clients follow a restarted server as a service address would), for ``duration_s`` or until ``stop`` is
    set; one row per chunk: start, end, requests, errors, p99. ``load(url, concurrency, seconds)`` runs one
    chunk (lab 04's ``run_load``)."""
    if duration_s is None and stop is None:
        raise ValueError("chunked_load needs duration_s (seconds) or stop (a threading.Event), or it never ends")
    stop = stop or threading.Event()
    end = time.time() + duration_s if duration_s is not None else math.inf
    rows = []
    while time.time() < end and not stop.is_set():
        t0 = time.time()
        seconds = max(0.2, min(chunk_s, end - t0))
        try:
            res = load(target(), concurrency, seconds)
            rows.append({"start": t0, "end": time.time(), "requests": _field(res, "requests", default=0),
                         "errors": _field(res, "errors_total", "errors", default=0),
                         "p99_ms": _field(res, "p99_ms"), "error": ""})
        except Exception as err:  # the clients could not even start (no server there): a failed chunk
            rows.append({"start": t0, "end": time.time(), "requests": 0, "errors": concurrency, "p99_ms": math.nan,
                         "error": f"{type(err).__name__}: {str(err)[:120]}"})
            stop.wait(min(0.2, max(0.0, end - time.time())))
    return pd.DataFrame(rows, columns=["start", "end", "requests", "errors", "p99_ms", "error"])


# --- health and the watchdog -----------------------------------------------------------------------------


def health(server: Any) -> dict[str, Any]:
    """Liveness (the process serves HTTP) and readiness (its models can take requests) of a Triton server."""
    live, live_why = http_ok(f"{server.http_url}/v2/health/live")
    ready, ready_why = http_ok(f"{server.http_url}/v2/health/ready")
    return {"live": live, "live_http": live_why, "ready": ready, "ready_http": ready_why}


class Watchdog(StartStop):
    """Restarts a server that died or stopped answering, with exponential backoff.

    Every ``check_s``: ``server.alive()`` and, when given, ``liveness(server)`` -> URL (``failures`` failed probes in a
    row, ``probe_timeout_s`` each, count as hung). A dead or hung server is stopped, then restarted after ``backoff_s``
    × 2^k (k restarts in a row, at most ``max_backoff_s``; up ``stable_s`` resets k); after ``max_restarts`` it gives up
    (``gave_up``). ``on_restart(server)`` runs after each restart. ``pause()``: no check or restart in progress after
    it, so a ``server.stop()`` is not taken for a crash; ``stop()`` ends the watchdog, never the server."""

    def __init__(self, server: Any, *, check_s: float = 0.25, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 max_restarts: int = 5, stable_s: float = 30.0, failures: int = 3, probe_timeout_s: float = 2.0,
                 liveness: Callable[[Any], str] | None = None, on_restart: Callable[[Any], Any] | None = None):
        if check_s <= 0 or backoff_s < 0 or max_restarts < 1 or probe_timeout_s <= 0:
            raise ValueError("check_s > 0, backoff_s >= 0, max_restarts >= 1 and probe_timeout_s > 0 are needed")
        self.server = server
        self.check_s, self.backoff_s, self.max_backoff_s = check_s, backoff_s, max_backoff_s
        self.max_restarts, self.stable_s, self.failures = max_restarts, stable_s, failures
        self.probe_timeout_s, self.liveness = probe_timeout_s, liveness
        self.on_restart = on_restart
        self.events: list[dict[str, Any]] = []
        self.restarts, self.gave_up, self._streak, self._restarted_at = 0, False, 0, 0.0
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._halt = threading.Event()  # set by pause() and stop(): cuts a probe pause or a backoff short
        self._busy = threading.RLock()  # held while the loop checks or restarts; pause() waits for it
        self._thread: threading.Thread | None = None

    def _event(self, what: str, **extra: Any) -> None:
        self.events.append({"time": time.time(), "event": what, **extra})

    def start(self) -> Watchdog:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            if not self._paused.is_set():
                self._halt.clear()
            self._thread = threading.Thread(target=self._loop, name="nvlab-watchdog", daemon=True)
            self._thread.start()
            stop_at_exit(self)
            self._event("watching", pid=getattr(self.server, "pid", None))
        return self

    def stop(self) -> None:
        """Stop watching (the server keeps running; stop it yourself). Safe to call twice."""
        self._stop.set()
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        release_at_exit(self)

    def pause(self) -> None:
        """Stop restarting for now (a planned stop or upgrade). Returns once a check or restart in progress has
        finished (a restart under way completes and is counted; a backoff wait is cut short, with no restart)."""
        self._paused.set()
        self._halt.set()
        with self._busy:
            pass

    def resume(self) -> None:
        """Watch again: a server found dead now is restarted, with the backoff where it was."""
        self._paused.clear()
        if not self._stop.is_set():
            self._halt.clear()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _halted(self) -> bool:
        return self._stop.is_set() or self._paused.is_set()

    def _healthy(self) -> tuple[bool, str]:
        if not self.server.alive():
            return False, "process exited"
        if self.liveness is None:
            return True, ""
        for bad in range(1, max(1, self.failures) + 1):  # one probe at least
            ok, why = http_ok(self.liveness(self.server), timeout_s=self.probe_timeout_s)
            if ok:
                return True, ""
            if bad < self.failures and self._halt.wait(self.check_s):
                return True, ""  # paused or stopped between probes: no verdict
        return False, f"liveness failed {bad} times ({why})"

    def _loop(self) -> None:
        while not self._stop.wait(self.check_s):
            with self._busy:
                if not self._halted():
                    self._check_once()

    def _check_once(self) -> None:
        """One look at the server, and a restart if it is dead or hung (the caller holds ``_busy``)."""
        ok, why = self._healthy()
        if self._halted():
            return  # a stop during the check was planned (paused) or ends the watch: not a crash
        if ok:
            if self._streak and time.time() - self._restarted_at > self.stable_s:
                self._streak = 0  # stayed up: the next failure starts the backoff from the beginning
            return
        if self._streak >= self.max_restarts:
            if not self.gave_up:
                self.gave_up = True
                self._event("gave up", reason=f"{self._streak} restarts in a row did not stay up")
            return
        delay = min(self.backoff_s * 2**self._streak, self.max_backoff_s)
        proc = getattr(self.server, "_proc", None) or getattr(self.server, "proc", None)
        self._event("down", reason=why, exit_code=proc.poll() if proc is not None else None, backoff_s=delay)
        with contextlib.suppress(Exception):
            self.server.stop()  # the whole process group: no stub or child keeps the ports
        if self._halt.wait(delay) or self._halted():
            self._event("not restarted", reason="paused" if self._paused.is_set() else "watchdog stopped")
            return
        self._streak += 1
        try:
            t0 = time.time()
            getattr(self.server, "restart", self.server.start)()  # without restart(): start, as stopped above
            self.restarts += 1
            self._restarted_at = time.time()
            self._event("restarted", seconds=round(time.time() - t0, 2), pid=getattr(self.server, "pid", None))
            if self.on_restart is not None:
                self.on_restart(self.server)
        except Exception as err:  # a failed start counts as a failure: the backoff grows
            self._event("restart failed", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")

    def timeline(self) -> pd.DataFrame:
        """The events (watching, down, restarted, restart failed, gave up...) with their unix times."""
        return pd.DataFrame(self.events)


def kill(server: Any) -> int:
    """SIGKILL the server's main process, as a crash would (its children follow: PR_SET_PDEATHSIG). The pid."""
    if (pid := server.pid) is None:
        raise RuntimeError("the server has no process to kill (not started, or not owned here)")
    os.kill(pid, signal.SIGKILL)
    return pid


# --- the failure drill ------------------------------------------------------------------------------------


@dataclass
class DrillResult:
    """What the drill saw, each step with its wall-clock time (unix seconds)."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    load: pd.DataFrame | None = None  # the load generator's chunks: start, end, requests, errors...
    watchdog_events: pd.DataFrame | None = None

    on_step: Callable[[str], None] | None = field(default=None, repr=False)  # told each step as it is recorded

    def step(self, what: str, t: float | None = None, **extra: Any) -> None:
        self.steps.append({"step": what, "time": time.time() if t is None else t, **extra})
        if self.on_step is not None:
            self.on_step(what)

    def time_of(self, what: str) -> float | None:
        return next((s["time"] for s in self.steps if s["step"] == what), None)

    def table(self) -> pd.DataFrame:
        """The steps with ``after_kill_s``, seconds since the kill."""
        df = pd.DataFrame(self.steps)
        if not df.empty:
            df["after_kill_s"] = (df["time"] - (self.time_of("server killed") or df["time"].iloc[0])).round(2)
        return df


def failure_drill(server: Any, metrics: PromAPI | None, watchdog: Watchdog,
                  load: Callable[[threading.Event], pd.DataFrame], *, kill_after_s: float,
                  after_recovery_s: float = 3.0, alert: str = "TritonServerDown", timeout_s: float = 60.0,
                  up_expr: str = f'up{{job="{TRITON_JOB}"}}',
                  progress: Callable[..., Iterable[Any]] | None = None) -> DrillResult:
    """Kill the server under load and watch the recovery: client errors, ``up == 0`` in Prometheus, the alert firing,
    the watchdog's restart, ``up == 1`` again and requests succeeding again.

    ``load(stop)`` runs closed-loop load (in a thread) until ``stop``, set ``after_recovery_s`` after the recovery (or a
    step's timeout), and returns its chunks. ``metrics=None`` (no Prometheus): the server's liveness stands in for
    ``up`` and the alert. ``progress``: ``lab_utils.widgets.progress``, one step per step of the drill."""
    res = DrillResult()
    # the drill's steps up to the load's end, when all goes well: load started, killed, (up == 0, alert firing,)
    # restarted, up == 1 or live again, (alert resolved)
    ticks = Ticks(progress, total=7 if metrics is not None else 4, desc="failure drill")
    res.on_step = ticks.step
    stop = threading.Event()  # ends the load; waits below are Event waits: interruptible, no bare sleeps
    t_load = time.time()
    bg = Background(load, stop, name="nvlab-drill-load")
    res.step("load started", t_load)
    pause = threading.Event()  # never set: a sleep that is an Event wait
    try:
        pause.wait(kill_after_s)
        pid = kill(server)
        res.step("server killed", pid=pid)
        if metrics is not None:
            metrics.wait_for(f"{up_expr} == 0", timeout_s=timeout_s, poll_s=0.25)
            res.step("up == 0 in Prometheus")
            try:
                metrics.wait_for_alert(alert, "firing", timeout_s=timeout_s, poll_s=0.25)
                res.step(f"alert {alert} firing")
            except TimeoutError as err:
                res.step(f"alert {alert} did not fire", error=str(err))
        wait_until(lambda: watchdog.restarts > 0 or watchdog.gave_up, timeout_s, poll_s=0.1)
        if restarted := next((e for e in watchdog.events if e["event"] == "restarted"), None):
            res.step("watchdog restarted the server", restarted["time"], pid=restarted.get("pid"))
        if metrics is not None:
            metrics.wait_for(f"{up_expr} == 1", timeout_s=timeout_s, poll_s=0.25)
            res.step("up == 1 again")
            pause.wait(after_recovery_s)
            stop.set()
            if wait_until(lambda: (df := metrics.alerts())[df["alertname"] == alert].empty, timeout_s, 0.25):
                res.step(f"alert {alert} resolved")
        else:
            if wait_until(lambda: health(server)["live"], timeout_s, 0.25):
                res.step("live again")
                pause.wait(after_recovery_s)
    finally:
        stop.set()
        bg.thread.join(timeout=timeout_s)
        ticks.close()  # the bar ends with the load, however the drill ended
        res.on_step = None
    if bg.error is not None:
        raise bg.error
    res.load = bg.result
    res.step("load finished")
    res.watchdog_events = watchdog.timeline()
    return res


def plot_drill(drill: DrillResult, up: pd.DataFrame | None = None) -> Figure:
    """The drill on one time axis: requests and client errors per load chunk, ``up`` as Prometheus saw it
    (when given), and the steps (kill, alert, restart) as vertical lines."""
    import matplotlib.pyplot as plt

    t_kill = drill.time_of("server killed") or 0.0
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 4.6), sharex=True)
    chunks = drill.load
    if chunks is not None and len(chunks):
        mid = (chunks["start"] + chunks["end"]) / 2 - t_kill
        secs = (chunks["end"] - chunks["start"]).clip(lower=1e-3)
        ax1.plot(mid, chunks["requests"] / secs, marker="o", label="successful requests/s (client)")
        ax1.plot(mid, chunks["errors"] / secs, marker="x", color="tab:red", label="failed requests/s (client)")
        ax1.legend(fontsize=8)
    ax1.set_ylabel("requests/s")
    if up is not None and not up.empty:
        for inst, g in up.groupby("instance"):
            ax2.step(g["time"] - t_kill, g["value"], where="post", label=f"up{{instance={inst}}}")
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no Prometheus: up not recorded", ha="center", va="center", transform=ax2.transAxes,
                 color="gray")
    ax2.set(ylim=(-0.1, 1.2), ylabel="up", xlabel="seconds after the kill")
    for s in drill.steps:
        if s["step"] in ("load started", "load finished"):
            continue
        for ax in (ax1, ax2):
            ax.axvline(s["time"] - t_kill, color="gray", lw=0.8, ls="--")
        ax2.text(s["time"] - t_kill, 1.15, s["step"], rotation=90, fontsize=7, va="top", ha="right")
    fig.tight_layout()
    return fig
