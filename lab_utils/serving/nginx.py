"""Nginx in front of Triton: an owned ``nginx`` process, its generated config, and its JSON access log read back.

Stable API (lab 07 builds on it; lab 08 reloads weights for its canaries): ``__all__``. ``nginx_config`` writes
the config, ``check_nginx_config`` runs ``nginx -t`` on it (``NginxConfigError``: the problem, line and fix),
``NginxServer`` owns the process (``reload``, ``set_weights``, ``access_rows``, ``stub_status``).
Design notes: docs/internals.md#lab_utilsservingnginxpy
"""

from __future__ import annotations

import contextlib
import grp
import inspect
import json
import math
import os
import pwd
import re
import secrets
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from lab_utils.course.probe import NGINX_ENV, NGINX_SEARCH, find_nginx
from lab_utils.owned import HttpGrpcEndpoints, OwnedServer, usable
from lab_utils.procs import (
    check_url,
    env_flag,
    group_members,
    http_ok,
    owned_tempdir,
    pid_alive,
    tail,
    temporary_folder,
    wait_until,
)
from lab_utils.serving.jsoncheck import JsonCheck

REQUIRE_ENV = "NVLAB_REQUIRE_NGINX"  # 1: a missing nginx is an error (CI), not a skipped section
BINARY_ENV = NGINX_ENV  # the path of an nginx binary, or "none" to try a lab's no-nginx path
NGINX_INSTALL = ("Install it: `sudo apt-get install nginx` (Debian/Ubuntu; in an NGC container, which is Ubuntu: "
                 "`apt-get update && apt-get install -y nginx`), or `brew install nginx` (macOS); or point "
                 f"{BINARY_ENV} at an nginx binary")
API_KEY_HEADER = "X-API-Key"  # or "Authorization: Bearer <key>"
HTTP_UPSTREAM = "triton_http"
GRPC_UPSTREAM = "triton_grpc"
BALANCE = {"round_robin": "", "least_conn": "least_conn;", "random": "random two least_conn;"}
DEFAULT_STOP_GRACE_S = 2.0
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


class NginxNotFound(NginxError):
    """No nginx binary here: the message says how to install one."""


class NginxStartError(NginxError):
    """nginx exited or did not answer; the message carries its error log."""


class NginxConfigError(NginxError, ValueError):
    """``nginx -t`` (or the course's check before it) refused a config: ``.problem`` is nginx's words, ``.line`` the
    config line (1-based, or None), ``.fix`` what to change."""

    def __init__(self, message: str, problem: str = "", line: int | None = None, fix: str = ""):
        super().__init__(message)
        self.problem, self.line, self.fix = problem or message, line, fix


# --- the binary ----------------------------------------------------------------------------------------------


def required() -> bool:
    """True when ``NVLAB_REQUIRE_NGINX`` is 1/true/yes: a missing nginx is an error, not a skipped section."""
    return env_flag(REQUIRE_ENV)


def missing() -> str | None:
    """Why nginx cannot be used here, with the install line; None when it can."""
    if find_nginx() is not None:
        return None
    env = os.environ.get(BINARY_ENV, "").strip()
    where = f"${BINARY_ENV}={env}" if env else f"the PATH and {', '.join(NGINX_SEARCH[:2])}"
    if env and env.lower() != "none":
        where += " (expected the path of an executable nginx, or none)"
    return f"nginx not found (looked at {where}). {NGINX_INSTALL}"


def nginx_binary() -> str:
    """The nginx binary; ``NginxNotFound`` (with how to install it) when there is none."""
    why = missing()
    if why:
        raise NginxNotFound(why)
    return str(find_nginx())


def available(show: bool = True) -> bool:
    """True when nginx can run here. When not: prints how to install it (``show``) and returns False, or raises
    ``NginxNotFound`` under ``NVLAB_REQUIRE_NGINX=1``."""
    return usable(missing(), name="nginx", require_env=REQUIRE_ENV, required=required(), error=NginxNotFound,
                  skipped="The lab then drives one Triton server directly and says what it skipped.", show=show)


def nginx_version(binary: str | None = None) -> str:
    """``nginx/1.22.1``: what ``nginx -v`` says."""
    out = subprocess.run([binary or nginx_binary(), "-v"], capture_output=True, text=True, timeout=10)
    m = re.search(r"nginx/\S+", out.stderr + out.stdout)
    return m.group(0) if m else (out.stderr + out.stdout).strip()


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
    w = value.weight
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"{what} {address}: weight={w!r} must be an integer >= 1 (nginx refuses 0: to send it "
                         "nothing, use Backend(address, down=True) or leave it out)")
    return replace(value, address=address)


def _backends(values: Iterable[BackendLike] | None, what: str) -> list[Backend]:
    if values is None:
        return []
    if isinstance(values, (str, Backend)):
        values = [values]
    out = [as_backend(v, what) for v in values]
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
    if isinstance(rps, bool) or not isinstance(rps, (int, float)) or not math.isfinite(rps) or rps <= 0:
        raise ValueError(f"rate_limit_rps={rps!r}: a number of requests per second > 0 (or None: no limit)")
    if rps >= 1 and float(rps).is_integer():
        return f"{int(rps)}r/s"
    per_min = round(rps * 60)
    if per_min < 1:
        raise ValueError(f"rate_limit_rps={rps!r}: nginx's smallest rate is 1 request per minute (1/60 r/s)")
    return f"{per_min}r/m"


def _keys(api_keys: str | Sequence[str] | None) -> list[str]:
    if api_keys is None:
        return []
    keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
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


def nginx_config(
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
    block_lines: dict[str, tuple[int, int]] | None = None,
    json_check: str | None = None,
) -> str:
    """The whole ``nginx.conf``: paths relative to the prefix (``nginx -p PREFIX``), foreground by ``-g``.

    ``http_backends`` / ``grpc_backends``: the servers of the two upstreams (or ``upstream_block`` /
    ``grpc_upstream_block``: an ``upstream NAME { ... }`` written by hand, used as it is). ``api_keys``: requests
    without one of them (``X-API-Key: KEY`` or ``Authorization: Bearer KEY``) get 401; None or () is no check.
    Only the routes of ``HTTP_ROUTES`` and ``GRPC_METHODS`` pass to the backends (inference, model metadata, config
    and readiness, health); any other gets 403 (gRPC: PERMISSION_DENIED) with the reason.
    ``client_max_body_size``: larger bodies get 413. ``rate_limit_rps`` (per client address, ``rate_burst``
    requests of slack): requests over it get 429. ``generation`` is served at ``/generation`` on the status
    port, so a reload can be seen to have taken effect. Ports: ``http_port``, ``grpc_port`` (with gRPC
    backends), ``status_port`` (``stub_status``). ``block_lines``, given a dict, receives where each
    hand-written block sits ({argument: (first line, last line)}), for error messages. ``json_check``: the
    ``host:port`` of a ``jsoncheck.JsonCheck``, which answers in Triton's place when Triton says 500 on HTTP (400
    and the reason for a malformed body, Triton's parse errors; 500 for a well-formed one); None: Triton's answer.
    """
    if balance not in BALANCE:
        raise ValueError(f"balance={balance!r}: use one of {', '.join(BALANCE)}")
    for name, v, lo in (("workers", workers, 1), ("keepalive", keepalive, 0), ("rate_burst", rate_burst, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r}: must be an integer >= {lo}")
    if not (isinstance(proxy_timeout_s, (int, float)) and math.isfinite(proxy_timeout_s) and proxy_timeout_s > 0):
        raise ValueError(f"proxy_timeout_s={proxy_timeout_s!r}: a number of seconds > 0")
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
    timeout = f"{proxy_timeout_s:g}s"
    root = os.geteuid() == 0 if hasattr(os, "geteuid") else False

    out = ["# nginx.conf generated by lab_utils.serving.nginx: run with nginx -p PREFIX -c conf/nginx.conf",
           "# -g 'daemon off;' (the lab owns the process). Relative paths below are relative to PREFIX."]
    if root:  # the workers would become 'nobody', who cannot write the temp folders of a root-owned prefix
        out.append(f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};")
    out += [f"worker_processes {workers};", "pid nginx.pid;", "error_log logs/error.log warn;", "",
            "events {", "    worker_connections 4096;", "}", "", "http {",
            "    # temp files inside the prefix, not /var/lib/nginx (another user's, or absent)",
            "    client_body_temp_path temp/client_body;", "    proxy_temp_path temp/proxy;",
            "    fastcgi_temp_path temp/fastcgi;", "    uwsgi_temp_path temp/uwsgi;", "    scgi_temp_path temp/scgi;",
            "", f"    log_format nvlab_json escape=json {LOG_FORMAT};",
            "    access_log logs/access.json nvlab_json;  # one JSON object per line, written per request",
            f"    map $server_port $nvlab_listener {{ default other; {http_port} http;"
            + (f" {grpc_port} grpc;" if grpc_port else "") + " }", "",
            "    # what Triton's HTTP API reads: KServe v2 JSON (binary tensors after it), no type, or the form type",
            "    # curl -d and urllib send by default; other bodies (a file upload, a raw image, text) get 415",
            '    map "$request_method:$content_type" $nvlab_bad_type {', "        default 0;", '        "POST:" 0;',
            '        "~*^POST:application/(json|octet-stream|x-www-form-urlencoded)" 0;', '        "~^POST:" 1;',
            "    }", "",
            "    # the routes passed to Triton (an allowlist: everything else 403 before any server sees it)",
            '    map "$request_method $request_uri" $nvlab_route_ok {', "        default 0;",
            *[f'        "~^({methods}) {path}(\\?|$)" 1;' for methods, path in HTTP_ROUTES], "    }",
            "    map $request_uri $nvlab_grpc_route_ok {", "        default 0;",
            f'        "~^/{re.escape(GRPC_SERVICE)}/({"|".join(GRPC_METHODS)})$" 1;', "    }", ""]
    if keys:
        out += ["    # API key: X-API-Key: KEY, or Authorization: Bearer KEY (401 without one)",
                "    map $http_x_api_key $nvlab_key_header {", "        default 0;",
                *[f"        {k} 1;" for k in keys], "    }",
                "    map $http_authorization $nvlab_key_bearer {", "        default 0;",
                *[f'        "Bearer {k}" 1;' for k in keys], "    }",
                "    map $nvlab_key_header$nvlab_key_bearer $nvlab_authorized {", "        default 1;",
                "        00 0;", "    }", ""]
    if rate_limit_rps is not None:
        out += [f"    limit_req_zone $binary_remote_addr zone=nvlab_rate:1m rate={_rate(rate_limit_rps)};",
                "    limit_req_status 429;  # the default, 503, would read as a server fault", ""]
    def nlines() -> int:  # lines so far, a trailing empty one included
        return "\n".join(out).count("\n") + 1

    block_lines = {} if block_lines is None else block_lines
    for arg, up, block, name, servers in (("upstream_block", http_up, upstream_block, HTTP_UPSTREAM, http),
                                          ("grpc_upstream_block", grpc_up, grpc_upstream_block, GRPC_UPSTREAM, grpc_)):
        if up is not None:
            start = nlines() + 1
            out.append(_indent(block) if block is not None else _upstream(name, servers, balance, keepalive))
            block_lines[arg] = (start, nlines())
            out.append("")

    key_words = f"missing or wrong API key: send {API_KEY_HEADER}: <key> or Authorization: Bearer <key>"

    body_limit = f"        client_max_body_size {size};  # larger bodies: 413"

    def guard() -> list[str]:
        g = [body_limit]
        if keys:
            g += ["        if ($nvlab_authorized = 0) {", f"            return 401 '{{\"error\":\"{key_words}\"}}';",
                  "        }"]
        return g

    # gRPC's check sits in its location: the server's would refuse the error page's internal redirect too
    grpc_key = (["            if ($nvlab_authorized = 0) {", "                return 401;", "            }"]
                if keys else [])
    # the route checks sit in the locations too: an error page's internal redirect is a GET, which they would refuse
    route = ["            if ($nvlab_route_ok = 0) {",
             f"""                return 403 '{{"error":"{ROUTE_WORDS}"}}';""", "            }"]
    grpc_route = ["            if ($nvlab_grpc_route_ok = 0) {", "                return 403;", "            }"]

    # nginx's own refusals as JSON {"error": ...}, the form Triton's errors take: tritonclient shows the words
    rate_words = f"{_rate(rate_limit_rps)} per client address" if rate_limit_rps is not None else ""
    refusals = {413: f"request body over the limit (client_max_body_size {size})",
                429: f"over the rate limit ({rate_words}): slow down",
                502: "no backend answered: are the Triton servers up?",
                504: "the backend did not answer in time"}
    errors = ["        default_type application/json;  # nginx's own answers; proxied ones keep theirs"]
    for code, words in refusals.items():
        errors += [f"        error_page {code} /nvlab_error/{code};",
                   f"        location = /nvlab_error/{code} {{ internal; return {code} '{{\"error\":\"{words}\"}}'; }}"]
    # Triton answers a body it cannot parse (invalid JSON, wrong shape or types, no "inputs") with 500, an internal
    # error, though the fault is the client's. nginx cannot read the body: the check reads it again and answers 400
    # with the reason, or 500 for a well-formed one. Only Triton's 500s take this path (the body is still buffered)
    check = []
    if json_check is not None:
        errors += ["        error_page 500 = @nvlab_json_check;  # Triton's 500: a malformed body is a 400"]
        check = ["        location @nvlab_json_check {", f"            proxy_pass http://{json_check};",
                 f'            proxy_set_header {API_KEY_HEADER} "";', '            proxy_set_header Authorization "";',
                 "            proxy_read_timeout 10s;", "        }"]
    # over gRPC a refusal is a gRPC status (grpc-status and grpc-message on an empty answer) that the client reports
    # with its words; an HTTP error page would reach it as UNKNOWN or UNAVAILABLE with none
    grpc_errors = []
    for code, (status, words) in {401: (16, key_words), 403: (7, GRPC_ROUTE_WORDS), 413: (8, refusals[413]),
                                  429: (8, refusals[429]),
                                  502: (14, refusals[502]), 504: (14, refusals[504])}.items():
        grpc_errors += [f"        error_page {code} = /nvlab_grpc_error/{code};",
                        f"        location = /nvlab_grpc_error/{code} {{ internal; default_type application/grpc; "
                        f'add_header grpc-status {status}; add_header grpc-message "{words}"; return 204; }}']

    burst = f" burst={rate_burst} nodelay" if rate_burst else ""  # nginx refuses burst=0
    limit = [f"            limit_req zone=nvlab_rate{burst};"] if rate_limit_rps is not None else []
    media = ['        if ($nvlab_bad_type) {',
             f"            return 415 '{{\"error\":\"{BAD_TYPE_WORDS}\"}}';", "        }"]
    if http_up is not None:
        # a body over client_body_buffer_size goes to a temporary file and is sent on from there: measured here, a
        # 35 KB JPEG then waited 40 ms more (p50 49 against 4.8 ms straight to Triton). HTTP/1.1 bodies give their
        # length, and nginx allocates only that; gRPC's HTTP/2 bodies do not, and would each get the whole buffer
        out += ["    server {", f"        listen {host}:{http_port};", *guard(),
                f"        client_body_buffer_size {BODY_BUFFER};  # bodies up to it stay in memory", *media, *errors,
                "        location / {", *route, *limit,
                f"            proxy_pass http://{http_up};",
                *(["            proxy_intercept_errors on;  # Triton's 500 goes to the JSON check"] if check else []),
                f"            add_header {UPSTREAM_HEADER} $upstream_addr always;  # which server answered",
                "            proxy_http_version 1.1;  # keep-alive to the backends",
                '            proxy_set_header Connection "";', "            proxy_set_header Host $host;",
                f'            proxy_set_header {API_KEY_HEADER} "";  # the key stays at the door',
                '            proxy_set_header Authorization "";',
                f"            proxy_read_timeout {timeout};", f"            proxy_send_timeout {timeout};",
                "        }", *check, "    }", ""]
    if grpc_up is not None:
        out += ["    server {", f"        listen {host}:{grpc_port} http2;  # gRPC is HTTP/2",
                "        http2_max_concurrent_streams 1024;",
                body_limit, *grpc_errors,
                "        location / {", *grpc_key, *grpc_route, *limit,
                f"            grpc_pass grpc://{grpc_up};",
                f'            grpc_set_header {API_KEY_HEADER} "";', '            grpc_set_header Authorization "";',
                f"            grpc_read_timeout {timeout};", f"            grpc_send_timeout {timeout};",
                "        }", "    }", ""]
    out += ["    server {  # metrics and health, for this machine only",
            f"        listen {host}:{status_port};", "        access_log off;",
            "        location = /stub_status { stub_status; }",
            f'        location = /generation {{ return 200 "{generation}\\n"; }}', "    }", "}", ""]
    return "\n".join(out)

# nginx's message -> the fix, in words a student can act on. The first pattern that matches wins.
_FIXES: list[tuple[str, str]] = [
    (r'unknown directive "([^"]+)"', 'nginx has no directive "{0}": a typo? In an upstream block write '
                                     '`server HOST:PORT [weight=N];` lines (and `least_conn;`, `keepalive N;`)'),
    (r'host not found in upstream "([^"]+)"', 'the address "{0}" does not resolve: write the server as '
                                              '127.0.0.1:PORT (an IP address and a port)'),
    (r'invalid port in upstream "([^"]+)"', 'the port in "{0}" is not a number from 1 to 65535'),
    (r'no port in upstream "([^"]+)"', 'write "{0}" with a port: HOST:PORT'),
    (r'invalid parameter "(server|least_conn|keepalive|zone|hash|ip_hash|random)"',
     'nginx read "{0}" as part of the line before: end that line with ";"'),
    (r'invalid parameter "([^"]+)"', 'the server parameter "{0}" is not valid: use weight=N (an integer >= 1), '
                                     'max_fails=N, fail_timeout=Ns, backup or down'),
    (r'no servers are inside upstream', 'the upstream block has no server: add `server 127.0.0.1:PORT;` lines'),
    (r'duplicate upstream "([^"]+)"', 'two upstream blocks are named "{0}": give yours another name'),
    (r'"([^"]+)" directive is not allowed here', '"{0}" does not belong there: an upstream block holds server '
                                                 'lines and balancing directives only'),
    (r'"([^"]+)" directive is duplicate', '"{0}" appears twice in the same block: keep one'),
    (r'invalid number of arguments in "([^"]+)" directive', '"{0}" has the wrong number of arguments: is a ";" '
                                                             'missing at the end of the line before?'),
    (r'unexpected end of file', 'a "}" is missing: every "{" needs its "}", and every directive ends with ";"'),
    (r'unexpected "([^"]+)"', 'unexpected "{0}": a directive is missing its ";" or a "{{" / "}}" is unbalanced'),
    (r'directive "([^"]+)" has no opening "\{"', '"{0}" needs a "{{" block'),
    (r'directive "([^"]+)" is not terminated by ";"', 'end the "{0}" line with ";"'),
    (r'upstream "([^"]+)" may not have port', 'proxy_pass names the upstream "{0}" without a port'),
    (r"bind\(\) to (\S+) failed", 'the address {0} is taken: let the course pick free ports (pass no port)'),
]
_NGINX_MSG = re.compile(r"\[(emerg|alert|crit|error)\] (?:\d+#\d+: )?(.*?)(?: in (\S+):(\d+))?\s*$", re.M)


# nginx_config's keywords an NginxServer passes on as they are (``NginxServer.options``) -> their defaults; the
# others are the server's own (its ports, backends, keys, blocks and their line spans)
_OWN = {"http_port", "grpc_port", "status_port", "host", "api_keys", "upstream_block", "grpc_upstream_block",
        "generation", "block_lines", "json_check"}
OPTIONS = {k: p.default for k, p in inspect.signature(nginx_config).parameters.items()
           if p.kind is p.KEYWORD_ONLY and k not in _OWN}
def _explain(stderr: str, text: str, spans: dict[str, tuple[int, int]] | None = None, *,
             what: str = "the config") -> NginxConfigError:
    """``nginx -t``'s complaint as a ``NginxConfigError``: its words, the line (of the hand-written block when it is
    there) and the fix."""
    m = _NGINX_MSG.search(stderr)
    problem = m.group(2).strip() if m else (stderr.strip().splitlines() or ["nginx -t failed"])[-1]
    line = int(m.group(4)) if m and m.group(4) else None
    fix = "see https://nginx.org/en/docs/ for the directive named"
    for pattern, how in _FIXES:
        hit = re.search(pattern, problem)
        if hit:
            fix = how.format(*hit.groups())
            break
    where = ""
    lines = text.splitlines()
    if line is not None and 1 <= line <= len(lines):
        where = f" at line {line}: `{lines[line - 1].strip()}`"
        for arg, (a, b) in (spans or {}).items():
            if a <= line <= b:
                where = f" at line {line - a + 1} of your {arg}: `{lines[line - 1].strip()}`"
                what = f"your {arg}"
    return NginxConfigError(f"nginx -t refused {what}: {problem}{where}.\nFix: {fix}.", problem, line, fix)


_E_OPTION: dict[str, bool] = {}


def _error_log_arg(binary: str, prefix: Path) -> list[str]:
    """``-e PREFIX/logs/error.log``: the log nginx writes before it has read the config (else /var/log/nginx, another
    user's). nginx has ``-e`` from 1.19.5 on (Ubuntu 22.04 ships 1.18: it then only warns that it cannot open
    the default log, as a non-root user)."""
    if binary not in _E_OPTION:
        m = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", nginx_version(binary))
        _E_OPTION[binary] = not m or tuple(map(int, m.groups())) >= (1, 19, 5)
    return ["-e", str(prefix / "logs" / "error.log")] if _E_OPTION[binary] else []


def _prefix_dirs(prefix: Path) -> None:
    for sub in ("conf", "logs", "temp"):
        (prefix / sub).mkdir(parents=True, exist_ok=True)


def _test(binary: str, prefix: Path, conf: Path, spans: dict[str, tuple[int, int]] | None = None,
          what: str = "the config") -> str:
    """``nginx -t`` on ``conf``: its warnings, or the ``NginxConfigError`` of ``_explain``."""
    argv = [binary, "-t", "-q", "-p", f"{prefix}/", "-c", str(conf), *_error_log_arg(binary, prefix)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30.0)
    if out.returncode != 0:
        raise _explain(out.stderr + out.stdout, conf.read_text(), spans, what=what)
    return out.stderr.strip()


def check_nginx_config(text: str, binary: str | None = None, what: str = "the config",
                       spans: dict[str, tuple[int, int]] | None = None) -> str:
    """Run ``nginx -t`` on config ``text`` (in a temporary prefix); its warnings ('' when none).

    Raises ``NginxConfigError`` naming nginx's problem, the line and the fix; ``NginxNotFound`` without nginx.
    """
    binary = binary or nginx_binary()
    with temporary_folder("nginx-check") as prefix:
        _prefix_dirs(prefix)
        conf = prefix / "conf" / "nginx.conf"
        conf.write_text(text)
        return _test(binary, prefix, conf, spans, what)


def check_upstream_block(block: str, grpc: bool = False, binary: str | None = None) -> str:
    """Validate a hand-written ``upstream NAME { ... }`` block inside the course's config (``nginx -t``): the block's
    name, or ``NginxConfigError`` naming the problem, its line in the block, and the fix."""
    name = upstream_name(block, "grpc_upstream_block" if grpc else "upstream_block")
    kw = {"grpc_upstream_block": block, "grpc_port": 2} if grpc else {"upstream_block": block}
    spans: dict[str, tuple[int, int]] = {}
    text = nginx_config(http_port=1, status_port=3, api_keys=(), block_lines=spans, **kw)  # type: ignore[arg-type]
    check_nginx_config(text, binary, spans=spans)
    return name


# --- the JSON access log and stub_status ---------------------------------------------------------------------


def _seconds_list(value: str) -> list[float]:
    """``"0.004, 0.002 : 0.001"`` (one per upstream tried) -> [0.004, 0.002, 0.001]; ``"-"`` -> []."""
    return [float(v) for v in re.split(r"[,:]\s*", value.strip()) if v.strip() not in ("", "-")]


def read_access_log(path: str | os.PathLike[str], since: float | None = None) -> list[dict[str, Any]]:
    """The JSON access log as rows: every field of the log line, plus ``request_ms``, ``upstream`` (the server that
    answered, None when none did: a 401/413/429 at the door), ``upstream_ms`` and ``tries``.

    ``since``: only requests that ended at or after this time (epoch seconds, ``time.time()``). A line cut short
    (nginx writing it now) is skipped.
    """
    rows = []
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return []
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
        times = _seconds_list(re.split(r"\s:\s", row.get("upstream_response_time", ""))[0])
        row["request_ms"] = float(row.get("request_time", 0.0)) * 1e3
        row["upstream"] = addrs[-1] if addrs else None
        row["tries"] = len(addrs)
        row["upstream_ms"] = sum(times) * 1e3 if times else None
        rows.append(row)
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


# --- reload -------------------------------------------------------------------------------------------------


def reload_nginx(prefix: str | os.PathLike[str], conf: str | os.PathLike[str], binary: str | None = None,
                 timeout_s: float = 30.0) -> None:
    """``nginx -s reload -p PREFIX -c CONF``: the master re-reads CONF, starts workers with it, and lets the old
    workers finish their requests before they exit (nothing is dropped). ``NginxError`` with nginx's words when
    the signal could not be sent (no master running with that prefix's pid file)."""
    binary = binary or nginx_binary()
    argv = [binary, "-s", "reload", "-p", f"{prefix}/", "-c", str(conf), *_error_log_arg(binary, Path(prefix))]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise NginxError(f"`{' '.join(argv)}` failed: {(out.stderr or out.stdout).strip()}")


# --- the server ---------------------------------------------------------------------------------------------

class NginxServer(OwnedServer, HttpGrpcEndpoints):
    """One nginx (master and workers) owned by this interpreter, in front of Triton's HTTP and gRPC ports.

    >>> with NginxServer([s1.http_url, s2.http_url], [s1.grpc_url, s2.grpc_url]) as lb:   # doctest: +SKIP
    ...     tritonclient.http.InferenceServerClient(lb.http_url[7:]).infer(..., headers=lb.auth_headers)

    ``api_keys=None`` makes one random key (``.api_key``, ``.auth_headers``); ``()`` turns the check off. Ports
    are free loopback ports unless given. ``options``: ``nginx_config``'s ``OPTIONS`` (body size, rate limit...).
    ``check_json``: a ``JsonCheck`` in this process answers Triton's HTTP 500s (400 and the reason for a malformed
    body); False leaves Triton's answer as it is.
    """

    external = False
    error = NginxStartError
    name = "nginx"
    free_hint = "to let the course take a free one"
    watchdog_s = (1.0, 2.0)  # kills the workers a killed kernel's PDEATHSIG misses
    stop_grace_default_s = DEFAULT_STOP_GRACE_S

    def __init__(
        self,
        http_backends: Iterable[BackendLike] | None = (),
        grpc_backends: Iterable[BackendLike] | None = (),
        *,
        api_keys: str | Sequence[str] | None = None,
        upstream_block: str | None = None,
        grpc_upstream_block: str | None = None,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None = None,
        status_port: int | None = None,
        startup_timeout_s: float = 15.0,
        stop_grace_s: float | None = None,
        binary: str | None = None,
        check_json: bool = True,
        **options: Any,
    ):
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"NginxServer({unknown[0]}=...): no such argument (nginx's options: {', '.join(OPTIONS)})")
        self.http_backends = _backends(http_backends, "http_backends")
        self.grpc_backends = _backends(grpc_backends, "grpc_backends")
        self.api_keys = [new_api_key()] if api_keys is None else _keys(api_keys)
        self.options = options  # nginx_config's keywords (its defaults for the others); a reload applies changes
        self.upstream_block, self.grpc_upstream_block = upstream_block, grpc_upstream_block
        super().__init__(host=host, ports={"http_port": http_port, "grpc_port": grpc_port, "status_port": status_port},
                         startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s)
        self.http_port = self.grpc_port = self.status_port = 0
        self.binary = binary
        self.json_check = JsonCheck(host) if check_json else None
        self.generation = 0
        self.config_text = ""
        self._render(probe_ports=True)  # a bad argument fails here, before anything starts

    # config -----------------------------------------------------------------------------------------------
    @property
    def has_grpc(self) -> bool:
        return bool(self.grpc_backends) or self.grpc_upstream_block is not None

    def _render(self, probe_ports: bool = False) -> tuple[str, dict[str, tuple[int, int]]]:
        ports = (1, 2, 3) if probe_ports else (self.http_port, self.grpc_port, self.status_port)
        spans: dict[str, tuple[int, int]] = {}
        text = nginx_config(self.http_backends, self.grpc_backends, http_port=ports[0],
                            grpc_port=ports[1] if self.has_grpc else None, status_port=ports[2], host=self.host,
                            api_keys=self.api_keys, upstream_block=self.upstream_block,
                            grpc_upstream_block=self.grpc_upstream_block, generation=self.generation,
                            block_lines=spans, json_check=None if probe_ports or self.json_check is None
                            else self.json_check.address, **self.options)
        return text, spans

    # urls and paths ----------------------------------------------------------------------------------------
    @property
    def status_url(self) -> str:
        return f"http://{self.host}:{self.status_port}/stub_status"

    @property
    def api_key(self) -> str | None:
        return self.api_keys[0] if self.api_keys else None

    @property
    def auth_headers(self) -> dict[str, str]:
        """``{"X-API-Key": key}`` (empty without a key): pass as ``headers=`` to a tritonclient's ``infer``."""
        return {API_KEY_HEADER: self.api_key} if self.api_key else {}

    @property
    def conf_path(self) -> Path:
        return self._need_prefix() / "conf" / "nginx.conf"

    @property
    def access_log_path(self) -> Path:
        return self._need_prefix() / "logs" / "access.json"

    @property
    def error_log_path(self) -> Path:
        return self._need_prefix() / "logs" / "error.log"

    @property
    def prefix(self) -> Path | None:
        """nginx's prefix folder (config, logs, pid, temp files); None before start."""
        return self.folder

    def _need_prefix(self) -> Path:
        if self.folder is None:
            raise NginxError("nginx is not started: call start() (or use `with NginxServer(...) as lb:`)")
        return self.folder

    def worker_pids(self) -> list[int]:
        """The worker processes now (after a reload, old workers finishing their requests included)."""
        if not self.alive():
            return []
        return sorted(p for p in group_members(self._proc.pid) if p != self._proc.pid)  # type: ignore[union-attr]

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of nginx's error log (and of what it printed at start)."""
        if self.folder is None:
            return ""
        return "\n".join(t for t in (tail(self._log_file(), n), tail(self.error_log_path, n)) if t)

    def __repr__(self) -> str:
        grpc_ = f", grpc={self.grpc_url}" if self.has_grpc else ""
        return f"NginxServer({self._state()}, http={self.http_url}{grpc_}, prefix={self.prefix})"

    # lifecycle: see OwnedServer (the prefix folder goes at stop: read the access log before) -----------------
    def _check(self) -> None:
        self.binary = self.binary or nginx_binary()

    def _log_file(self) -> Path:
        return self._need_prefix() / "logs" / "stderr.log"

    def _prepare(self) -> dict[str, Any]:
        if self.json_check is not None:
            self.json_check.start()
        self.folder = owned_tempdir("nginx")
        _prefix_dirs(self.folder)
        self.config_text, spans = self._render()
        self.conf_path.write_text(self.config_text)
        _test(str(self.binary), self.folder, self.conf_path, spans)
        return {"cwd": str(self.folder)}

    def _cleanup(self) -> None:
        super()._cleanup()
        if self.json_check is not None:
            self.json_check.stop()

    def _command(self) -> list[str]:
        binary = str(self.binary)
        prefix = self._need_prefix()
        return [binary, "-p", f"{prefix}/", "-c", str(self.conf_path), *_error_log_arg(binary, prefix),
                "-g", "daemon off;"]

    def _ready_url(self) -> str:
        return f"http://{self.host}:{self.status_port}/generation"

    # reload --------------------------------------------------------------------------------------------------
    def reload(self, timeout_s: float = 10.0) -> None:
        """Apply the current settings without dropping a request: render, ``nginx -t``, ``nginx -s reload``, and
        wait until the new workers answer (``/generation`` on the status port says the new number) and the old ones
        have finished their requests and exited (until then they still accept connections, with the old config)."""
        with self._owner_lock:
            if not self.alive():
                raise NginxError(f"nginx is not running ({self!r}): start() it first")
            old_workers = set(self.worker_pids())
            self.generation += 1
            text, spans = self._render()
            new = self.conf_path.with_name("nginx.conf.new")
            new.write_text(text)
            try:
                _test(str(self.binary), self._need_prefix(), new, spans)
            except NginxConfigError:
                self.generation -= 1
                new.unlink()
                raise
            new.replace(self.conf_path)  # the master re-reads the file it was started with
            self.config_text = text
            reload_nginx(self._need_prefix(), self.conf_path, self.binary)
            want = f"{self.generation}".encode()
            if not wait_until(lambda: not self.alive() or http_ok(self._ready_url(), timeout_s=2.0,
                                                                  check=lambda body: body.strip() == want)[0],
                              timeout_s, 0.02) or not self.alive():
                raise NginxError(f"nginx did not take the new config within {timeout_s:g} s; its log:\n"
                                 f"{self.log_tail(10)}")
            # Old workers accept new connections until they act on the master's signal to quit: wait until they are
            # gone (each finishes its requests in flight first), so that no request sent after this returns meets
            # the old config. A long request keeps its worker: after 5 s, return anyway.
            wait_until(lambda: not any(pid_alive(p) for p in old_workers), min(timeout_s, 5.0), 0.01)

    def set_weights(self, http: dict[str, int] | None = None, grpc: dict[str, int] | None = None,
                    timeout_s: float = 10.0) -> None:
        """New weights, ``{address: weight}`` (a weight of 0 marks the server ``down``), applied by a reload."""
        def apply(backends: list[Backend], weights: dict[str, int] | None, what: str) -> list[Backend]:
            if not weights:
                return backends
            known = {b.address: b for b in backends}
            new = {}
            for addr, w in weights.items():
                a = as_backend(addr, what).address
                if a not in known:
                    raise ValueError(f"{what}: {a} is not one of this nginx's servers ({', '.join(known)})")
                new[a] = replace(known[a], down=True) if w == 0 else as_backend(Backend(a, w), what)
            out = [new.get(b.address, b) for b in backends]
            if all(b.down for b in out):
                raise ValueError(f"{what}: every server would be down; at least one must take traffic")
            return out

        with self._owner_lock:
            if (http and self.upstream_block is not None) or (grpc and self.grpc_upstream_block is not None):
                raise ValueError("this nginx serves a hand-written upstream block: edit the block instead")
            old = (self.http_backends, self.grpc_backends)
            self.http_backends = apply(self.http_backends, http, "http_backends")
            self.grpc_backends = apply(self.grpc_backends, grpc, "grpc_backends")
            try:
                self.reload(timeout_s)
            except BaseException:
                self.http_backends, self.grpc_backends = old
                raise

    # what it saw ---------------------------------------------------------------------------------------------
    def access_rows(self, since: float | None = None) -> list[dict[str, Any]]:
        """The access log's rows (see ``read_access_log``), every answered request's included.

        A worker writes a request's line just after the answer's last byte left, so a client can read the log a
        moment too early. A request to the status port first goes through the same event loop (one worker) after
        those writes; with more workers, the file must also stop growing for 20 ms.
        """
        path = self.access_log_path
        if self.alive():
            http_ok(self._ready_url(), timeout_s=2.0)
            if int(self.options.get("workers", OPTIONS["workers"])) > 1:
                size, deadline = -1, time.monotonic() + 1.0
                while time.monotonic() < deadline and (now := path.stat().st_size if path.exists() else 0) != size:
                    size = now
                    threading.Event().wait(0.02)
        return read_access_log(path, since)

    def access_summary(self, since: float | None = None) -> dict[str, Any]:
        """Requests per upstream, status codes and latency from the access log (see ``summarize_access``)."""
        return summarize_access(self.access_rows(since))

    def stub_status(self) -> dict[str, int]:
        """nginx's own counters now (``stub_status``): active connections, accepts, handled, requests..."""
        with urllib.request.urlopen(self.status_url, timeout=5) as r:
            return parse_stub_status(r.read().decode())


def serve_upstream(upstream_block: str, *, grpc_upstream_block: str | None = None, **kwargs: Any) -> NginxServer:
    """A started ``NginxServer`` whose HTTP upstream is the hand-written ``upstream_block`` (lab 07's exercise):
    checked first (``NginxConfigError`` names the problem, its line in the block, and the fix), then served. Use it
    in a ``with`` block; ``kwargs`` are ``NginxServer``'s."""
    upstream_name(upstream_block)
    server = NginxServer(upstream_block=upstream_block, grpc_upstream_block=grpc_upstream_block, **kwargs)
    return server.start()


def leftover_nginx(prefix: str | os.PathLike[str]) -> list[int]:
    """Live nginx processes of ``prefix`` (what a killed owner could leave behind): the master names it on its
    command line; the workers' command line does not, but they run in it (their working folder)."""
    needle = str(prefix).rstrip("/")
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if not cmd.startswith("nginx"):
            continue
        cwd = ""
        with contextlib.suppress(psutil.Error):  # another user's process: its command line is enough
            cwd = p.cwd()
        if (needle in cmd or cwd == needle or cwd.startswith(needle + "/")) and pid_alive(p.pid):
            out.append(p.pid)
    return out


__all__ = ["Backend", "NginxServer", "NginxError", "NginxNotFound", "NginxStartError", "NginxConfigError",
           "nginx_binary", "missing", "available", "required", "nginx_version", "nginx_config", "check_nginx_config",
           "check_upstream_block", "serve_upstream", "reload_nginx", "read_access_log", "summarize_access",
           "parse_stub_status", "new_api_key", "as_backend", "upstream_name", "leftover_nginx",
           "API_KEY_HEADER", "REQUIRE_ENV", "HTTP_ROUTES", "GRPC_METHODS"]
