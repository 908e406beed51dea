"""Lab 05's live view: while a load runs, QPS, p95 and queue time per request from Prometheus, refreshed every few
seconds; it stops when the load stops (the ``with`` block around the load ends)."""

from __future__ import annotations

import contextlib
import html
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import ipywidgets as w
import pandas as pd
from IPython.display import display

from lab_utils.monitoring.prometheus import window_seconds
from lab_utils.widgets.core import Panel, interactive


def queries(window: str = "5s") -> dict[str, str]:
    """The view's PromQL, by column: requests/s, p95 in ms (Triton's summary), queue ms per request."""
    return {
        "qps": f"sum(rate(nv_inference_request_success[{window}]))",
        # a quantile cannot be averaged: the worst model's p95 is shown
        "p95_ms": 'max(nv_inference_request_summary_us{quantile="0.95"}) / 1000',
        "queue_ms": f"sum(rate(nv_inference_queue_duration_us[{window}])) "
                    f"/ sum(rate(nv_inference_request_success[{window}])) / 1000"}


class LiveView(Panel):
    """Samples ``metrics`` (a ``PromAPI``) every ``every_s`` seconds in a thread while running; ``samples`` is the
    table (seconds since start, qps, p95_ms, queue_ms); NaN where Prometheus has no value yet."""

    def __init__(self, metrics: Any, window: str = "5s", every_s: float = 2.0):
        try:
            window_seconds(window)
        except ValueError:
            raise ValueError(f"live_view(window={window!r}): a PromQL range such as '5s' or '1m' (the rate's "
                             "window)") from None
        if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not 0.1 <= every_s <= 3600:
            raise ValueError(f"live_view(every_s={every_s!r}): seconds between readings, from 0.1 to 3600")
        self.metrics, self.every_s = metrics, every_s
        self.queries = queries(window)
        self.rows: list[dict[str, float]] = []
        self.html = w.HTML("<i>waiting for the load ...</i>")
        self.widget = self.html
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.time()

    @property
    def samples(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["t_s", *self.queries])

    def sample(self) -> dict[str, float]:
        """One reading of every query now; appended to ``samples`` and shown."""
        row = {"t_s": round(time.time() - self._t0, 1)}
        for key, expr in self.queries.items():
            try:
                row[key] = self.metrics.value(expr)
            except Exception:  # noqa: BLE001 (a query that fails once, e.g. while a target restarts, reads as NaN)
                row[key] = math.nan
        self.rows.append(row)
        self.html.value = self.to_html()
        return row

    def to_html(self) -> str:
        """The latest reading large, the previous ones as a small table."""
        if not self.rows:
            return "<i>no reading yet</i>"
        last = self.rows[-1]

        def fmt(v: float, unit: str) -> str:
            return "–" if v is None or math.isnan(v) else f"{v:,.1f} {unit}"

        head = (f"<b>t = {last['t_s']:.0f} s</b> &nbsp; QPS <b>{fmt(last['qps'], 'req/s')}</b> &nbsp; "
                f"p95 <b>{fmt(last['p95_ms'], 'ms')}</b> &nbsp; queue <b>{fmt(last['queue_ms'], 'ms/request')}</b>")
        table = self.samples.tail(8).round(2).to_html(index=False)
        state = "running" if self._thread and self._thread.is_alive() and not self._stop.is_set() else "stopped"
        return f"<div>{head} <small>({html.escape(state)}, every {self.every_s:g} s)</small></div>{table}"

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def start(self) -> LiveView:
        """Start refreshing (a daemon thread: a kernel that dies does not wait for it)."""
        self._t0 = time.time()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="nvlab-live-view", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop refreshing after one last reading; safe to call twice."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.every_s + 30)
        self._thread = None
        self.sample()

    def headless(self) -> None:
        print(f"live view (refreshes in JupyterLab): {len(self.rows)} readings, every {self.every_s:g} s")
        display(self.samples.round(2))


@contextlib.contextmanager
def live_view(metrics: Any, window: str = "5s", every_s: float = 2.0) -> Iterator[LiveView | None]:
    """``with live_view(metrics, window): run_the_load()``: the view refreshes while the block runs and stops with
    it. Headless, the readings are printed as a table when the block ends. ``metrics`` None (no Prometheus): says
    so, and the block runs without a view."""
    if metrics is None:
        print("no Prometheus here: no live view (the load runs all the same)")
        yield None
        return
    view = LiveView(metrics, window, every_s)
    if interactive():
        display(view.widget)
    view.start()
    try:
        yield view
    finally:
        view.stop()
        if not interactive():
            view.headless()
