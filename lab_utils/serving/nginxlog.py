"""nginx's JSON access log (the course's ``log_format nvlab_json``: one object per request) and its ``stub_status``
page, read back: requests per upstream, status codes and latency. Read by ``lab_utils.serving.nginx.NginxServer``
(``access_rows``, ``access_summary``, ``stub_status``) and lab 07's monitoring."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read_access_log(path: str | os.PathLike[str], since: float | None = None) -> list[dict[str, Any]]:
    """``access_rows`` of the JSON access log at ``path`` ([] before nginx has written it)."""
    try:
        return access_rows(Path(path).read_text(errors="replace"), since)
    except FileNotFoundError:
        return []


def access_rows(text: str, since: float | None = None) -> list[dict[str, Any]]:
    """The access log's lines in ``text`` as rows: every field of the log line, plus ``request_ms``, ``upstream``
    (the server that answered, None when none did: a 401/413/429 at the door), ``upstream_ms`` and ``tries``.

    ``since``: only requests that ended at or after this time (epoch seconds, ``time.time()``). A line cut short
    (nginx writing it now) is skipped.
    """
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if since is not None and row.get("msec", 0) < since:
            continue
        # "a, b" are the servers one upstream tried; " : " starts another after an internal redirect (the JSON check
        # after Triton's 500): the request's backend is the first upstream's last server
        first = re.split(r"\s:\s", row.get("upstream_addr", ""))[0]
        addrs = [a.strip() for a in first.split(",") if a.strip() not in ("", "-")]
        first_times = re.split(r"\s:\s", row.get("upstream_response_time", ""))[0]
        times = [float(t) for t in first_times.split(",") if t.strip() not in ("", "-")]
        rows.append({**row, "request_ms": float(row.get("request_time", 0.0)) * 1e3,
                     "upstream": addrs[-1] if addrs else None, "tries": len(addrs),
                     "upstream_ms": sum(times) * 1e3 if times else None})
    return rows


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize_access(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the access log says: ``requests``, ``by_upstream`` ({address: requests it answered}),
    ``by_status`` ({code: count}), ``by_listener`` (http / grpc), ``seconds`` (first to last), ``rps``, and
    the latency nginx saw (``p50_ms``, ``p95_ms``, ``p99_ms``, ``mean_ms``; requests a backend answered) with
    the backends' share (``upstream_p95_ms``)."""
    answered = [r for r in rows if r.get("upstream")]
    lat = [r["request_ms"] for r in answered]
    up = [r["upstream_ms"] for r in answered if r.get("upstream_ms") is not None]
    times = [r["msec"] for r in rows if "msec" in r]
    span = max(times) - min(times) if len(times) > 1 else 0.0
    return {
        "requests": len(rows),
        "by_upstream": dict(sorted(Counter(r["upstream"] for r in answered).items())),
        "by_status": dict(sorted(Counter(int(r["status"]) for r in rows).items())),
        "by_listener": dict(Counter(r.get("listener", "other") for r in rows)),
        "seconds": span,
        "rps": len(rows) / span if span else float("nan"),
        "p50_ms": _pct(lat, 50), "p95_ms": _pct(lat, 95), "p99_ms": _pct(lat, 99),
        "mean_ms": sum(lat) / len(lat) if lat else float("nan"),
        "upstream_p95_ms": _pct(up, 95),
    }


_STUB = re.compile(r"Active connections:\s*(\d+).*?\n\s*(\d+)\s+(\d+)\s+(\d+)\s*\n"
                   r"\s*Reading:\s*(\d+)\s+Writing:\s*(\d+)\s+Waiting:\s*(\d+)", re.S)


def parse_stub_status(text: str) -> dict[str, int]:
    """nginx's ``stub_status`` page as numbers: active, accepts, handled, requests, reading, writing, waiting."""
    m = _STUB.search(text)
    if not m:
        raise ValueError(f"not an nginx stub_status page: {text[:120]!r}")
    keys = ("active", "accepts", "handled", "requests", "reading", "writing", "waiting")
    return dict(zip(keys, map(int, m.groups()), strict=True))
