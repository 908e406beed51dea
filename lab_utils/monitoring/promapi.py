"""Prometheus' HTTP API: queries (instant, range, a single value), alerts, rules and targets as data frames, and
waits for a series or an alert. What a lab's own server and the compose stack's both answer (``PromAPI``).

Design notes: docs/internals.md#lab_utilsmonitoringprometheuspy"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from lab_utils.procs import http_ok

URL_ENV = "PROMETHEUS_URL"


class PrometheusError(RuntimeError):
    """Prometheus could not start or answer; the message says why and shows the log's tail."""


class QueryError(PrometheusError):
    """A PromQL query failed; the message names the expression, ``why`` is Prometheus' own words."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why or message


# --- results as data frames ------------------------------------------------------------------------


def frame(data: Mapping[str, Any]) -> pd.DataFrame:
    """A data frame from the ``data`` of a query answer: one column per label, then ``time`` and ``value``.

    A range result comes in long form (one row per series and step); ``pivot(df, "model")`` widens it."""
    kind, result = data.get("resultType"), data.get("result")
    if kind in ("scalar", "string"):
        rows = [{"time": float(result[0]), "value": _num(result[1])}]  # type: ignore[index]
    elif kind in ("vector", "matrix"):  # one sample per series, or every sample of each
        rows = [{**r["metric"], "time": float(t), "value": _num(v)} for r in result or []
                for t, v in ([r["value"]] if kind == "vector" else r["values"])]
    else:
        raise PrometheusError(f"unknown result type {kind!r}")
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=["time", "value"])
    labels = sorted(c for c in df.columns if c not in ("time", "value"))
    return df[[*labels, "time", "value"]].reset_index(drop=True)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def pivot(df: pd.DataFrame, by: str | Sequence[str] | None = None) -> pd.DataFrame:
    """A long range-query frame as one column per series (named by ``by`` labels), indexed by time."""
    if df.empty:
        return df
    labels = [c for c in df.columns if c not in ("time", "value")]
    keys = [by] if isinstance(by, str) else list(by or [c for c in labels if c not in ("__name__",)])
    keys = [k for k in keys if k in df.columns]
    name = df[keys].astype(str).agg(",".join, axis=1) if keys else "value"
    out = df.assign(series=name).pivot_table(index="time", columns="series", values="value", aggfunc="first")
    out.columns.name = None
    return out


# --- the HTTP API ----------------------------------------------------------------------------------


class PromAPI:
    """Queries against a Prometheus server's HTTP API (``url`` like ``http://127.0.0.1:9090``)."""

    kind = "external"

    def __init__(self, url: str, timeout_s: float = 30.0):
        if not re.match(r"^https?://", url or ""):
            raise ValueError(f"Prometheus URL {url!r}: expected http://host:port")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.notes: list[str] = []

    def describe(self) -> str:
        return f"Prometheus at {self.url} (from ${URL_ENV})"

    # transport
    def _get(self, path: str, params: Mapping[str, Any] | None = None, *, expr: str | None = None,
             method: str = "GET") -> Any:
        query = urllib.parse.urlencode({k: v for k, v in (params or {}).items() if v is not None})
        req = urllib.request.Request(f"{self.url}{path}" + (f"?{query}" if query else ""), method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                payload = r.read()
        except urllib.error.HTTPError as err:
            payload = err.read()
            try:
                answer = json.loads(payload)
            except ValueError:
                raise self._error(f"{path} answered HTTP {err.code}: {payload[:300]!r}", expr) from None
            raise self._error(f"{answer.get('errorType', 'error')}: {answer.get('error', '?')}", expr) from None
        except (urllib.error.URLError, OSError) as err:
            raise self._error(f"cannot reach {self.url}{path}: {err}", expr) from None
        if path.startswith("/-/"):
            return payload.decode(errors="replace")
        answer = json.loads(payload)
        if answer.get("status") != "success":
            raise self._error(f"{answer.get('errorType', 'error')}: {answer.get('error', '?')}", expr)
        return answer.get("data")

    def _error(self, why: str, expr: str | None) -> PrometheusError:
        return QueryError(f"query {expr!r} failed: {why}", why) if expr is not None else PrometheusError(why)

    # queries
    def query(self, expr: str, at: float | None = None) -> pd.DataFrame:
        """An instant query (``/api/v1/query`` for ``expr`` at ``at``, unix seconds; default now) as a data frame
        (one row per series)."""
        _check_expr(expr)
        return frame(self._get("/api/v1/query", {"query": expr, "time": _t(at)}, expr=expr))

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> pd.DataFrame:
        """A range query (``/api/v1/query_range`` for ``expr`` from ``start`` to ``end``, unix seconds) as a long
        data frame (columns: labels..., time, value)."""
        _check_expr(expr)
        if not (step_s > 0 and end >= start):
            raise QueryError(f"query {expr!r}: need step_s > 0 and end >= start (got {step_s}, {start}..{end})")
        return frame(self._get("/api/v1/query_range", {"query": expr, "start": _t(start), "end": _t(end),
                                                       "step": f"{step_s:g}"}, expr=expr))

    def value(self, expr: str, at: float | None = None, default: float = math.nan) -> float:
        """The single number ``expr`` gives (a scalar, or a vector of one series); ``default`` when empty."""
        df = self.query(expr, at)
        if df.empty:
            return default
        if len(df) > 1:
            raise QueryError(f"query {expr!r} gave {len(df)} series where one number was expected: aggregate it "
                             "(e.g. sum(...))")
        return float(df["value"].iloc[0])

    def alerts(self) -> pd.DataFrame:
        """Active alerts (``/api/v1/alerts``): alertname, state (pending/firing), labels, activeAt, value."""
        rows = [{"alertname": a["labels"].get("alertname"), "state": a.get("state"),
                 "severity": a["labels"].get("severity"), "activeAt": a.get("activeAt"), "value": _num(a.get("value")),
                 "labels": {k: v for k, v in a["labels"].items() if k not in ("alertname", "severity")},
                 "summary": a.get("annotations", {}).get("summary", "")}
                for a in self._get("/api/v1/alerts").get("alerts", [])]
        return pd.DataFrame(rows, columns=["alertname", "state", "severity", "activeAt", "value", "labels", "summary"])

    def rules(self) -> pd.DataFrame:
        """Loaded rules (``/api/v1/rules``): group, name, type, state, health, query."""
        rows = [{"group": g["name"], "name": r["name"], "type": r["type"], "state": r.get("state", ""),
                 "health": r.get("health"), "for_s": r.get("duration", 0), "query": r["query"]}
                for g in self._get("/api/v1/rules").get("groups", []) for r in g.get("rules", [])]
        return pd.DataFrame(rows, columns=["group", "name", "type", "state", "health", "for_s", "query"])

    def targets(self) -> pd.DataFrame:
        """Scrape targets (``/api/v1/targets``): job, instance, health, last error, last scrape duration."""
        rows = [{"job": t["labels"].get("job"), "instance": t["labels"].get("instance"), "health": t.get("health"),
                 "lastError": t.get("lastError", ""), "scrape_s": t.get("lastScrapeDuration")}
                for t in self._get("/api/v1/targets").get("activeTargets", [])]
        return pd.DataFrame(rows, columns=["job", "instance", "health", "lastError", "scrape_s"])

    def ready(self) -> bool:
        """True when ``/-/ready`` answers 200 now (within 5 s)."""
        return http_ok(f"{self.url}/-/ready", timeout_s=min(5.0, self.timeout_s))[0]

    # waiting
    def wait_for(self, expr: str, timeout_s: float = 30.0, poll_s: float = 0.5) -> pd.DataFrame:
        """Poll ``expr`` until it returns a series; the frame, or TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while True:
            df = self.query(expr)
            if not df.empty:
                return df
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr!r} did not return a series within {timeout_s:g} s (last result: "
                                   f"{df.to_dict('records')})")
            threading.Event().wait(poll_s)  # interruptible, unlike a sleep

    def wait_for_alert(self, name: str, state: str = "firing", timeout_s: float = 60.0,
                       poll_s: float = 0.5) -> pd.DataFrame:
        """Poll the alerts API until alert ``name`` is in ``state``; its rows, or TimeoutError naming what was seen
        and the rule as Prometheus evaluates it (its expression, threshold included, state and health)."""
        deadline = time.monotonic() + timeout_s
        while True:
            df = self.alerts()
            hit = df[(df["alertname"] == name) & (df["state"] == state)]
            if not hit.empty:
                return hit
            if time.monotonic() > deadline:
                seen = ", ".join(f"{a}={s}" for a, s in zip(df["alertname"], df["state"], strict=True)) or "none"
                rule = self.rules().query("name == @name")
                how = "; ".join(f"its rule `{r.query}` is {r.state or 'not an alert'}, health {r.health}"
                                for r in rule.itertuples()) or "no rule of that name is loaded"
                raise TimeoutError(f"alert {name} was not {state} within {timeout_s:g} s (active alerts: {seen}; "
                                   f"{how})")
            threading.Event().wait(poll_s)  # interruptible, unlike a sleep

    def stop(self) -> None:
        """Nothing to stop: the server belongs to someone else."""

    def __enter__(self) -> PromAPI:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _t(at: float | None) -> str | None:
    return None if at is None else f"{float(at):.3f}"


def _check_expr(expr: Any) -> None:
    if not isinstance(expr, str) or not expr.strip():
        raise QueryError(f"query {expr!r}: give a PromQL expression as a non-empty string")
