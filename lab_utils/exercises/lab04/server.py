"""The lab's server the code checks run against (``use_server``), and 04.3 and 04.4, a request by hand over gRPC
and HTTP, compared with the model computed in NumPy."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lab_utils.exercises.framework import (
    CodeExercise,
    NotApplicable,
    NotNow,
    References,
    Wrong,
    amended,
    run_student,
    sentence,
)
from lab_utils.procs import EnvError
from lab_utils.serving import client as triton_client
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.client import host_port
from lab_utils.serving.server import ServerNotFound, find_server, not_serving

# --------------------------------------------------------------------------------------------------
# The server the code checks run against


@dataclass
class _Lab:
    server: Any  # a TritonServer or ExternalServer (lab_utils.serving.server.Server)
    repo: Path  # the model repository it reads, in explicit model-control mode
    model: str  # the lab's model, for the client checks


_BOUND: list[_Lab] = []


def use_server(server: Any, repo: str | Path, model: str = "mlp") -> None:
    """The running server the code checks call (explicit model control), the repository it reads (the checks write
    their own models there: ``q_deploy``, ``q_execute``), and the lab's model the client checks query."""
    _BOUND[:] = [_Lab(server, Path(repo), model)]
    print(f"code checks run against {server.grpc_url} (gRPC) and {server.http_url} (HTTP); "
          f"model {model!r}; repository {repo}")


def _no_server() -> str | None:
    """Why this machine cannot run the code checks (the outcome is then *not applicable*), or None; ``NotNow`` with
    what to run first when it can but the lab's server is not running yet, or no longer."""
    if not _BOUND:
        try:
            find_server()
        except ServerNotFound:
            return "no Triton server on this machine, so nothing to run your code against."
        except EnvError as err:  # a TRITON_URL that is not a URL: its message names the variable
            return f"{err}, so there is no server to run your code against."
        raise NotNow("no server to check against yet: run the cell that starts the server first (it calls "
                     "ex.use_server(server, repo)), then this check again.")
    stopped = not_serving(_BOUND[0].server)
    if stopped:  # the lab runs here: the check can run once the server does (not a tier's limit)
        raise NotNow(stopped)
    return None


def _lab() -> _Lab:
    reason = _no_server()
    if reason:
        raise NotApplicable(reason)
    # A server that crashed (its process alive, hung in its signal handler) is restarted before a check: a hang in
    # the check would look like the student's fault.
    server = _BOUND[0].server
    why = getattr(server, "crashed", lambda: None)()
    if why:
        print(f"the lab's server is broken ({why}): restarting it for this check; your code is not the cause")
        server.restart()
    return _BOUND[0]


def _hint(message: str, hints: dict[str, str]) -> str:
    """The first hint whose pattern (a regular expression, case-insensitive) the message matches."""
    return next((f" {sentence(hint)}" for pattern, hint in hints.items() if re.search(pattern, message, re.I)), "")


def _close(got: np.ndarray, want: np.ndarray) -> tuple[bool, float]:
    """Served against NumPy's answer: within 1e-3 of the output's scale."""
    diff = float(np.abs(np.asarray(got, np.float64) - want).max()) if want.size else 0.0
    return diff <= 1e-3 * max(1.0, float(np.abs(want).max())), diff


def _served_version(lab: _Lab) -> tuple[str, dict[str, Any]]:
    """The version a request without a version reaches (the highest that is ready, loaded first if need be), and
    the model's metadata."""
    with triton_client.client(lab.server.grpc_url) as client:
        if not client.is_model_ready(lab.model):
            client.load_model(lab.model)
        meta = client.get_model_metadata(lab.model, as_json=True)
    return str(max(int(v) for v in meta.get("versions", []))), meta


# --------------------------------------------------------------------------------------------------
# 04.3 / 04.4 a request by hand, gRPC and HTTP

_CLIENT_ROWS = (1, 3)  # the batches the client checks send
_CLIENT_HINTS = {
    r"data-?type|datatype|FP64|float64": "x is float32 and the model's INPUT__0 is TYPE_FP32: "
    "InferInput('INPUT__0', list(x.shape), 'FP32') and set_data_from_numpy(x) as it is.",
    r"shape": "InferInput takes the whole shape of x, batch dimension included: list(x.shape), e.g. [3, 64].",
    r"unexpected inference output|unknown output|output '": "the model's output is named 'OUTPUT__0'.",
    r"unexpected inference input|unknown input|input '": "the model's input is named 'INPUT__0'.",
    r"unavailable|connect|socket|refused|ssl|http/2|protocol|closed|parse|RTSP|deadline": "is the client the one "
    "for this endpoint? "
    "tritonclient.grpc for the gRPC URL, tritonclient.http for the HTTP one; pass `url` as given (host:port).",
}


def _grade_client(fn: Any, protocol: str) -> str:
    lab = _lab()
    url = host_port(lab.server.grpc_url if protocol == "grpc" else lab.server.http_url)
    version, meta = _served_version(lab)
    features = int(meta["inputs"][0]["shape"][-1])
    reference = functools.partial(triton_repo.reference_mlp, lab.repo / lab.model / version)  # NumPy
    rng = np.random.default_rng()  # inputs drawn afresh at every check: no answer can be prepared for them
    name = getattr(fn, "__name__", f"{protocol}_infer")
    worst = 0.0
    for rows in _CLIENT_ROWS:
        x = rng.standard_normal((rows, features), dtype=np.float32)
        call = f"{name}(url, {lab.model!r}, x)  # x: float32 {list(x.shape)}"
        with amended(lambda m: f"{m}.{_hint(m, _CLIENT_HINTS)}"):
            y = run_student(fn, url, lab.model, x.copy(), call=call, timeout_s=30)
        if type(y).__name__ == "InferResult":
            raise Wrong(f"{call} returned the InferResult itself: take the array out with "
                        "result.as_numpy('OUTPUT__0').")
        if isinstance(y, dict):
            raise Wrong(f"{call} returned a dict: return the array, result.as_numpy('OUTPUT__0').")
        if y is None:
            raise Wrong(f"{call} returned None: does it end with `return result.as_numpy('OUTPUT__0')` (as_numpy "
                        "returns None for an output name the response does not hold)?")
        if not isinstance(y, np.ndarray):
            raise Wrong(f"{call} returned a {type(y).__name__}; expected the output as a NumPy array")
        want = reference(x)
        if y.shape != want.shape:
            what = " (the input itself?)" if y.shape == x.shape else ""
            raise Wrong(f"{call} returned shape {list(y.shape)}{what}; the model answers {list(want.shape)} for "
                        f"{rows} row(s).")
        ok, diff = _close(y, want)
        if not ok:
            raise Wrong(f"{call}: the answer differs from the model computed in NumPy by {diff:.3g}: did the request "
                        "carry x (set_data_from_numpy(x)) and is OUTPUT__0 what comes back?")
        worst = max(worst, diff)
    return (f"over {protocol} the server answered batches of {' and '.join(map(str, _CLIENT_ROWS))} rows as the "
            f"model computed in NumPy does (version {version}, max |difference| {worst:.1e}).")


q3 = CodeExercise(
    name="04.3 a gRPC request by hand", var="grpc_infer", grade=lambda fn: _grade_client(fn, "grpc"),
    references=References("send the request with tritonclient.grpc yourself",
                           "lab_utils.serving.client.infer", "lab_utils.serving.repository.reference_mlp"),
    signature="grpc_infer(url, model, x) -> np.ndarray", applicable=_no_server,
    hints=(
        "tritonclient.grpc: a client for the URL, one InferInput per input (name, shape, datatype) filled from the "
        "array, the outputs you want, then client.infer(model, inputs, outputs=...).",
        "One grpcclient.InferInput for 'INPUT__0', with x's shape as a list and the datatype 'FP32', filled by its "
        "set_data_from_numpy; one grpcclient.InferRequestedOutput for 'OUTPUT__0'.",
        "client.infer(model, inputs, outputs=...) returns a result; its as_numpy('OUTPUT__0') is the array to "
        "return.",
    ),
    solution_text=(
        "def grpc_infer(url, model, x):\n"
        "    client = grpcclient.InferenceServerClient(url)  # url: host:port of the gRPC endpoint\n"
        "    inp = grpcclient.InferInput('INPUT__0', list(x.shape), 'FP32')  # shape with the batch dimension\n"
        "    inp.set_data_from_numpy(x)\n"
        "    out = grpcclient.InferRequestedOutput('OUTPUT__0')\n"
        "    result = client.infer(model, [inp], outputs=[out])\n"
        "    return result.as_numpy('OUTPUT__0')"
    ),
)

q4 = CodeExercise(
    name="04.4 an HTTP request by hand", var="http_infer", grade=lambda fn: _grade_client(fn, "http"),
    references=References("send the request with tritonclient.http yourself",
                           "lab_utils.serving.client.infer", "lab_utils.serving.repository.reference_mlp"),
    signature="http_infer(url, model, x) -> np.ndarray", applicable=_no_server,
    hints=(
        "tritonclient.http has the same classes as tritonclient.grpc; the URL is the HTTP endpoint's host:port.",
        "Over HTTP tritonclient sends and asks for tensors as raw bytes by default (binary_data=True is the default of "
        "set_data_from_numpy and InferRequestedOutput); binary_data=False would send them as JSON numbers.",
        "The client is an httpclient.InferenceServerClient for the URL; the rest is your gRPC function with "
        "httpclient's classes.",
    ),
    solution_text=(
        "def http_infer(url, model, x):\n"
        "    client = httpclient.InferenceServerClient(url)  # url: host:port of the HTTP endpoint\n"
        "    inp = httpclient.InferInput('INPUT__0', list(x.shape), 'FP32')\n"
        "    inp.set_data_from_numpy(x)  # binary_data=True by default: raw bytes, not JSON numbers\n"
        "    out = httpclient.InferRequestedOutput('OUTPUT__0')  # binary too, by default\n"
        "    result = client.infer(model, [inp], outputs=[out])\n"
        "    return result.as_numpy('OUTPUT__0')"
    ),
)
