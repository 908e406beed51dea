"""Lab 07's service as one owned object: the digits ensemble on two Triton servers, nginx in front.

Stable API (lab 07 builds on it): ``Service`` (a context manager: the front door ``http_url``, ``grpc_url``,
``headers``, ``target``, ``classify``; behind it ``servers``, ``lb``, ``repo``), ``hot_update``, and one request
each with ``infer`` and ``send_raw``. Units are in names: ``_s``, ``_ms``, ``_rps`` requests per second, ``_mib``.
Design notes: docs/internals.md#lab_utilsservingservicepy
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.args import check_int
from lab_utils.owned import StartStop
from lab_utils.procs import Background, http_ok, owned_tempdir, release_at_exit, stop_at_exit, wait_until
from lab_utils.serving import client as triton_client
from lab_utils.serving import ensemble as ens
from lab_utils.serving import load as load_engine
from lab_utils.serving import nginx as nginx_mod
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.metrics import metric_samples
from lab_utils.serving.server import TritonServer, find_server
from lab_utils.serving.targets import TritonTarget
from lab_utils.timing import Ticks

RATE_LIMIT_RPS = 5000  # per client address: above what the servers can take, so only a flood meets it (a limit
# at the capacity would make every capacity search measure nginx's limit instead of the servers)
RATE_BURST = 1000  # requests of slack: Poisson arrivals come in clumps
BODY_LIMIT = "12m"  # nginx's limit (413): the preprocessing model's own 8 MiB per image sits below it (400), with
# room for the request around it (an 8 MiB image as base64 in a JSON request is 10.7 MiB)
STOP_GRACE_S = 1.0


class ServiceError(RuntimeError):
    """The service could not start; the message says which part and what to do."""


def infer(url: str, model: str, inputs: Mapping[str, np.ndarray], *, protocol: str = "http",
          headers: Mapping[str, str] | None = None, outputs: Sequence[str] | None = None,
          timeout_s: float = 30.0) -> dict[str, np.ndarray]:
    """``client.infer`` with ``headers`` (the API key through nginx) that raises tritonclient's
    ``InferenceServerException`` (``.status()``: "401", "StatusCode.INVALID_ARGUMENT"...)."""
    return triton_client.infer(url, model, inputs, protocol=protocol, headers=headers, outputs=outputs,
                               timeout_s=timeout_s, raw_errors=True)


def send_raw(url: str, body: bytes, headers: Mapping[str, str] | None = None, model: str = ens.SERVICE,
             timeout_s: float = 30.0) -> tuple[int, Any]:
    """POST ``body`` to ``{url}/v2/models/{model}/infer`` as it is (no client library): (HTTP status, the JSON
    answer or its text). For what a well-behaved client never sends: a huge body, a malformed request."""
    req = urllib.request.Request(f"{url}/v2/models/{model}/infer", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, text = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Service(StartStop):
    """The digits service: ``servers`` Triton servers behind nginx (or one Triton alone without nginx).

    ``cache``: where the response cache is (``"classifier"``, ``"service"``: the ensemble, or None);
    ``cache_mib``: its size. ``use_nginx`` None: nginx when it is installed (``NVLAB_REQUIRE_NGINX=1`` makes a
    missing one an error). ``api_key`` None: a random one. The nginx limits: ``rate_limit_rps`` (+ ``rate_burst``)
    per client address, ``client_max_body_size``. ``repo``: an already built ``ServiceRepo`` to serve instead.
    """

    def __init__(self, *, servers: int = 2, cache: str | None = "classifier", cache_mib: int = ens.CACHE_MIB,
                 epochs: int = 4, seed: int = 0, use_nginx: bool | None = None, api_key: str | None = None,
                 rate_limit_rps: float | None = RATE_LIMIT_RPS, rate_burst: int = RATE_BURST,
                 client_max_body_size: int | str = BODY_LIMIT, instances: int | None = None, gpus: int = 0,
                 repo: ens.ServiceRepo | None = None, startup_timeout_s: float = 120.0,
                 stop_grace_s: float = STOP_GRACE_S, build_env: bool = True):
        check_int(servers, "servers", "Service", what="the number of Triton servers")
        if cache not in ens.CACHE_PLACES:
            raise ValueError(f"Service(cache={cache!r}): use one of {ens.CACHE_PLACES}")
        self.cache, self.cache_mib = cache, cache_mib
        self.epochs, self.seed, self.instances, self.gpus = epochs, seed, instances, gpus
        self.want_servers = servers
        self.use_nginx = use_nginx
        self.nginx_kwargs = {"api_keys": api_key, "rate_limit_rps": rate_limit_rps, "rate_burst": rate_burst,
                             "client_max_body_size": client_max_body_size}
        nginx_mod.config_context(["127.0.0.1:1"], ["127.0.0.1:2"], http_port=3, grpc_port=4, status_port=5,
                                 **{**self.nginx_kwargs, "api_keys": api_key or ()})  # a bad limit fails here
        self.startup_timeout_s, self.stop_grace_s, self.build_env = startup_timeout_s, stop_grace_s, build_env
        self.repo: ens.ServiceRepo | None = repo
        self.workdir: Path | None = None  # where the repository is built: only when none is given
        self.servers: list[TritonServer] = []
        self.lb: nginx_mod.NginxServer | None = None
        self.skipped: list[str] = []
        self._owned: list[Any] = []
        self._lock = threading.RLock()
        self.startup_s: dict[str, float] = {}

    # lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> Service:
        """Build, start and wait for every part; on any failure stop what was started and raise with its log."""
        with self._lock:
            if self.servers and all(s.alive() and not s.crashed() for s in self.servers):
                return self
            stop_at_exit(self)
            try:
                # nginx, the server binary and the repository are each found (and checked) once per start
                binary = nginx_mod.resolve(self.use_nginx)  # NginxNotFound with the install line, before anything
                with_nginx = binary is not None
                source = find_server(local=True)
                if self.repo is not None:  # given: checked here; built below: build_service checked it
                    triton_repo.validate_repository(self.repo.path, models=[self.repo.service])  # what it loads
                else:
                    self.workdir = owned_tempdir("service")
                    t0 = time.perf_counter()
                    self.repo = ens.build_service_repository(
                        self.workdir / "repo", epochs=self.epochs, seed=self.seed, gpus=self.gpus,
                        instances=self.instances, cache=self.cache, source=source, build_env=self.build_env)
                    self.startup_s["build"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                for _ in range(self.want_servers if with_nginx else 1):
                    s = TritonServer(self.repo.path, startup_timeout_s=self.startup_timeout_s,
                                     stop_grace_s=self.stop_grace_s, source=source, validate=False,
                                     **self.repo.server_kwargs(self.cache_mib if self.cache else None))
                    self.servers.append(s)
                    s.start()
                self.startup_s["triton"] = time.perf_counter() - t0
                if with_nginx:
                    self.lb = nginx_mod.NginxServer([s.http_url for s in self.servers],
                                                    [s.grpc_url for s in self.servers], binary=binary,
                                                    **self.nginx_kwargs)
                    self.lb.start()
                    self.startup_s["nginx"] = self.lb.startup_s or 0.0
                else:
                    self.skipped = [
                        f"load balancing over {self.want_servers} Triton servers (one server serves directly)",
                        "the API key (401), nginx's body limit (413) and rate limit (429)",
                        "nginx's JSON access log and its metrics"]
            except BaseException:
                self.stop()
                raise
            return self

    def own(self, obj: Any) -> Any:
        """Stop ``obj`` (anything with ``stop()``: the monitoring) with the service, before the servers."""
        with self._lock:
            self._owned.append(obj)
        return obj

    def stop(self) -> None:
        """Stop the monitoring handed to ``own``, nginx, the Triton servers, and remove the built repository.
        Safe to call twice."""
        with self._lock:
            for obj in reversed(self._owned):
                try:
                    obj.stop()
                except Exception as err:  # one part failing to stop must not leave the others running
                    print(f"stopping {obj!r} failed: {err}")
            self._owned.clear()
            if self.lb is not None:
                self.lb.stop()
            for s in reversed(self.servers):
                s.stop()
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
            release_at_exit(self)

    def alive(self) -> bool:
        """Every part still runs."""
        return bool(self.servers) and all(s.alive() for s in self.servers) and (self.lb is None or self.lb.alive())

    def __repr__(self) -> str:
        state = "running" if self.alive() else "stopped"
        return f"Service({state}, {len(self.servers)} Triton, via {self.via}, front door {self.http_url})"

    # the front door -------------------------------------------------------------------------------------------
    @property
    def via(self) -> str:
        return "nginx" if self.lb is not None else "triton"

    @property
    def http_url(self) -> str:
        return self.url("http")

    @property
    def grpc_url(self) -> str:
        return self.url("grpc")

    def url(self, protocol: str = "http") -> str:
        """The front door's ``protocol`` URL: nginx's, else the one Triton server's ('' before start)."""
        front = self.lb if self.lb is not None else (self.servers[0] if self.servers else None)
        return "" if front is None else front.grpc_url if protocol == "grpc" else front.http_url

    @property
    def headers(self) -> dict[str, str]:
        """The API key header (empty without nginx)."""
        return self.lb.auth_headers if self.lb is not None else {}

    @property
    def model(self) -> str:
        return self.repo.service if self.repo else ens.SERVICE

    def target(self, protocol: str = "http", pngs: Sequence[bytes] | None = None, *, verify: bool = False,
               headers: Mapping[str, str] | None = None) -> TritonTarget:
        """An open-loop target: one PNG a request through the front door, cycling over ``pngs`` (default: all
        1,797 digits, held-out ones first: at 100 QPS an image comes back after 18 s, so the cache helps only
        then). ``verify``: a request whose top label is not a digit counts as failed."""
        payloads = [{ens.IMAGE: ens.image_batch([p])} for p in (all_pngs() if pngs is None else pngs)]
        target = TritonTarget(self.url(protocol), self.model, payloads[0], protocol=protocol,
                              headers=self.headers if headers is None else headers,
                              outputs=[ens.LABELS, ens.SCORES], verify=_verify_digit if verify else None)
        target.payloads = payloads  # every image, in order (the target cycles over its payloads)
        return target

    def classify(self, pngs: Sequence[bytes], protocol: str = "http") -> tuple[list[list[str]], np.ndarray]:
        """Top-k labels and scores of ``pngs`` (one request) through the front door."""
        return ens.classify(self.url(protocol), pngs, protocol=protocol, model=self.model, headers=self.headers)

    def accuracy(self, protocol: str = "http", n: int | None = None, batch_size: int = 16) -> dict[str, Any]:
        """Top-1 accuracy on the held-out digits sent through the whole service (front door included)."""
        return {**ens.service_accuracy(self.url(protocol), protocol=protocol, n=n, batch_size=batch_size,
                                       model=self.model, headers=self.headers), "via": self.via}

    # behind it ------------------------------------------------------------------------------------------------
    def scrape_jobs(self) -> dict[str, list[str]]:
        """``{"triton": [host:port of each server's metrics]}`` for Prometheus."""
        return {"triton": [s.metrics_url.split("//", 1)[1].split("/", 1)[0] for s in self.servers]}

    def backends(self, protocol: str = "http") -> list[str]:
        """``host:port`` of each Triton server's HTTP (or gRPC) endpoint: what nginx's upstream lists."""
        return [triton_client.host_port(s.http_url if protocol == "http" else s.grpc_url) for s in self.servers]

    def health(self) -> dict[str, Any]:
        """Each part's state now: Triton ready, nginx answering, the service model ready through the front door."""
        out: dict[str, Any] = {f"triton_{i}_ready": s.alive() and s.ready() for i, s in enumerate(self.servers)}
        if self.lb is not None:
            out["nginx_alive"] = self.lb.alive()
            out["nginx_status_ok"] = http_ok(self.lb.status_url)[0]
        req = urllib.request.Request(f"{self.http_url}/v2/models/{self.model}/ready", headers=self.headers)
        out["service_ready"] = False
        for _ in range(5):  # a moment after a reload or a burst: ask again before saying no
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    out["service_ready"] = r.status == 200
                    break
            except urllib.error.HTTPError as err:
                out["service_status"] = err.code  # why not: 429 (rate limit), 401, 502...
            except OSError as err:
                out["service_status"] = str(err)
            time.sleep(0.2)
        return out


_ALL: list[bytes] = []


def all_pngs() -> list[bytes]:
    """Every digit as a 32 px PNG: the 357 held-out ones, then the 1,440 training ones (made once)."""
    if not _ALL:
        _ALL.extend(ens.digits_pngs("test")[0] + ens.digits_pngs("train")[0])
    return list(_ALL)


# --- the hot update ------------------------------------------------------------------------------------------


def version_counts(servers: Sequence[Any], model: str = ens.CLASSIFIER) -> dict[str, float]:
    """``{version: successful requests}`` of ``model`` summed over ``servers`` (Triton's counters now; a cache hit
    counts as a success of the version that cached it)."""
    out: dict[str, float] = {}
    for s in servers:
        try:
            samples = metric_samples(s.metrics_url, timeout_s=2.0)
        except OSError:
            continue
        for labels, value in samples:
            if labels.get("__name__") == "nv_inference_request_success" and labels.get("model") == model:
                out[labels.get("version", "?")] = out.get(labels.get("version", "?"), 0.0) + value
    return out


@dataclass
class HotUpdate:
    """A hot update under open-loop load: the load's ``result`` (``errors_total`` is what the clients saw fail),
    the ``timeline`` (per ``sample_s``: requests/s per classifier version) and the ``steps`` taken (t_s, what)."""

    result: Any
    timeline: pd.DataFrame
    steps: list[dict[str, Any]]
    states: dict[str, str]

    def switch_p95_ms(self) -> float:
        """The worst window p95 (ms) from one second before the first step to one second after the last."""
        if not self.steps or not self.result.windows:
            return float("nan")
        a, b = self.steps[0]["t_s"] - 1, self.steps[-1]["t_s"] + 1
        warmup = float(self.timeline.attrs.get("warmup_s", 0.0))
        ps = [w.p95_ms for w in self.result.windows
              if a <= warmup + (w.index + 1) * w.seconds and warmup + w.index * w.seconds <= b
              and np.isfinite(w.p95_ms)]
        return float(max(ps)) if ps else float("nan")


def hot_update(svc: Service, new_version: int = 2, *, rate_rps: float = 100.0, duration_s: float = 20.0,
               warmup_s: float = 1.0, protocol: str = "grpc", sample_s: float = 0.5, pause_s: float = 1.5,
               timeout_s: float = 10.0, progress: Any = None) -> HotUpdate:
    """Move the service to classifier version ``new_version`` (already written: ``write_classifier_version``) under
    open-loop load through the front door, ``pause_s`` between steps so each shows in the timeline.

    Behind nginx: the last server loads it beside the old one, weights 3:1 towards it, the others drained, load it,
    weights equal again; then every server unloads the old version (one server: load beside, unload the old).
    gRPC by default: a reload's retired workers close idle connections, which HTTP/2 announces (GOAWAY) while an
    HTTP/1.1 keep-alive request meets a reset (measured: 1 in 2,553 over four reloads). ``progress``: a hook such
    as ``lab_utils.widgets.progress``, advanced once per step (None: no display)."""
    repo = svc.repo
    if repo is None or not svc.alive():
        raise ServiceError("the service is not running: start() it first")
    vdir = repo.path / repo.classifier / str(new_version)
    if not (vdir / "model.onnx").is_file():
        raise FileNotFoundError(f"{vdir}/model.onnx does not exist: write version {new_version} first "
                                f"(ensemble.write_classifier_version(service.repo.path, {new_version}))")
    old = sorted(int(v) for v, st in ens.version_states(svc.servers[0].grpc_url, repo.classifier).items()
                 if st == "READY")
    steps: list[dict[str, Any]] = []
    samples: list[dict[str, float]] = []
    t0 = time.perf_counter()
    stop = threading.Event()

    # the steps are events, not a loop (closed once the load has ended)
    ticks = Ticks(progress, 5 if svc.lb is not None and len(svc.servers) > 1 else 2, "hot update")

    def step(what: str) -> None:
        steps.append({"t_s": time.perf_counter() - t0, "step": what})
        ticks.step()

    def sampler() -> None:
        while not stop.is_set():
            samples.append({"t_s": time.perf_counter() - t0, **version_counts(svc.servers, repo.classifier)})
            stop.wait(sample_s)

    th_samp = threading.Thread(target=sampler, name="nvlab-hot-update-sampler", daemon=True)
    th_samp.start()
    load = Background(lambda: load_engine.run_open_loop(svc.target(protocol), rate_rps, duration_s,
                                                        warmup_s=warmup_s, timeout_s=timeout_s),
                      name="nvlab-hot-update-load")
    try:
        stop.wait(warmup_s + pause_s)
        ens.set_served_versions(repo.path, [*old, new_version], name=repo.classifier)
        first, rest = svc.servers[-1], svc.servers[:-1]
        triton_client.load_model(first.grpc_url, repo.classifier)
        step(f"server {len(svc.servers) - 1}: v{new_version} loaded beside v{','.join(map(str, old))}")
        if svc.lb is not None and rest:
            addr = triton_client.host_port
            stop.wait(pause_s)
            svc.lb.set_weights(http={addr(first.http_url): 3, **{addr(s.http_url): 1 for s in rest}},
                               grpc={addr(first.grpc_url): 3, **{addr(s.grpc_url): 1 for s in rest}})
            step("nginx weights 3:1 towards the new version")
            stop.wait(pause_s)
            svc.lb.set_weights(http={addr(s.http_url): 0 for s in rest}, grpc={addr(s.grpc_url): 0 for s in rest})
            step("nginx: the old version's servers drained (down)")
            for s in rest:
                triton_client.load_model(s.grpc_url, repo.classifier)
            step(f"the other servers: v{new_version} loaded")
            stop.wait(pause_s)
            svc.lb.set_weights(http={addr(s.http_url): 1 for s in svc.servers},
                               grpc={addr(s.grpc_url): 1 for s in svc.servers})
            step("nginx weights equal again")
        stop.wait(pause_s)
        ens.set_served_versions(repo.path, [new_version], name=repo.classifier)
        for s in svc.servers:
            triton_client.load_model(s.grpc_url, repo.classifier)
        wait_until(lambda: not any(  # load_model returns while the old version still unloads
            st.startswith(("UNLOADING", "LOADING")) for s in svc.servers
            for st in ens.version_states(s.grpc_url, repo.classifier).values()), 30, 0.1)
        step(f"v{','.join(map(str, old))} unloaded: v{new_version} alone")
    finally:
        load.thread.join()
        stop.set()
        th_samp.join(timeout=5)
        ticks.close()
    result = load.get()
    frame = pd.DataFrame(samples).fillna(0.0)
    rates = frame.drop(columns="t_s").diff().div(frame["t_s"].diff(), axis=0).clip(lower=0)
    timeline = pd.concat([frame[["t_s"]], rates.add_prefix("v").add_suffix("_rps")], axis=1).iloc[1:]
    timeline.attrs["warmup_s"] = warmup_s
    return HotUpdate(result, timeline.reset_index(drop=True), steps,
                     ens.version_states(svc.servers[0].grpc_url, repo.classifier))


# --- the compose stack's nginx -------------------------------------------------------------------------------

COMPOSE_KEY_PLACEHOLDER = "NVLAB_API_KEY_FROM_ENVIRONMENT"  # replaced by $NVLAB_API_KEY when the container starts
COMPOSE_PORTS = {"http": 8080, "grpc": 8081, "status": 8082}
EXAMPLE_KEY = "EXAMPLE-KEY-made-at-each-start"  # a Service makes a random key at every start
EXAMPLE_PORTS = {"http": 8080, "grpc": 8081, "status": 8082, "json_check": 8083}  # a Service takes free ports
# the nginx limits a Service sets by default, as the rendered configs show them
_LIMITS = {"client_max_body_size": BODY_LIMIT, "rate_limit_rps": RATE_LIMIT_RPS, "rate_burst": RATE_BURST}


def _as_file(text: str, path: str, function: str, *how: str) -> str:
    """A rendered config as its committed file: a header naming where it comes from, no ``user`` line (that is
    the account nginx runs as, which depends on who renders it)."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("user ")]
    head = [f"# {path}, generated by lab_utils.serving.service.{function}: do not edit (python "
            "scripts/render_nginx.py).", *(f"# {h}" for h in how)]
    return "\n".join(head + lines[2:]) + "\n"


def compose_nginx_config() -> str:
    """``docker/nginx/nginx.conf``: the lab's nginx config (``nginx.nginx_config``, the same limits as ``Service``) in
    front of the compose stack's Triton (``triton:8000`` HTTP, ``triton:8001`` gRPC), listening on all interfaces
    of its container; the API key is a placeholder that the container's command replaces with ``$NVLAB_API_KEY``."""
    text = nginx_mod.nginx_config(["triton:8000"], ["triton:8001"], http_port=COMPOSE_PORTS["http"],
                                  grpc_port=COMPOSE_PORTS["grpc"], status_port=COMPOSE_PORTS["status"],
                                  host="0.0.0.0", api_keys=[COMPOSE_KEY_PLACEHOLDER], **_LIMITS)
    return _as_file(text, "docker/nginx/nginx.conf", "compose_nginx_config",
                    "docker/compose.yaml's nginx service runs it as nginx -p /tmp/nginx/ -c conf/nginx.conf "
                    "-g 'daemon off;'", "(relative paths below are relative to that prefix).")


def service_nginx_config() -> str:
    """``docs/nginx/service.conf``: the config lab 07's ``Service`` renders for its nginx in front of two Triton
    servers, for reading: example ports (a service takes free ones), an example key (it makes a random one)."""
    text = nginx_mod.nginx_config(["127.0.0.1:8000", "127.0.0.1:8010"], ["127.0.0.1:8001", "127.0.0.1:8011"],
                                  http_port=EXAMPLE_PORTS["http"], grpc_port=EXAMPLE_PORTS["grpc"],
                                  status_port=EXAMPLE_PORTS["status"], api_keys=[EXAMPLE_KEY], **_LIMITS,
                                  json_check=f"127.0.0.1:{EXAMPLE_PORTS['json_check']}")
    return _as_file(text, "docs/nginx/service.conf", "service_nginx_config",
                    "Lab 07's nginx: NginxServer runs it as nginx -p PREFIX -c conf/nginx.conf -g 'daemon off;'",
                    "(relative paths below are relative to PREFIX; its ports and key are examples).")


RENDERED_CONFIGS = {"docker/nginx/nginx.conf": compose_nginx_config, "docs/nginx/service.conf": service_nginx_config}


def _verify_digit(inputs: Any, outputs: Mapping[str, np.ndarray]) -> None:
    top = outputs[ens.LABELS][0][0]
    top = top.decode() if isinstance(top, bytes) else str(top)
    if top not in ens.DIGIT_LABELS:
        raise ValueError(f"top label {top!r} is not a digit")


__all__ = ["Service", "ServiceError", "HotUpdate", "hot_update", "version_counts", "infer", "send_raw", "all_pngs",
           "RATE_LIMIT_RPS", "RATE_BURST", "BODY_LIMIT", "compose_nginx_config", "service_nginx_config",
           "RENDERED_CONFIGS", "COMPOSE_KEY_PLACEHOLDER", "COMPOSE_PORTS"]
