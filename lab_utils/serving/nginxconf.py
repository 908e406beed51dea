"""nginx's config for the course: the values checked (``config_context``), the template rendered (``render_config``,
``nginx_config``: ``lab_utils/data/nginx/nginx.conf.j2``), an upstream block read (``upstream_name``).

Text only, no process: ``lab_utils.serving.nginx`` runs nginx with it and re-exports these names.
Design notes: docs/internals.md#lab_utilsservingnginxpy
"""

from __future__ import annotations

import functools
import grp
import inspect
import os
import pwd
import re
import secrets
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lab_utils import DATA_DIR
from lab_utils.args import check_int, check_positive
from lab_utils.procs import check_url

API_KEY_HEADER = "X-API-Key"  # or "Authorization: Bearer <key>"
HTTP_UPSTREAM = "triton_http"
GRPC_UPSTREAM = "triton_grpc"
BALANCE = {"round_robin": "", "least_conn": "least_conn;", "random": "random two least_conn;"}
_KEY = re.compile(r"[A-Za-z0-9_-]{8,256}")  # what a map key may hold unquoted: no '~' (regex), space, '$' or quote
_SIZE = re.compile(r"(\d+)([kKmMgG]?)")


# The routes the front door passes to Triton; every other request gets 403 before any server sees it (an allowlist:
# a route Triton adds later stays shut). Clients need inference, the model's metadata, config and readiness, and
# health. Model control (load/unload), the repository index, statistics, server metadata, shared memory, tracing,
# logging, generate and streams stay on the servers' own ports: an API key lets a client send requests, not run the
# server. The path is matched as the client sent it (nginx passes that form on to Triton): no %-escapes, no dot
# segments, model names of letters, digits, '_', '-' and '.'. Prometheus scrapes each Triton's metrics port, not
# nginx, so the statistics need no route here either.
_NAME = r"[A-Za-z0-9_-][A-Za-z0-9_.-]*"
HTTP_ROUTES = (  # (methods, path regex) of what passes, a query string allowed after it
    ("GET|HEAD", r"/v2/health/(live|ready)"),
    ("GET|HEAD", rf"/v2/models/(?!stats(\?|$)){_NAME}(/versions/[0-9]+)?(/config|/ready)?"),
    ("POST", rf"/v2/models/{_NAME}(/versions/[0-9]+)?/infer"),
)
GRPC_SERVICE = "inference.GRPCInferenceService"
GRPC_METHODS = ("ServerLive", "ServerReady", "ModelReady", "ModelMetadata", "ModelConfig", "ModelInfer")
ROUTE_WORDS = ("this route is not served through the front door: it passes inference "
               "(POST /v2/models/NAME/infer), model metadata, config and readiness (GET "
               "/v2/models/NAME[/config|/ready]) and health (GET /v2/health/live|ready); model control, the "
               "repository, statistics and the server settings are for the operator, on the port of each Triton server")
GRPC_ROUTE_WORDS = (f"this method is not served through the front door: it passes {', '.join(GRPC_METHODS)} of "
                    f"{GRPC_SERVICE}; model control, the repository, statistics and the server settings are for the "
                    "operator, on the port of each Triton server")

UPSTREAM_HEADER = "X-Upstream-Addr"  # response header naming the Triton server that answered (lab 08's canary)
BAD_TYPE_WORDS = ("unsupported Content-Type: send application/json (KServe v2 JSON, binary tensors after it with "
                  "Inference-Header-Content-Length), not a file upload (multipart), a raw image or text")



class NginxError(RuntimeError):
    """Nginx could not be used; the message says why and what to do."""


class NginxConfigError(NginxError, ValueError):
    """``nginx -t`` (or the course's check before it) refused a config: ``.problem`` is nginx's words, ``.line`` the
    config line (1-based, or None), ``.fix`` what to change."""

    def __init__(self, message: str, problem: str = "", line: int | None = None, fix: str = ""):
        super().__init__(message)
        self.problem, self.line, self.fix = problem or message, line, fix


# --- backends and config -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """One upstream server: ``address`` is ``HOST:PORT`` (an ``http://`` or ``grpc://`` prefix is dropped);
    ``weight`` its share in round robin (>= 1: 9 and 1 send 90 % and 10 %); ``down`` takes it out."""

    address: str
    weight: int = 1
    down: bool = False

    def line(self) -> str:
        extra = (f" weight={self.weight}" if self.weight != 1 else "") + (" down" if self.down else "")
        return f"server {self.address}{extra};"


BackendLike = Backend | str | tuple[str, int]


def as_backend(value: BackendLike, what: str = "backend") -> Backend:
    """``value`` (a ``Backend``, ``"host:port"``, a server's URL, or ``(address, weight)``) as a checked ``Backend``."""
    if isinstance(value, tuple) and len(value) == 2:
        value = Backend(str(value[0]), value[1])  # type: ignore[arg-type]
    elif isinstance(value, str):
        value = Backend(value)
    elif not isinstance(value, Backend):
        raise TypeError(f"{what}={value!r}: give 'HOST:PORT', (address, weight) or Backend(address, weight)")
    address = check_url(value.address, what, schemes=("http", "grpc"), bare=True)
    check_int(value.weight, "weight", f"{what} {address}",
              what="nginx refuses 0: to send it nothing, use Backend(address, down=True) or leave it out")
    return replace(value, address=address)


def _backends(values: Iterable[BackendLike] | None, what: str) -> list[Backend]:
    if isinstance(values, (str, Backend)):
        values = [values]
    out = [as_backend(v, what) for v in values or ()]
    seen = Counter(b.address for b in out)
    twice = [a for a, n in seen.items() if n > 1]
    if twice:
        raise ValueError(f"{what}: {', '.join(twice)} listed twice; give each server once, with a weight")
    if out and all(b.down for b in out):
        raise ValueError(f"{what}: every server is down; at least one must take traffic")
    return out


BODY_BUFFER = "512k"  # request bodies nginx keeps in memory (HTTP): the service's images are at most 256 KB


def _size(value: int | str, what: str = "client_max_body_size") -> str:
    """A size for nginx: an int of bytes, or ``"8m"``, ``"512k"``, ``"1g"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or \
            (isinstance(value, int) and value < 0) or (isinstance(value, str) and not _SIZE.fullmatch(value.strip())):
        raise ValueError(f"{what}={value!r}: give bytes (an int >= 0) or a size like '8m', '512k' (0: no limit)")
    return str(value).strip().lower()


def _rate(rps: float) -> str:
    """``limit_req_zone``'s rate: requests per second, or per minute below 1 r/s (nginx takes integers only)."""
    rps = check_positive(rps, "rate_limit_rps", "nginx_config", what="number of requests per second (None: no limit)")
    if rps >= 1 and float(rps).is_integer():
        return f"{int(rps)}r/s"
    per_min = round(rps * 60)
    if per_min < 1:
        raise ValueError(f"rate_limit_rps={rps!r}: nginx's smallest rate is 1 request per minute (1/60 r/s)")
    return f"{per_min}r/m"


def _keys(api_keys: str | Sequence[str] | None) -> list[str]:
    keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or ())
    keys = [k for k in keys if k != ""]
    for k in keys:
        if not isinstance(k, str) or not _KEY.fullmatch(k) or k in ("default", "hostnames", "volatile", "include"):
            raise ValueError(f"api key {k!r}: use 8 to 256 letters, digits, '-' or '_' (secrets.token_urlsafe(16) "
                             "makes one)")
    return keys


def new_api_key() -> str:
    """A random API key (22 URL-safe characters)."""
    return secrets.token_urlsafe(16)


def _upstream(name: str, backends: Sequence[Backend], balance: str, keepalive: int) -> str:
    lines = [f"    upstream {name} {{",
             f"        zone {name} 64k;  # shared by the workers: one round robin, weights exact across workers"]
    if BALANCE[balance]:
        lines.append(f"        {BALANCE[balance]}")
    lines += [f"        {b.line()}" for b in backends]
    if keepalive:
        lines.append(f"        keepalive {keepalive};  # reuse connections to the backends")
    lines.append("    }")
    return "\n".join(lines)


_UPSTREAM_HEAD = re.compile(r"^\s*upstream\s+([A-Za-z0-9_.-]+)\s*\{", re.M)
_SERVER_LINE = re.compile(r"^\s*server\s+([^\s;]+)", re.M)


def upstream_name(block: str, what: str = "upstream_block") -> str:
    """The name of the one ``upstream NAME { ... }`` in ``block``; a clear ``NginxConfigError`` when there is none,
    more than one, or a server without a port (nginx would quietly use port 80)."""
    if not isinstance(block, str) or not block.strip():
        raise NginxConfigError(f"{what} is empty: write an upstream block, e.g.\n{_EXAMPLE_BLOCK}",
                               "empty upstream block", None, "write the block")
    heads = _UPSTREAM_HEAD.findall(block)
    if len(heads) != 1:
        why = "no `upstream NAME {` line" if not heads else f"{len(heads)} upstream blocks ({', '.join(heads)})"
        raise NginxConfigError(f"{what} has {why}: write exactly one block, e.g.\n{_EXAMPLE_BLOCK}",
                               why, None, "one upstream block")
    opened, closed = block.count("{"), block.count("}")
    if opened != closed:
        raise NginxConfigError(f"{what} has {opened} '{{' and {closed} '}}': "
                               + ("close the block with '}'" if opened > closed else "remove the extra '}'"),
                               "unbalanced braces", None, "one '{' and one '}'")
    for addr in _SERVER_LINE.findall(block):
        if addr.startswith("unix:"):
            continue
        host_port = addr.rsplit("]", 1)[-1] if addr.startswith("[") else addr
        if ":" not in host_port:
            raise NginxConfigError(f"{what}: `server {addr}` has no port, so nginx would send to port 80: write "
                                   f"`server {addr}:PORT;` with the backend's port", f"server {addr} has no port",
                                   None, f"server {addr}:PORT;")
    return heads[0]


_EXAMPLE_BLOCK = ("    upstream triton_http {\n        server 127.0.0.1:8000 weight=1;\n"
                  "        server 127.0.0.1:8010 weight=1;\n    }")


def _indent(block: str) -> str:
    lines = block.strip("\n").splitlines()
    pad = min((len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()), default=0)
    return "\n".join("    " + ln[pad:] if ln.strip() else "" for ln in lines)


LOG_FORMAT = ("'{\"time\":\"$time_iso8601\",\"msec\":$msec,\"listener\":\"$nvlab_listener\","
              "\"remote_addr\":\"$remote_addr\",\"method\":\"$request_method\",\"uri\":\"$uri\","
              "\"status\":$status,\"bytes\":$body_bytes_sent,\"request_length\":$request_length,"
              "\"request_time\":$request_time,\"upstream_addr\":\"$upstream_addr\","
              "\"upstream_status\":\"$upstream_status\",\"upstream_response_time\":\"$upstream_response_time\","
              "\"grpc_status\":\"$sent_trailer_grpc_status\"}'")


TEMPLATE = DATA_DIR / "nginx" / "nginx.conf.j2"  # the config's text; nginx_config checks the values it is given


@functools.lru_cache(maxsize=1)
def _template() -> Any:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE.parent), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    return env.get_template(TEMPLATE.name)


def config_context(
    http_backends: Iterable[BackendLike] | None = (),
    grpc_backends: Iterable[BackendLike] | None = (),
    *,
    http_port: int,
    grpc_port: int | None = None,
    status_port: int,
    host: str = "127.0.0.1",
    api_keys: str | Sequence[str] | None = None,
    client_max_body_size: int | str = "8m",
    rate_limit_rps: float | None = None,
    rate_burst: int = 0,
    balance: str = "round_robin",
    keepalive: int = 32,
    workers: int = 1,
    proxy_timeout_s: float = 60.0,
    upstream_block: str | None = None,
    grpc_upstream_block: str | None = None,
    generation: int = 0,
    json_check: str | None = None,
) -> dict[str, Any]:
    """Every value of ``nginx_config`` checked (a ``ValueError`` or ``NginxConfigError`` naming the argument), as
    the template's variables: what a server checks at construction, before it renders the config at its start."""
    if balance not in BALANCE:
        raise ValueError(f"balance={balance!r}: use one of {', '.join(BALANCE)}")
    for name, v, lo in (("workers", workers, 1), ("keepalive", keepalive, 0), ("rate_burst", rate_burst, 0)):
        check_int(v, name, "nginx_config", minimum=lo)
    check_positive(proxy_timeout_s, "proxy_timeout_s", "nginx_config", what="number of seconds")
    http = _backends(http_backends, "http_backends")
    grpc_ = _backends(grpc_backends, "grpc_backends")
    keys = _keys(api_keys)
    size = _size(client_max_body_size)
    http_up = upstream_name(upstream_block) if upstream_block is not None else (HTTP_UPSTREAM if http else None)
    grpc_up = (upstream_name(grpc_upstream_block, "grpc_upstream_block") if grpc_upstream_block is not None
               else (GRPC_UPSTREAM if grpc_ else None))
    if http_up is None and grpc_up is None:
        raise ValueError("no backend: give http_backends (Triton's HTTP ports), grpc_backends (its gRPC ports), or "
                         "an upstream_block")
    if json_check is not None:
        json_check = check_url(json_check, "json_check", schemes=("http",), bare=True)
    if grpc_up is not None and grpc_port is None:
        raise ValueError("grpc backends need grpc_port (the listener nginx serves gRPC on)")
    rate = _rate(rate_limit_rps) if rate_limit_rps is not None else None
    # {argument: the upstream block}, in the config's order: a hand-written one as it is, else the course's own
    upstreams = {arg: (_indent(block) if block is not None else _upstream(name, servers, balance, keepalive))
                 for arg, up, block, name, servers in (
                     ("upstream_block", http_up, upstream_block, HTTP_UPSTREAM, http),
                     ("grpc_upstream_block", grpc_up, grpc_upstream_block, GRPC_UPSTREAM, grpc_)) if up is not None}
    # nginx's own refusals as JSON {"error": ...}, the form Triton's errors take: tritonclient shows the words
    rate_words = f"{rate} per client address" if rate else ""
    refusals = {413: f"request body over the limit (client_max_body_size {size})",
                429: f"over the rate limit ({rate_words}): slow down",
                502: "no backend answered: are the Triton servers up?",
                504: "the backend did not answer in time"}
    key_words = f"missing or wrong API key: send {API_KEY_HEADER}: <key> or Authorization: Bearer <key>"
    # over gRPC a refusal is a gRPC status (grpc-status and grpc-message on an empty answer) that the client reports
    # with its words; an HTTP error page would reach it as UNKNOWN or UNAVAILABLE with none
    grpc_refusals = {401: (16, key_words), 403: (7, GRPC_ROUTE_WORDS), 413: (8, refusals[413]),
                     429: (8, refusals[429]), 502: (14, refusals[502]), 504: (14, refusals[504])}
    root = os.geteuid() == 0 if hasattr(os, "geteuid") else False
    return {  # the workers of a root nginx would become 'nobody', who cannot write a root-owned prefix's folders
        "user": f"{pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name}" if root else None,
        "workers": workers, "log_format": LOG_FORMAT, "http_port": http_port, "grpc_port": grpc_port,
        "status_port": status_port, "host": host, "http_routes": HTTP_ROUTES, "grpc_service": re.escape(GRPC_SERVICE),
        "grpc_methods": "|".join(GRPC_METHODS), "keys": keys, "rate": rate, "rate_burst": rate_burst,
        "upstreams": upstreams, "http_upstream": http_up, "grpc_upstream": grpc_up, "size": size,
        "body_buffer": BODY_BUFFER, "key_words": key_words, "bad_type_words": BAD_TYPE_WORDS,
        "route_words": ROUTE_WORDS, "refusals": refusals, "grpc_refusals": grpc_refusals, "json_check": json_check,
        "upstream_header": UPSTREAM_HEADER, "api_key_header": API_KEY_HEADER, "timeout": f"{proxy_timeout_s:g}s",
        "generation": generation,
    }


def render_config(context: dict[str, Any], block_lines: dict[str, tuple[int, int]] | None = None) -> str:
    """The template rendered with ``config_context``'s variables. ``block_lines``, given a dict, receives where each
    upstream block sits ({argument: (first line, last line)}), for error messages about a hand-written one."""
    arg_of = {f"@@nvlab-{arg}@@": arg for arg in context["upstreams"]}  # a line marking where each block goes
    out: list[str] = []
    for line in _template().render({**context, "upstreams": list(arg_of)}).split("\n"):
        arg = arg_of.get(line)
        if arg is None:
            out.append(line)
            continue
        block = context["upstreams"][arg].split("\n")
        if block_lines is not None:
            block_lines[arg] = (len(out) + 1, len(out) + len(block))
        out += block
    return "\n".join(out)


def nginx_config(http_backends: Iterable[BackendLike] | None = (), grpc_backends: Iterable[BackendLike] | None = (),
                 *, block_lines: dict[str, tuple[int, int]] | None = None, **options: Any) -> str:
    """The whole ``nginx.conf`` (the template ``TEMPLATE``): paths relative to the prefix (``nginx -p PREFIX``),
    foreground by ``-g``.

    ``http_backends`` / ``grpc_backends``: the servers of the two upstreams (or ``upstream_block`` /
    ``grpc_upstream_block``: an ``upstream NAME { ... }`` written by hand, used as it is). ``api_keys``: requests
    without one of them (``X-API-Key: KEY`` or ``Authorization: Bearer KEY``) get 401; None or () is no check.
    Only the routes of ``HTTP_ROUTES`` and ``GRPC_METHODS`` pass to the backends (inference, model metadata, config
    and readiness, health); any other gets 403 (gRPC: PERMISSION_DENIED) with the reason.
    ``client_max_body_size``: larger bodies get 413. ``rate_limit_rps`` (per client address, ``rate_burst``
    requests of slack): requests over it get 429. ``generation`` is served at ``/generation`` on the status
    port, so a reload can be seen to have taken effect. Ports: ``http_port``, ``grpc_port`` (with gRPC
    backends), ``status_port`` (``stub_status``). ``options``: ``config_context``'s keywords (their defaults there).
    ``block_lines``: see ``render_config``. ``json_check``: the
    ``host:port`` of a ``jsoncheck.JsonCheck``, which answers in Triton's place when Triton says 500 on HTTP (400
    and the reason for a malformed body, Triton's parse errors; 500 for a well-formed one); None: Triton's answer.
    """
    return render_config(config_context(http_backends, grpc_backends, **options), block_lines)


# nginx_config's keywords an NginxServer passes on as they are (``NginxServer.options``) -> their defaults; the
# others are the server's own (its ports, backends, keys, blocks and their line spans)
_OWN = {"http_port", "grpc_port", "status_port", "host", "api_keys", "upstream_block", "grpc_upstream_block",
        "generation", "json_check"}
OPTIONS = {k: p.default for k, p in inspect.signature(config_context).parameters.items()
           if p.kind is p.KEYWORD_ONLY and k not in _OWN}
