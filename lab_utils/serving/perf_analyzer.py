"""perf_analyzer, Triton's own load tool (C++), beside the course's load engine (``lab_utils.serving.load``).

Stable API (labs 04 and 07): ``perf_analyzer_status`` (does it run here, and why not), ``perf_analyzer_command`` (the
command that measures what a ``load`` run does), ``run_perf_analyzer`` (one concurrency or one request rate, parsed:
a ``PerfAnalyzerResult``), ``parse_perf_analyzer_csv``, ``perf_analyzer_input_data``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lab_utils.compat import glibc
from lab_utils.course.probe import find_perf_analyzer
from lab_utils.course.stack import dist_version
from lab_utils.procs import popen_owned, stop_group, temporary_folder
from lab_utils.serving.client import host_port

PERF_ANALYZER_INSTALL = "pip install perf-analyzer"
PERF_ANALYZER_IMAGE = "the NGC tritonserver:<yy.mm>-py3-sdk image"


def perf_analyzer_command(model: str, url: str, concurrencies: Sequence[int] = (), *, protocol: str = "grpc",
                          shape: str | None = None, window_ms: int = 5000, stability_pct: int = 10,
                          percentile: int | None = 95, max_trials: int | None = None,
                          csv_path: str | None = None, request_rate: float | None = None,
                          input_data: str | None = None, headers: Mapping[str, str] | None = None) -> str:
    """The ``perf_analyzer`` command measuring what ``load.sweep`` does (``-f csv_path`` writes its CSV report).

    ``percentile=None`` stabilises on the average latency, as ``load.run_closed_loop`` does; a percentile stabilises
    on it.
    ``request_rate`` (requests/s) measures an open loop instead, as ``load.run_open_loop`` does (Poisson
    arrivals); ``input_data`` is a JSON file from ``perf_analyzer_input_data``; ``headers`` go with every HTTP
    request (perf_analyzer sends none over gRPC, so nginx's API key needs ``protocol="http"``).
    """
    if request_rate is None and not concurrencies:
        raise ValueError("perf_analyzer_command needs concurrencies (a closed loop) or request_rate (an open loop)")
    if headers and protocol != "http":
        raise ValueError(f"perf_analyzer sends headers only over HTTP, not {protocol}: pass protocol='http'")
    common = (f"-m {model} -u {host_port(url)} -i {protocol} --measurement-interval {window_ms} "
              f"--stability-percentage {stability_pct}")
    optional = [("--percentile", percentile), ("--max-trials", max_trials), ("--shape", shape),
                ("--input-data", input_data), *(("-H", f"{k}:{v}") for k, v in (headers or {}).items()),
                ("-f", csv_path)]
    common += "".join(f" {flag} {value}" for flag, value in optional if value not in (None, ""))
    if request_rate is not None:  # async: a synchronous sender blocks per request and falls behind the schedule
        return (f"perf_analyzer {common} --request-rate-range {request_rate:g} --request-distribution poisson "
                "--async --max-threads 16")
    steps = sorted(set(concurrencies))
    diffs = {b - a for a, b in zip(steps, steps[1:], strict=False)}
    if len(diffs) <= 1:  # an arithmetic sweep is one range
        step = diffs.pop() if diffs else 1
        return f"perf_analyzer {common} --concurrency-range {steps[0]}:{steps[-1]}:{step}"
    return f"for c in {' '.join(map(str, steps))}; do perf_analyzer {common} --concurrency-range $c; done"


@dataclass(frozen=True)
class PerfAnalyzerStatus:
    """Whether ``perf_analyzer`` runs here: ``path`` (the binary found, or None), ``version``, and ``reason``
    (why it cannot run, with what to do; empty when it can)."""

    runnable: bool
    path: str | None
    version: str | None
    reason: str

    def __str__(self) -> str:
        if self.runnable:
            return f"perf_analyzer {self.version or ''} at {self.path}".replace("  ", " ")
        return f"perf_analyzer does not run here: {self.reason}"


def perf_analyzer_status(timeout_s: float = 30.0) -> PerfAnalyzerStatus:
    """Find ``perf_analyzer`` and run ``perf_analyzer --version``: runnable when it exits 0 and names itself.

    (``--help`` is no test: perf_analyzer has no such option and exits 99 after printing its usage.) Not found, not
    executable, or failing to start (``GLIBC_2.38' not found``): the reason says why, with the glibc version
    (``lab_utils.compat.glibc``).
    """
    path = find_perf_analyzer()
    if path is None:
        why = glibc.perf_analyzer_note(PERF_ANALYZER_INSTALL)
        return PerfAnalyzerStatus(False, None, None, f"not installed; {why}. It also ships in {PERF_ANALYZER_IMAGE}.")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout_s)
    except PermissionError:
        return PerfAnalyzerStatus(False, path, None, f"{path} is not executable (chmod +x it)")
    except (OSError, subprocess.TimeoutExpired) as err:
        return PerfAnalyzerStatus(False, path, None, f"{path} could not be run: {err}")
    text = (out.stdout or "") + (out.stderr or "")
    m = re.search(r"Perf Analyzer Version ([^\s]+)", text)
    if out.returncode == 0 and m:
        # the PyPI wheel's build names no release ("Version 0.0.0"): the package's version is the one it ships
        version = m.group(1) if m.group(1) != "0.0.0" else dist_version("perf-analyzer") or m.group(1)
        return PerfAnalyzerStatus(True, path, version, "")
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), f"exit code {out.returncode}")
    return PerfAnalyzerStatus(False, path, None, f"{path} --version failed: {first}{glibc.start_failure_note(text)}")


@dataclass
class PerfAnalyzerResult:
    """One concurrency (or, open loop, one request rate) measured by perf_analyzer (its CSV report; latencies
    converted from µs to ms)."""

    concurrency: int  # 0 in an open loop
    throughput_infer_s: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    avg_ms: float | None  # only with --verbose-csv and no --percentile
    client_send_us: float
    network_server_us: float  # "Network+Server Send/Recv": client wait not accounted for by the server
    server_queue_us: float | None
    server_compute_input_us: float | None
    server_compute_infer_us: float | None
    server_compute_output_us: float | None
    client_recv_us: float
    command: str = ""
    request_rate: float | None = None  # requests/s offered, open loop only

    def to_row(self) -> dict[str, Any]:
        """The same keys as ``LoadResult.to_row`` where they mean the same."""
        return {k: v for k, v in asdict(self).items() if k != "command"}


_PA_COLUMNS = {
    "Concurrency": "concurrency", "Inferences/Second": "throughput_infer_s", "Client Send": "client_send_us",
    "Network+Server Send/Recv": "network_server_us", "Server Queue": "server_queue_us",
    "Server Compute Input": "server_compute_input_us", "Server Compute Infer": "server_compute_infer_us",
    "Server Compute Output": "server_compute_output_us", "Client Recv": "client_recv_us",
}


def parse_perf_analyzer_csv(text: str, command: str = "") -> list[PerfAnalyzerResult]:
    """The rows of perf_analyzer's ``-f`` CSV report, by concurrency (the file sorts them by throughput).

    Columns, as perf_analyzer's report writer emits them: ``Concurrency`` (or ``Request Rate`` in an open loop),
    ``Inferences/Second``, ``Client Send``, then with server statistics
    ``Network+Server Send/Recv, Server Queue, Server Compute Input/Infer/Output`` (and ``Server Cache Hit/Miss``
    when the response cache is on), ``Client Recv``, ``p50/p90/p95/p99 latency``; with ``--verbose-csv`` also
    ``Avg latency`` (no ``--percentile``), ``request/response``, ``response wait`` and GPU metrics. Times are µs.
    """
    import csv
    import io

    reader = csv.DictReader(io.StringIO(text.strip()))
    fields = reader.fieldnames or []
    load = next((c for c in ("Concurrency", "Request Rate") if c in fields), None)
    if load is None:
        raise ValueError("not a perf_analyzer report: the first column should be Concurrency or Request Rate, got "
                         f"{fields[:1] or 'an empty file'}")
    missing = [c for c in ("Inferences/Second", "Client Send", "Client Recv", "p95 latency") if c not in fields]
    if missing:
        raise ValueError(f"perf_analyzer CSV without the columns {missing} (it has {fields})")
    rows = []
    for raw in reader:
        if not raw.get(load):
            continue
        values: dict[str, Any] = {key: float(raw[col]) if raw.get(col) not in (None, "") else None
                                  for col, key in _PA_COLUMNS.items()}
        values["concurrency"] = int(float(raw["Concurrency"])) if load == "Concurrency" else 0
        values["request_rate"] = float(raw[load]) if load == "Request Rate" else None
        for p in (50, 90, 95, 99):
            values[f"p{p}_ms"] = float(raw[f"p{p} latency"]) / 1e3 if raw.get(f"p{p} latency") else float("nan")
        values["avg_ms"] = float(raw["Avg latency"]) / 1e3 if raw.get("Avg latency") else None
        rows.append(PerfAnalyzerResult(command=command, **values))
    return sorted(rows, key=lambda r: (r.concurrency, r.request_rate or 0.0))


def perf_analyzer_input_data(path: str | os.PathLike[str], payloads: Sequence[Mapping[str, np.ndarray]]) -> str:
    """Write ``payloads`` (one request each, batch dimension first) as perf_analyzer's ``--input-data`` JSON, which
    it sends in turn. A BYTES tensor goes as base64 of its wire form (each element a 4-byte little-endian length,
    then its bytes); numbers as a flat list. Returns ``path``."""
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    def tensor(arr: np.ndarray) -> dict[str, Any]:
        shape = list(arr.shape[1:])  # perf_analyzer adds the batch dimension itself
        if np_to_triton_dtype(arr.dtype) == "BYTES":
            wire = serialize_byte_tensor(arr).item()  # one bytes object: the whole tensor on the wire
            return {"content": {"b64": base64.b64encode(wire).decode("ascii")}, "shape": shape}
        return {"content": arr.reshape(-1).tolist(), "shape": shape}

    if not payloads:
        raise ValueError("perf_analyzer_input_data needs at least one payload")
    data = [{name: tensor(np.asarray(arr)) for name, arr in p.items()} for p in payloads]
    with open(path, "w") as f:
        json.dump({"data": data}, f)
    return os.fspath(path)


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer ran but measured nothing usable; the message carries its own words."""


def run_perf_analyzer(model: str, url: str, concurrency: int | None = None, *, request_rate: float | None = None,
                      payloads: Sequence[Mapping[str, np.ndarray]] | None = None,
                      headers: Mapping[str, str] | None = None, protocol: str = "grpc", window_ms: int = 5000,
                      stability_pct: int = 10, max_trials: int = 10, shape: str | None = None,
                      timeout_s: float | None = None, binary: str | None = None, extensions: int = 0,
                      extension_trials: int = 6) -> PerfAnalyzerResult:
    """Run perf_analyzer at one concurrency (stabilising on the average latency, as ``load.run_closed_loop``), or
    open loop at one ``request_rate`` (requests/s), and parse its CSV. ``payloads``: the requests to send in turn
    (default: random data), e.g. an open-loop target's; ``headers``: HTTP only (nginx's API key).

    Without a stable measurement perf_analyzer writes no row; it is then run again with a measurement interval
    twice as long, up to ``extensions`` times (``extension_trials`` windows each), as ``steps.measure`` does.
    Raises ``PerfAnalyzerError`` with perf_analyzer's last lines when it fails or never stabilises. The process
    is owned: killed with its group on timeout.
    """
    binary = binary or find_perf_analyzer()
    if binary is None:
        raise PerfAnalyzerError(str(perf_analyzer_status()))
    with temporary_folder("perf-analyzer") as tmp:
        csv_file = tmp / "perf.csv"
        opts: dict[str, Any] = {"protocol": protocol, "shape": shape, "stability_pct": stability_pct,
                                "percentile": None, "request_rate": request_rate, "headers": headers,
                                "csv_path": str(csv_file), "input_data": None if payloads is None else
                                perf_analyzer_input_data(tmp / "input.json", payloads)}
        steps = [] if concurrency is None else [concurrency]
        for _ in range(1 + max(0, extensions)):
            command = perf_analyzer_command(model, url, steps, window_ms=window_ms, max_trials=max_trials, **opts)
            limit = timeout_s if timeout_s is not None else 60 + 3 * max_trials * window_ms / 1e3
            csv_file.unlink(missing_ok=True)  # an earlier, unstable attempt's report
            proc = popen_owned([binary, *command.split()[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
            try:
                output, _ = proc.communicate(timeout=limit)
            except subprocess.TimeoutExpired:
                stop_group(proc, grace_s=1.0)
                raise PerfAnalyzerError(f"perf_analyzer did not finish within {limit:g} s: {command}") from None
            last = "\n".join(output.strip().splitlines()[-8:])
            shown = command.replace(f" -f {csv_file}", " -f perf.csv").replace(f" --input-data {tmp}/",
                                                                                " --input-data ")
            if csv_file.exists() and (rows := parse_perf_analyzer_csv(csv_file.read_text(), shown)):
                return rows[0]
            if "stable measurement" not in output:
                raise PerfAnalyzerError(f"perf_analyzer exited with code {proc.returncode} and wrote no report "
                                        f"({shown}):\n{last}")
            unstable = f"perf_analyzer found no stable measurement (exit code {proc.returncode}; {shown}):\n{last}"
            window_ms, max_trials = 2 * window_ms, extension_trials
    raise PerfAnalyzerError(unstable)


__all__ = ["perf_analyzer_command", "perf_analyzer_status", "PerfAnalyzerStatus", "PerfAnalyzerResult",
           "PerfAnalyzerError", "parse_perf_analyzer_csv", "perf_analyzer_input_data", "run_perf_analyzer"]
