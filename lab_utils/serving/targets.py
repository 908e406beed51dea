"""What one request of a load run is: a Triton inference, a plain HTTP request, or any ``async def``.

Stable API (``lab_utils.serving.load`` drives these; labs 04, 05, 07 and 08 build them): ``TritonTarget``,
``HttpTarget``, ``FunctionTarget``, ``as_target``. A target's ``send()`` is one request and raises when it failed;
``open()`` and ``close()`` run in the load's event loop, around the run; ``batch`` is its rows per request.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lab_utils.args import check_int
from lab_utils.serving.client import PROTOCOLS, _module, as_arrays, build_request, host_port

DEFAULT_MAX_CONNECTIONS = 1000
_N_PAYLOADS = 8  # distinct request payloads made up front, so make_inputs costs nothing in the timed loop

Verify = Callable[[Mapping[str, np.ndarray], Mapping[str, np.ndarray]], None]


class HttpStatusError(Exception):
    """An HTTP answer with a status the target does not accept (401 from nginx, 429, 503...)."""


class WrongAnswer(Exception):
    """A response that ``verify`` refused: counted as a failed request, with the message ``wrong answer: ...``."""


def payloads(make_inputs: Callable[[], Mapping[str, np.ndarray]] | Mapping[str, np.ndarray]) -> list[dict]:
    """The request payloads a target sends in turn: ``make_inputs()`` called ``_N_PAYLOADS`` times, or the one dict."""
    if isinstance(make_inputs, Mapping):
        sets = [dict(make_inputs)]
    elif callable(make_inputs):
        sets = [dict(make_inputs()) for _ in range(_N_PAYLOADS)]
    else:
        raise TypeError("make_inputs: a function returning {input name: numpy array}, or such a dict")
    for s in sets:
        if not s or not all(isinstance(v, np.ndarray) for v in s.values()):
            raise TypeError(f"make_inputs must give {{input name: numpy array}}, got "
                            f"{ {k: type(v).__name__ for k, v in s.items()} }")
    return sets


async def _close(target: Any, attr: str) -> None:
    """Close the target's client (a failing close does not fail the run) and forget it."""
    conn = getattr(target, attr)
    setattr(target, attr, None)
    if conn is not None:
        with contextlib.suppress(Exception):
            await conn.close()


class TritonTarget:
    """An inference request to Triton (directly, or through nginx: pass its API key in ``headers``).

    ``url``: ``host:port`` of the protocol's endpoint (``http://`` accepted); ``make_inputs``: a function giving
    ``{name: np.ndarray}`` (called a few times up front, the payloads then sent in turn), or such a dict; the first
    dimension is the batch. ``verify(inputs, outputs)`` raises on a wrong answer, which then counts as a failed
    request (``wrong answer: ...``).
    """

    def __init__(self, url: str, model: str, make_inputs: Callable[[], Mapping[str, np.ndarray]] |
                 Mapping[str, np.ndarray], *, protocol: str = "http", headers: Mapping[str, str] | None = None,
                 outputs: Sequence[str] | None = None, verify: Verify | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        if protocol not in PROTOCOLS:
            raise ValueError(f"TritonTarget(protocol={protocol!r}): use one of {PROTOCOLS}")
        self.url, self.model, self.protocol = host_port(url), model, protocol
        self.payloads = payloads(make_inputs)
        first = next(iter(self.payloads[0].values()))
        self.batch = int(first.shape[0]) if first.ndim else 1
        # gRPC metadata keys are lowercase; HTTP headers are case-insensitive anyway
        self.headers = {(k.lower() if protocol == "grpc" else k): v for k, v in (headers or {}).items()} or None
        self.outputs, self.verify = outputs, verify
        self.max_connections = check_int(max_connections, "max_connections", "TritonTarget")
        self._client: Any = None
        self._reqs: list[Any] = []
        self._k = 0

    async def open(self) -> None:
        tc = _module(self.protocol, aio=True)
        self._client = (tc.InferenceServerClient(self.url, conn_limit=self.max_connections)
                        if self.protocol == "http" else tc.InferenceServerClient(self.url))
        self._reqs = [build_request(tc, self.protocol, p, self.outputs, binary=True) for p in self.payloads]
        self._k = 0

    def start_at(self, k: int) -> None:
        """Send payload ``k`` first (client processes of one run start at different payloads)."""
        self._k = k

    async def send(self) -> None:
        i = self._k % len(self._reqs)
        self._k += 1
        ins, outs = self._reqs[i]
        result = await self._client.infer(self.model, ins, outputs=outs, headers=self.headers)
        if self.verify is not None:
            # an unreadable answer (an empty tensor) is no wrong answer: as_arrays raises it as it is
            got = as_arrays(result, self.protocol, self.outputs)
            try:
                self.verify(self.payloads[i], got)
            except Exception as err:
                raise WrongAnswer(f"wrong answer: {err}") from None

    async def close(self) -> None:
        await _close(self, "_client")

    def __repr__(self) -> str:
        return f"TritonTarget({self.protocol}://{self.url}, model={self.model!r})"


class HttpTarget:
    """A plain HTTP request (aiohttp): ``method`` (POST with a ``body``, else GET) to ``url`` with ``headers``; an
    answer whose status is not in ``ok_status`` counts as failed, with the status and the body's start."""

    batch = 1

    def __init__(self, url: str, *, body: bytes | str | None = None, method: str | None = None,
                 headers: Mapping[str, str] | None = None, ok_status: Sequence[int] = (200,),
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpTarget(url={url!r}): give the full URL, e.g. http://127.0.0.1:8080/v2/health/ready")
        self.url = url
        self.body = body.encode() if isinstance(body, str) else body
        self.method = (method or ("POST" if body is not None else "GET")).upper()
        self.headers = dict(headers or {})
        self.ok_status = tuple(ok_status)
        self.max_connections = check_int(max_connections, "max_connections", "HttpTarget")
        self._session: Any = None

    async def open(self) -> None:
        try:
            import aiohttp
        except ImportError:
            raise ImportError("HttpTarget needs aiohttp: pip install aiohttp") from None
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections),
                                              timeout=aiohttp.ClientTimeout(total=None))

    async def send(self) -> None:
        async with self._session.request(self.method, self.url, data=self.body, headers=self.headers) as r:
            data = await r.read()
            if r.status not in self.ok_status:
                text = data[:80].decode(errors="replace").strip()
                raise HttpStatusError(f"HTTP {r.status}" + (f": {text}" if text else ""))

    async def close(self) -> None:
        await _close(self, "_session")

    def __repr__(self) -> str:
        return f"HttpTarget({self.method} {self.url})"


class FunctionTarget:
    """Any ``async def send()``: one request, raising when it failed."""

    batch = 1

    def __init__(self, fn: Callable[[], Awaitable[Any]]):
        self.fn = fn

    async def open(self) -> None:
        pass

    async def send(self) -> None:
        await self.fn()

    async def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"FunctionTarget({getattr(self.fn, '__name__', self.fn)!r})"


def as_target(target: Any) -> Any:
    """``target`` as a target: one already (``open``, ``send``, ``close``), or an ``async def`` of no arguments."""
    if all(callable(getattr(target, m, None)) for m in ("open", "send", "close")):
        return target
    if inspect.iscoroutinefunction(target):
        return FunctionTarget(target)
    raise TypeError(f"target={target!r}: give a TritonTarget, an HttpTarget, or an `async def send()` of no arguments "
                    "that raises when the request failed")


__all__ = ["TritonTarget", "HttpTarget", "FunctionTarget", "as_target", "HttpStatusError", "WrongAnswer",
           "Verify", "payloads", "PROTOCOLS"]
