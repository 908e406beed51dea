"""Why a KServe v2 inference request is malformed, in one line: the front door's answer where Triton says 500.

Triton's HTTP server reports a body it cannot parse (invalid JSON, JSON of the wrong shape or types, no "inputs")
as an internal error, HTTP 500, though the fault is the client's. nginx cannot read a body, so the front door sends
the request of a Triton 500 on to ``JsonCheck``, a small HTTP server in the owner's process, which reads the same
body: a malformed one gets 400 and the reason, a well-formed one keeps the 500 (then the server failed).

Stable API: ``request_problem(body, header_length)`` (the reason, or None) and ``JsonCheck`` (``start``, ``stop``,
``address``). Design notes: docs/internals.md#lab_utilsservingjsoncheckpy
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HEADER_LENGTH = "Inference-Header-Content-Length"  # the JSON part's length when binary tensors follow it
EXAMPLE = ('{"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES", "data": ["..."]}]}')
SERVER_FAULT = ("a Triton server failed on a well-formed request (HTTP 500): the fault is the server's, not the "
                "request's; its log says why")
_KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
          dict: "an object"}  # json.loads gives exactly these types
_NUMERIC = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16")
_TAKES = {  # datatype -> what its "data" elements must be, in words, and the check
    "BYTES": ("strings", lambda v: isinstance(v, str)), "BOOL": ("true or false", lambda v: isinstance(v, bool)),
    **dict.fromkeys(_NUMERIC, ("numbers", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)))}


def _kind(value: Any) -> str:
    """The JSON type of ``value`` in words: 'a string', 'a number', 'null'..."""
    return _KINDS.get(type(value), type(value).__name__)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (JSON has no NaN or Infinity)")


def _leaves(data: Any) -> list[Any]:
    """The elements of a (nested) data list, flattened."""
    out, stack = [], [data]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(reversed(v))
        else:
            out.append(v)
    return out


def _tensor_problem(t: Any, where: str, outputs: bool = False) -> str | None:
    if not isinstance(t, dict):
        return (f"{where} is {_kind(t)}, not an object "
                '{"name": ..., "shape": ..., "datatype": ..., "data": ...}')
    if not isinstance(t.get("name"), str):
        return f"{where} has no \"name\" string" if "name" not in t else \
            f"{where}.name is {_kind(t['name'])}, not a string"
    params = t.get("parameters", {})
    if not isinstance(params, dict):
        return f"{where}.parameters is {_kind(params)}, not an object"
    if outputs:
        return None
    for key in ("shape", "datatype"):
        if key not in t:
            return f"{where} ({t['name']}) has no \"{key}\""
    shape = t["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape):
        return f"{where}.shape must be a list of integers >= 0, got {json.dumps(shape)[:40]}"
    dtype = t["datatype"]
    if not isinstance(dtype, str):
        return f"{where}.datatype is {_kind(dtype)}, not a string such as \"BYTES\" or \"FP32\""
    # no "data": binary_data_size or a shared-memory region, which Triton checks with a 400 of its own
    if "data" not in t or dtype not in _TAKES:
        return None
    takes, fits = _TAKES[dtype]
    bad = [v for v in _leaves(t["data"]) if not fits(v)]  # a list, not next(..., None): a null is bad too
    return f"{where}.data holds {_kind(bad[0])} where a {dtype} tensor takes {takes}" if bad else None


def request_problem(body: bytes, header_length: int | str | None = None) -> str | None:
    """What makes ``body`` not a KServe v2 inference request, in one line; None when it is one (well-formed JSON
    of the right shape and types: whether the model accepts it is Triton's to say). ``header_length``: the
    ``Inference-Header-Content-Length`` header (the JSON part's length when binary tensors follow it)."""
    if header_length not in (None, ""):
        try:
            n = int(header_length)  # type: ignore[arg-type]
        except ValueError:
            return f"{HEADER_LENGTH}: {header_length!r} is not a number of bytes"
        if not 0 < n <= len(body):
            return f"{HEADER_LENGTH}: {n} is not within the body's {len(body)} bytes"
        body = body[:n]
    if not body.strip():
        return f"the request body is empty: send a KServe v2 request, e.g. {EXAMPLE}"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"the request body is not UTF-8 text (byte {err.start}): send KServe v2 JSON, e.g. {EXAMPLE}"
    try:
        req = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        return (f"the request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}; send a "
                f"KServe v2 request, e.g. {EXAMPLE}")
    except ValueError as err:
        return f"the request body is not valid JSON: {err}"
    except RecursionError:
        return "the request body is JSON nested too deeply to be a KServe v2 request"
    if not isinstance(req, dict):
        return f"the request body is {_kind(req)}, not a JSON object: send {EXAMPLE}"
    if "inputs" not in req:
        return f"the request has no \"inputs\": send {EXAMPLE}"
    inputs = req["inputs"]
    if not isinstance(inputs, list):
        return f"\"inputs\" is {_kind(inputs)}, not a list of tensors: send {EXAMPLE}"
    for i, t in enumerate(inputs):
        why = _tensor_problem(t, f"inputs[{i}]")
        if why:
            return why
    outputs = req.get("outputs", [])
    if not isinstance(outputs, list):
        return f"\"outputs\" is {_kind(outputs)}, not a list of {{\"name\": ...}} objects"
    for i, t in enumerate(outputs):
        why = _tensor_problem(t, f"outputs[{i}]", outputs=True)
        if why:
            return why
    if "id" in req and not isinstance(req["id"], str):
        return f"\"id\" is {_kind(req['id'])}, not a string"
    if not isinstance(req.get("parameters", {}), dict):
        return f"\"parameters\" is {_kind(req['parameters'])}, not an object"
    return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # nginx's proxy speaks 1.0 by default: one request a connection

    def _answer(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(size) if size > 0 else b""
        why = None
        if self.command == "POST" and self.path.split("?", 1)[0].endswith("/infer"):
            why = request_problem(body, self.headers.get(HEADER_LENGTH))
        code, words = (400, why) if why else (500, SERVER_FAULT)
        out = json.dumps({"error": words}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_POST = do_GET = do_HEAD = _answer

    def log_message(self, format: str, *args: Any) -> None:  # nginx's access log has the request
        pass


class JsonCheck:
    """``request_problem`` served over HTTP on a free loopback port, in a thread of this process: what the front
    door asks when Triton answered 500 (400 and the reason for a malformed body, else 500). ``address`` is
    ``host:port`` once started; ``stop()`` is safe twice."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("JsonCheck is not started: call start()")
        return f"{self.host}:{self._server.server_address[1]}"

    def start(self) -> JsonCheck:
        if self._server is None:
            self._server = ThreadingHTTPServer((self.host, 0), _Handler)
            self._server.daemon_threads = True
            self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                            name="nvlab-json-check", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


__all__ = ["request_problem", "JsonCheck", "SERVER_FAULT", "HEADER_LENGTH"]
