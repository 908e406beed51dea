"""Nginx in front of Triton: an owned ``nginx`` process, its generated config, and its JSON access log read back.

Stable API (lab 07 builds on it; lab 08 reloads weights for its canaries): ``__all__``. ``nginx_config`` writes
the config, ``check_nginx_config`` runs ``nginx -t`` on it (``NginxConfigError``: the problem, line and fix),
``NginxServer`` owns the process (``reload``, ``set_weights``, ``access_rows``, ``stub_status``).
Design notes: docs/internals.md#lab_utilsservingnginxpy
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from lab_utils.course.probe import NGINX_ENV, NGINX_SEARCH, find_nginx
from lab_utils.owned import HttpGrpcEndpoints, OwnedServer, usable
from lab_utils.procs import (
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
from lab_utils.serving.nginxconf import (  # noqa: F401 (the config's names, re-exported: nginx.nginx_config ...)
    _SERVER_LINE,
    API_KEY_HEADER,
    GRPC_METHODS,
    HTTP_ROUTES,
    OPTIONS,
    TEMPLATE,
    UPSTREAM_HEADER,
    Backend,
    BackendLike,
    NginxConfigError,
    NginxError,
    _backends,
    _keys,
    as_backend,
    config_context,
    new_api_key,
    nginx_config,
    render_config,
    upstream_name,
)
from lab_utils.serving.nginxlog import parse_stub_status, read_access_log, summarize_access

REQUIRE_ENV = "NVLAB_REQUIRE_NGINX"  # 1: a missing nginx is an error (CI), not a skipped section
BINARY_ENV = NGINX_ENV  # the path of an nginx binary, or "none" to try a lab's no-nginx path
NGINX_INSTALL = ("Install it: `sudo apt-get install nginx` (Debian/Ubuntu; in an NGC container, which is Ubuntu: "
                 "`apt-get update && apt-get install -y nginx`), or `brew install nginx` (macOS); or point "
                 f"{BINARY_ENV} at an nginx binary")
DEFAULT_STOP_GRACE_S = 2.0


class NginxNotFound(NginxError):
    """No nginx binary here: the message says how to install one."""


class NginxStartError(NginxError):
    """nginx exited or did not answer; the message carries its error log."""


# --- the binary ----------------------------------------------------------------------------------------------


def required() -> bool:
    """True when ``NVLAB_REQUIRE_NGINX`` is 1/true/yes: a missing nginx is an error, not a skipped section."""
    return env_flag(REQUIRE_ENV)


def missing() -> str | None:
    """Why nginx cannot be used here, with the install line; None when it can."""
    return None if find_nginx() is not None else _not_found()


def _not_found() -> str:
    env = os.environ.get(BINARY_ENV, "").strip()
    where = f"${BINARY_ENV}={env}" if env else f"the PATH and {', '.join(NGINX_SEARCH[:2])}"
    if env and env.lower() != "none":
        where += " (expected the path of an executable nginx, or none)"
    return f"nginx not found (looked at {where}). {NGINX_INSTALL}"


def nginx_binary() -> str:
    """The nginx binary; ``NginxNotFound`` (with how to install it) when there is none."""
    return str(resolve(use=True))  # never None: resolve(use=True) raises instead


def resolve(use: bool | None = None, show: bool = True) -> str | None:
    """The nginx binary a lab's service uses, looked up once: None with ``use=False``, or when ``use`` is None and
    nginx is not installed (then as ``available``: the install line shown, or ``NginxNotFound`` under
    ``NVLAB_REQUIRE_NGINX=1``); ``use=True`` and none installed: ``NginxNotFound``."""
    if use is False:
        return None
    if (path := find_nginx()) is not None:
        return str(path)
    if use:
        raise NginxNotFound(_not_found())
    available(show)
    return None


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


def _explain(stderr: str, text: str, spans: dict[str, tuple[int, int]] | None = None, *,
             what: str = "the config") -> NginxConfigError:
    """``nginx -t``'s complaint as a ``NginxConfigError``: its words, the line (of the hand-written block when it is
    there) and the fix."""
    m = _NGINX_MSG.search(stderr)
    problem = m.group(2).strip() if m else (stderr.strip().splitlines() or ["nginx -t failed"])[-1]
    line = int(m.group(4)) if m and m.group(4) else None
    fix = next((how.format(*hit.groups()) for pattern, how in _FIXES if (hit := re.search(pattern, problem))),
               "see https://nginx.org/en/docs/ for the directive named")
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


def _argv(binary: str, prefix: Path, conf: str | os.PathLike[str], *options: str) -> list[str]:
    """``nginx OPTIONS -p PREFIX/ -c CONF -e PREFIX/logs/error.log``: ``-e`` is the log nginx writes before it has read
    the config (else /var/log/nginx, another user's). nginx has ``-e`` from 1.19.5 on (Ubuntu 22.04 ships 1.18: it
    then only warns that it cannot open the default log, as a non-root user)."""
    if binary not in _E_OPTION:
        m = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", nginx_version(binary))
        _E_OPTION[binary] = not m or tuple(map(int, m.groups())) >= (1, 19, 5)
    early_log = ["-e", str(prefix / "logs" / "error.log")] if _E_OPTION[binary] else []
    return [binary, *options, "-p", f"{prefix}/", "-c", str(conf), *early_log]


def _write_conf(prefix: Path, text: str) -> Path:
    """``PREFIX/conf/nginx.conf`` holding ``text``, beside the ``logs`` and ``temp`` folders nginx writes to."""
    for sub in ("conf", "logs", "temp"):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    (conf := prefix / "conf" / "nginx.conf").write_text(text)
    return conf


def _test(binary: str, prefix: Path, conf: Path, spans: dict[str, tuple[int, int]] | None = None,
          what: str = "the config") -> str:
    """``nginx -t`` on ``conf``: its warnings, or the ``NginxConfigError`` of ``_explain``."""
    out = subprocess.run(_argv(binary, prefix, conf, "-t", "-q"), capture_output=True, text=True, timeout=30.0)
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
        return _test(binary, prefix, _write_conf(prefix, text), spans, what)


def check_upstream_block(block: str, binary: str | None = None) -> str:
    """Validate a hand-written HTTP ``upstream NAME { ... }`` block inside the course's config (``nginx -t``): the
    block's name, or ``NginxConfigError`` naming the problem, its line in the block, and the fix."""
    name = upstream_name(block)
    spans: dict[str, tuple[int, int]] = {}
    text = nginx_config(http_port=1, status_port=3, api_keys=(), block_lines=spans, upstream_block=block)
    check_nginx_config(text, binary, spans=spans)
    return name


# --- reload -------------------------------------------------------------------------------------------------


def reload_nginx(prefix: str | os.PathLike[str], conf: str | os.PathLike[str], binary: str | None = None,
                 timeout_s: float = 30.0) -> None:
    """``nginx -s reload -p PREFIX -c CONF``: the master re-reads CONF, starts workers with it, and lets the old
    workers finish their requests before they exit (nothing is dropped). ``NginxError`` with nginx's words when
    the signal could not be sent (no master running with that prefix's pid file)."""
    binary = binary or nginx_binary()
    argv = _argv(binary, Path(prefix), conf, "-s", "reload")
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
        self._context(probe_ports=True)  # a bad argument fails here, before anything starts (rendered at start)

    # config -----------------------------------------------------------------------------------------------
    @property
    def has_grpc(self) -> bool:
        return bool(self.grpc_backends) or self.grpc_upstream_block is not None

    def _context(self, probe_ports: bool = False) -> dict[str, Any]:
        ports = (1, 2, 3) if probe_ports else (self.http_port, self.grpc_port, self.status_port)
        return config_context(self.http_backends, self.grpc_backends, http_port=ports[0],
                              grpc_port=ports[1] if self.has_grpc else None, status_port=ports[2], host=self.host,
                              api_keys=self.api_keys, upstream_block=self.upstream_block,
                              grpc_upstream_block=self.grpc_upstream_block, generation=self.generation,
                              json_check=None if probe_ports or self.json_check is None
                              else self.json_check.address, **self.options)

    def _render(self) -> tuple[str, dict[str, tuple[int, int]]]:
        spans: dict[str, tuple[int, int]] = {}
        return render_config(self._context(), spans), spans

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
        self.config_text, spans = self._render()
        _test(str(self.binary), self.folder, _write_conf(self.folder, self.config_text), spans)
        return {"cwd": str(self.folder)}

    def _cleanup(self) -> None:
        super()._cleanup()
        if self.json_check is not None:
            self.json_check.stop()

    def _command(self) -> list[str]:
        return [*_argv(str(self.binary), self._need_prefix(), self.conf_path), "-g", "daemon off;"]

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
    return NginxServer(upstream_block=upstream_block, grpc_upstream_block=grpc_upstream_block, **kwargs).start()


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
           "nginx_binary", "missing", "available", "resolve", "required", "nginx_version", "nginx_config",
           "config_context", "render_config", "check_nginx_config",
           "check_upstream_block", "serve_upstream", "reload_nginx", "read_access_log", "summarize_access",
           "parse_stub_status", "new_api_key", "as_backend", "upstream_name", "leftover_nginx",
           "API_KEY_HEADER", "REQUIRE_ENV", "HTTP_ROUTES", "GRPC_METHODS"]
