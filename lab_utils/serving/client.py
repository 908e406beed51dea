"""Triton clients for the labs: gRPC and HTTP, synchronous and asynchronous, binary tensors, clear errors.

``infer`` (``infer_async``: a coroutine) returns ``{output name: np.ndarray}``; a refused request raises ``InferError``
naming the server's words, the request sent and what the model expects. The repository API, the model's metadata
and configuration, and the statistics API (``model_stats``, ``server_split``: the server's side of a load run) too.
``url``: ``host:port`` of the protocol's endpoint (an ``http://`` prefix is accepted).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lab_utils.procs import wait_until

PROTOCOLS = ("grpc", "http")
STAGES = ("queue", "compute_input", "compute_infer", "compute_output")  # Triton's per-request stages, in order


class InferError(RuntimeError):
    """The server refused a request; ``.server_message`` is its text, ``.request`` what was sent."""

    def __init__(self, message: str, server_message: str, request: list[dict[str, Any]]):
        self.server_message, self.request = server_message, request
        super().__init__(message)


def host_port(url: str) -> str:
    """``host:port`` of a server URL (tritonclient takes no scheme): ``http://h:8000/`` -> ``h:8000``."""
    for p in ("http://", "https://", "grpc://"):
        url = url.removeprefix(p)
    return url.rstrip("/")


def _module(protocol: str, aio: bool = False) -> Any:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r}: use one of {PROTOCOLS}")
    try:
        if protocol == "grpc":
            import tritonclient.grpc as m
            import tritonclient.grpc.aio as a
        else:
            import tritonclient.http as m  # type: ignore[no-redef]
            import tritonclient.http.aio as a  # type: ignore[no-redef]
    except (ImportError, RuntimeError) as err:  # tritonclient raises RuntimeError when an extra's package is missing
        raise ImportError(f"the Triton {protocol} client cannot be imported ({err}): pip install "
                          f"'tritonclient[{protocol}]' python-rapidjson") from None
    return a if aio else m


def available_protocols(show: bool = True) -> tuple[str, ...]:
    """The protocols whose Triton client imports here (gRPC needs grpcio and protobuf; HTTP needs
    geventhttpclient and, for asyncio, aiohttp); ``show`` prints what is missing and the install command."""
    out = []
    for p in PROTOCOLS:
        try:
            _module(p)
            _module(p, aio=True)
        except (ImportError, RuntimeError) as err:
            if show:
                print(f"{p} client not available ({str(err).splitlines()[0]}): pip install 'tritonclient[{p}]'")
        else:
            out.append(p)
    return tuple(out)


def client(url: str, protocol: str = "grpc") -> Any:
    """A synchronous ``InferenceServerClient`` for ``url`` (``host:port``)."""
    return _module(protocol).InferenceServerClient(host_port(url))


def _datatype(a: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    dt = np_to_triton_dtype(a.dtype)
    if dt is None:
        raise TypeError(f"numpy dtype {a.dtype} has no Triton datatype")
    return dt


def build_request(mod: Any, protocol: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None,
                  binary: bool = True) -> tuple[list[Any], list[Any] | None]:
    """The InferInput and InferRequestedOutput objects of one request, for ``mod`` (a tritonclient module of
    ``protocol``, sync or aio); ``binary`` sends HTTP tensors as binary rather than JSON."""
    kw = {"binary_data": binary} if protocol == "http" else {}  # gRPC tensors are always binary
    ins = []
    for name, arr in inputs.items():
        arr = np.asarray(arr)
        i = mod.InferInput(name, list(arr.shape), _datatype(arr))
        i.set_data_from_numpy(arr, **kw)
        ins.append(i)
    return ins, [mod.InferRequestedOutput(o, **kw) for o in outputs] if outputs else None


def _raise(err: Exception, url: str, protocol: str, model: str, inputs: Mapping[str, np.ndarray]) -> None:
    """``InferError``: the server's words, what the request carried (each input's name, Triton datatype and shape)
    and the model's inputs as its metadata states them."""
    msg = err.message() if hasattr(err, "message") and callable(err.message) else str(err)
    msg = str(msg).replace("[request id: <id_unknown>] ", "")
    req = [{"name": k, "datatype": _datatype(np.asarray(v)), "shape": list(np.asarray(v).shape)}
           for k, v in inputs.items()]
    try:
        expected = model_metadata(url, model, protocol).get("inputs", [])
    except Exception:  # the model itself may be missing: the server's message says so
        expected = []
    sent = ", ".join(f"{t['name']} {t['datatype']} {t['shape']}" for t in req)
    want = ", ".join(f"{t['name']} {t['datatype']} {t['shape']}" for t in expected)
    raise InferError(f"{protocol} infer on model {model!r} at {host_port(url)} failed: {msg}\n  request sent: {sent}"
                     + (f"; model expects: {want}" if want else ""), msg, req) from None


def infer(url: str, model: str, inputs: Mapping[str, np.ndarray], *, protocol: str = "grpc",
          outputs: Sequence[str] | None = None, version: str = "", binary: bool = True,
          timeout_s: float | None = 30.0, headers: Mapping[str, str] | None = None,
          raw_errors: bool = False) -> dict[str, np.ndarray]:
    """One synchronous request; ``{output name: array}``. ``binary``: HTTP tensors as binary, not JSON. ``headers``:
    e.g. the API key through nginx. ``raw_errors``: raise tritonclient's ``InferenceServerException`` as it is."""
    from tritonclient.utils import InferenceServerException

    mod = _module(protocol)
    net = {"network_timeout": timeout_s} if protocol == "http" and timeout_s is not None else {}
    hdrs = {(k.lower() if protocol == "grpc" else k): v for k, v in (headers or {}).items()} or None
    with mod.InferenceServerClient(host_port(url), **net) as c:
        ins, outs = build_request(mod, protocol, inputs, outputs, binary)
        kw = {"client_timeout": timeout_s} if protocol == "grpc" else {}
        try:
            res = c.infer(model, ins, model_version=version, outputs=outs, headers=hdrs, **kw)
        except InferenceServerException as err:
            if raw_errors:
                raise
            _raise(err, url, protocol, model, inputs)
        return as_arrays(res, protocol, outputs)


def as_arrays(res: Any, protocol: str, outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """A tritonclient result as ``{output name: array}``: the ``outputs`` asked for, else every one it holds."""
    names = list(outputs) if outputs else [o["name"] for o in (
        res.get_response(as_json=True) if protocol == "grpc" else res.get_response()).get("outputs", [])]
    return {n: res.as_numpy(n) for n in names}


async def infer_async(url: str, model: str, inputs: Mapping[str, np.ndarray], *, protocol: str = "grpc",
                      outputs: Sequence[str] | None = None, version: str = "",
                      binary: bool = True) -> dict[str, np.ndarray]:
    """``infer`` as a coroutine (``await infer_async(...)``), on a client of its own."""
    from tritonclient.utils import InferenceServerException

    mod = _module(protocol, aio=True)
    c = mod.InferenceServerClient(host_port(url))
    try:
        ins, outs = build_request(mod, protocol, inputs, outputs, binary)
        try:
            res = await c.infer(model, ins, model_version=version, outputs=outs)
        except InferenceServerException as err:
            _raise(err, url, protocol, model, inputs)
        return as_arrays(res, protocol, outputs)
    finally:
        await c.close()


# --- repository API, metadata, configuration ------------------------------------------------------------


def http_encoding_cost(url: str, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], *,
                       reps: int = 30, warmup: int = 3) -> list[dict[str, Any]]:
    """JSON against binary tensors over HTTP, both measured on the running server: one row per encoding
    (``binary_data=False``, then ``True``, tritonclient's default for inputs and requested outputs) with the bytes
    of the request and of the response bodies and the median and p90 round trip (ms) of ``reps`` requests on one
    connection after ``warmup``. The answers must agree (max |difference| of the outputs, ``max_abs_diff``)."""
    import tritonclient.http as httpclient

    from lab_utils.timing import benchmark

    rows, answers = [], []
    with httpclient.InferenceServerClient(host_port(url)) as c:
        for binary in (False, True):
            ins, outs = build_request(httpclient, "http", inputs, outputs, binary)
            body, json_size = c.generate_request_body(ins, outputs=outs)
            headers = {"Content-Type": "application/octet-stream" if json_size else "application/json"}
            if json_size:  # binary tensors follow a JSON header of this many bytes
                headers["Inference-Header-Content-Length"] = str(json_size)
            req = urllib.request.Request(f"http://{host_port(url)}/v2/models/{model}/infer", data=body,
                                         headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=30) as resp:  # the raw response, to count its bytes
                response_bytes = len(resp.read())
            timing = benchmark(lambda ins=ins, outs=outs: c.infer(model, ins, outputs=outs), reps=reps,
                               warmup=warmup, device="cpu", name="binary" if binary else "JSON")
            answers.append(as_arrays(c.infer(model, ins, outputs=outs), "http", outputs))
            rows.append({"encoding": timing.name, "binary_data": binary, "request_bytes": len(body),
                         "response_bytes": response_bytes, "median_ms": timing.median_ms, "p90_ms": timing.p90_ms})
    diff = max(float(np.abs(answers[0][o] - answers[1][o]).max()) for o in outputs)
    for row in rows:
        row["max_abs_diff"] = diff
    return rows


def model_metadata(url: str, model: str, protocol: str = "grpc", version: str = "") -> dict[str, Any]:
    """``GET v2/models/{model}``: name, versions, inputs and outputs with datatype and shape."""
    with client(url, protocol) as c:
        md = (c.get_model_metadata(model, version, as_json=True) if protocol == "grpc"
              else c.get_model_metadata(model, version))
    for t in md.get("inputs", []) + md.get("outputs", []):
        t["shape"] = [int(d) for d in t.get("shape", [])]  # gRPC's JSON gives int64 as strings
    return md


def model_config(url: str, model: str, protocol: str = "grpc") -> dict[str, Any]:
    """The configuration the server is using (its defaults filled in), as a dict."""
    with client(url, protocol) as c:
        return c.get_model_config(model, as_json=True)["config"] if protocol == "grpc" else c.get_model_config(model)


def repository_index(url: str, protocol: str = "grpc") -> list[dict[str, Any]]:
    """``POST v2/repository/index``: every model in the repository with its version and state."""
    with client(url, protocol) as c:
        if protocol == "grpc":
            return c.get_model_repository_index(as_json=True).get("models", [])
        return c.get_model_repository_index()


def load_model(url: str, model: str, protocol: str = "grpc", config: str | None = None,
               timeout_s: float = 120.0) -> None:
    """``POST v2/repository/models/{model}/load`` (explicit model control): (re)load from the repository.

    A reload re-reads ``config.pbtxt`` and the version folders; ``config`` (JSON) overrides the file.
    A model that fails to load, or no answer within ``timeout_s`` (gRPC), raises with the server's reason.
    """
    from tritonclient.utils import InferenceServerException

    kw = {"client_timeout": timeout_s} if protocol == "grpc" else {}  # a hung server must not hang the caller
    try:
        with client(url, protocol) as c:
            c.load_model(model, config=config, **kw)
    except InferenceServerException as err:
        msg = err.message() or ""
        if "deadline" in msg.lower():
            msg = f"no answer within {timeout_s:g} s (is the server hung? its log says)"
        raise RuntimeError(f"loading {model!r} failed: {msg}") from None


def unload_model(url: str, model: str, protocol: str = "grpc", wait_s: float = 30.0) -> None:
    """``POST v2/repository/models/{model}/unload``, then wait (up to ``wait_s``) until no version is loaded.

    The server answers the request at once and unloads in the background (state ``UNLOADING``).
    """
    with client(url, protocol) as c:
        c.unload_model(model)
    if not wait_until(lambda: not {m.get("state") for m in repository_index(url, protocol) if m.get("name") == model}
                      & {"READY", "UNLOADING", "LOADING"}, wait_s):
        raise TimeoutError(f"model {model!r} still loaded {wait_s:g} s after the unload request")


def model_ready(url: str, model: str, protocol: str = "grpc", version: str = "") -> bool:
    with client(url, protocol) as c:
        return bool(c.is_model_ready(model, version))


# --- the statistics API: the server's side of a load run ----------------------------------------------------


def model_stats(http_url: str, model: str, version: str = "") -> dict[str, Any]:
    """``GET v2/models/{model}[/versions/{v}]/stats``: the statistics API's counters, summed over versions."""
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/stats"
    base = http_url if "://" in http_url else f"http://{http_url}"
    with urllib.request.urlopen(base.rstrip("/") + path, timeout=5) as r:
        data = json.loads(r.read())
    return sum_stats(data.get("model_stats", []))


def stats_snapshot(http_url: str, model: str) -> dict[str, Any] | None:
    """``model_stats``, or None where it cannot be read: a server gone mid-run (a failure drill) leaves no split,
    and the load's own numbers stand."""
    try:
        return model_stats(http_url, model)
    except Exception:
        return None


def sum_stats(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Statistics-API entries (versions of a model, or one model on several servers) added up."""
    total: dict[str, Any] = {"inference_count": 0, "execution_count": 0, "inference_stats": {}}
    for e in entries:
        total["inference_count"] += int(e.get("inference_count", 0))
        total["execution_count"] += int(e.get("execution_count", 0))
        for k, v in e.get("inference_stats", {}).items():
            d = total["inference_stats"].setdefault(k, {"count": 0, "ns": 0})
            d["count"] += int(v.get("count", 0))
            d["ns"] += int(v.get("ns", 0))
    return total


def server_split(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, float]:
    """Average µs per successful request in queue / compute input / infer / output, and the average batch.

    From two ``model_stats`` snapshots (the statistics API's counters are cumulative). ``batch_avg`` is
    inferences per model execution: how many requests' rows the batcher put together.
    """
    def delta(key: str) -> tuple[int, int]:
        a, b = before["inference_stats"].get(key, {}), after["inference_stats"].get(key, {})
        return b.get("count", 0) - a.get("count", 0), b.get("ns", 0) - a.get("ns", 0)

    n_ok, ns_ok = delta("success")
    per = max(n_ok, 1)
    execs = after["execution_count"] - before["execution_count"]
    infers = after["inference_count"] - before["inference_count"]
    return {"requests": float(n_ok), "request_us": ns_ok / per / 1e3,
            **{f"{k}_us": delta(k)[1] / per / 1e3 for k in STAGES}, "executions": float(execs),
            "batch_avg": infers / execs if execs else float("nan"), "failures": float(delta("fail")[0])}
