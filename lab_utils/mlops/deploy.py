"""Lab 08's release machinery on lab 07's service: a champion and a challenger, each on its own Triton server behind the
one nginx front door, the challenger's share set by nginx's weights; labelled traffic counted per variant.

``CanaryService(champion_onnx, challenger_onnx=None, gpus=0, drift_reference=None)`` is a ``Service`` with
``set_weight(w)``, ``deploy_challenger(onnx)``, ``promote()`` and ``scrape_jobs()``. ``LabelledTraffic(svc, feedback,
images, labels, rate_rps)`` sends labelled digits through the front door. ``install_onnx(repo, onnx, version)`` adds a
classifier version from a registry's ONNX file. Units: weights in % of requests, rates in requests/s, times in s.

Design notes: docs/internals.md#lab_utilsmlopsdeploypy"""

from __future__ import annotations

import math
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from lab_utils.args import check_int, check_positive
from lab_utils.mlops.tracking import ONNX_FILE
from lab_utils.owned import StartStop
from lab_utils.procs import owned_tempdir, stop_at_exit
from lab_utils.serving import client as triton_client
from lab_utils.serving import ensemble as ens
from lab_utils.serving import load
from lab_utils.serving import nginx as nginx_mod
from lab_utils.serving.server import TritonServer, find_server
from lab_utils.serving.service import Service, ServiceError

VARIANTS = ("champion", "challenger")


def install_onnx(repo: Any, onnx: str | Path, version: int) -> Path:
    """Copy ``onnx`` (and the files beside it that share its name, e.g. ``model.onnx.data``, and ``model.pt``, the
    TorchScript a GPU instance serves) into the repository's classifier as ``version``; the python backend's files
    come along from version 1. Returns the version folder."""
    src = Path(onnx)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no ONNX file there (download it from the registry first: "
                                "tracking.download_onnx(server, alias='challenger', dst=folder))")
    model_dir = Path(repo.path) / repo.classifier
    vdir = model_dir / str(version)
    vdir.mkdir(parents=True, exist_ok=True)
    if src.name == ONNX_FILE:  # the registry's: model.onnx and its external data (model.onnx.data) if any
        for f in src.parent.glob(f"{src.name}*"):
            shutil.copy2(f, vdir / f.name)
        if (src.parent / ens.TORCH_FILE).is_file():  # TorchScript: what the torch engine (a GPU instance) serves
            shutil.copy2(src.parent / ens.TORCH_FILE, vdir / ens.TORCH_FILE)
        elif (vdir / ens.TORCH_FILE).exists():  # never serve a stale TorchScript beside a new ONNX file
            (vdir / ens.TORCH_FILE).unlink()
    else:  # weights inside the file: the graph names no external file to follow
        shutil.copy2(src, vdir / ONNX_FILE)
    first = model_dir / "1"
    if vdir != first:
        for f in first.glob("*.py"):  # the python backend's model.py and the course's model file
            shutil.copy2(f, vdir / f.name)
    return vdir


def _skeleton(folder: Path, gpus: int, instances: int | None, source: Any, build_env: bool,
              drift_reference: Any = None, drift_window: int = 200) -> ens.ServiceRepo:
    """The digits service's repository around an untrained DigitsCNN: its classifier is replaced by ``install_onnx``
    (the served model is the registry's file, byte for byte)."""
    import torch

    from lab_utils.models import DigitsCNN  # lazy: pulls torch

    torch.manual_seed(0)
    return ens.build_service_repository(folder, model=DigitsCNN().eval(), gpus=gpus, instances=instances, cache=None,
                                        source=source, build_env=build_env, drift_reference=drift_reference,
                                        drift_window=drift_window, note="lab 08: classifier from the registry")


class CanaryService(Service):
    """Champion and challenger behind one nginx: server 0 serves the champion's classifier, server 1 the
    challenger's (or the champion's until one is deployed). Weight 0 % at the start: the challenger takes no
    traffic until ``set_weight``."""

    def __init__(self, champion_onnx: str | Path, challenger_onnx: str | Path | None = None, *, gpus: int = 0,
                 instances: int | None = None, api_key: str | None = None, startup_timeout_s: float = 120.0,
                 stop_grace_s: float = 1.0, build_env: bool = True, drift_reference: Any = None,
                 drift_window: int = 200):
        super().__init__(servers=2, cache=None, gpus=gpus, instances=instances, api_key=api_key, use_nginx=True,
                         startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s, build_env=build_env)
        self.champion_onnx = Path(champion_onnx)
        self.challenger_onnx = Path(challenger_onnx) if challenger_onnx else None
        for p in (self.champion_onnx, self.challenger_onnx):
            if p is not None and not p.is_file():
                raise FileNotFoundError(f"{p}: no ONNX file there (tracking.download_onnx gives the registry's)")
        # reference_bins of the training images: the preprocessing step exports its drift statistics (PSI)
        self.drift_reference, self.drift_window = drift_reference, drift_window
        self.repos: dict[str, ens.ServiceRepo] = {}
        self.versions = {v: 1 for v in VARIANTS}  # the classifier version each server serves
        self.weight = 0
        self.weights: list[tuple[float, int]] = []  # (time, challenger %) of every change

    def start(self) -> CanaryService:
        with self._lock:
            if self.servers and self.alive():
                return self
            stop_at_exit(self)
            try:
                binary = nginx_mod.nginx_binary()  # the canary lives in nginx's weights: no nginx, no canary
                source = find_server(local=True)
                self.workdir = owned_tempdir("canary")
                t0 = time.perf_counter()
                champ = _skeleton(self.workdir / "champion", self.gpus, self.instances, source, self.build_env,
                                  self.drift_reference, self.drift_window)
                install_onnx(champ, self.champion_onnx, 1)
                shutil.copytree(champ.path, self.workdir / "challenger", symlinks=True)
                chall = replace(champ, path=self.workdir / "challenger")
                install_onnx(chall, self.challenger_onnx or self.champion_onnx, 1)
                self.repos = {"champion": champ, "challenger": chall}
                self.repo = champ
                self.startup_s["build"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                for variant in VARIANTS:
                    repo = self.repos[variant]
                    s = TritonServer(repo.path, startup_timeout_s=self.startup_timeout_s,
                                     stop_grace_s=self.stop_grace_s, source=source, **repo.server_kwargs(None))
                    self.servers.append(s)
                    s.start()
                self.startup_s["triton"] = time.perf_counter() - t0
                # one server per variant, in VARIANTS' order; the challenger's is down until set_weight
                http, grpc = ([nginx_mod.Backend(b, down=v == "challenger")
                               for v, b in zip(VARIANTS, self.backends(p), strict=True)] for p in ("http", "grpc"))
                self.lb = nginx_mod.NginxServer(http, grpc, binary=binary, **self.nginx_kwargs)
                self.lb.start()
                self.startup_s["nginx"] = self.lb.startup_s or 0.0
                self.weights.append((time.time(), 0))
            except BaseException:
                self.stop()
                raise
            return self

    # who is who ------------------------------------------------------------------------------------------------
    def server(self, variant: str) -> TritonServer:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: one of {VARIANTS}")
        if len(self.servers) != 2:
            raise ServiceError("the canary service is not running: start() it first")
        return self.servers[VARIANTS.index(variant)]

    def variant_of(self, upstream: str) -> str | None:
        """The variant whose server is ``upstream`` (``host:port`` as nginx reports it), else None."""
        for v in VARIANTS:
            s = self.server(v)
            if upstream in (triton_client.host_port(s.http_url), triton_client.host_port(s.grpc_url)):
                return v
        return None

    def scrape_jobs(self) -> dict[str, list[str]]:
        """``{"champion": [metrics host:port], "challenger": [...]}``: the job label names the variant."""
        return {v: [self.server(v).metrics_url.split("//", 1)[1].split("/", 1)[0]] for v in VARIANTS}

    # moving traffic -----------------------------------------------------------------------------------------
    def set_weight(self, weight: int) -> None:
        """The challenger's share of requests, in % (0..100), applied by an nginx reload."""
        w = check_int(weight, "weight", "set_weight", 0, 100, what="the challenger's share, in %")
        g = math.gcd(100 - w, w) or 1
        shares = ((100 - w) // g, w // g)  # champion, challenger: 90/10 -> 9:1; 0 marks a server down
        if self.lb is None:
            raise ServiceError("the canary service is not running: start() it first")
        self.lb.set_weights(**{p: dict(zip(self.backends(p), shares, strict=True)) for p in ("http", "grpc")})
        self.weight = w
        self.weights.append((time.time(), w))

    def _load_version(self, variant: str, onnx: str | Path) -> int:
        repo, server = self.repos[variant], self.server(variant)
        version = self.versions[variant] + 1
        install_onnx(repo, onnx, version)
        ens.set_served_versions(repo.path, [version], name=repo.classifier)
        triton_client.load_model(server.grpc_url, repo.classifier)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = ens.version_states(server.grpc_url, repo.classifier)
            others = [st for v, st in states.items()
                      if v != str(version) and st.startswith(("READY", "LOAD", "UNLOAD"))]
            if states.get(str(version)) == "READY" and not others:
                break
            time.sleep(0.1)
        else:
            raise ServiceError(f"{variant}: classifier version {version} not alone READY after 60 s: {states}")
        # no warm-up requests here: the classifier's model_warmup ran every batch size at load, outside the request
        # metrics (requests sent now would enter the p95 the canary judges the challenger by)
        self.versions[variant] = version
        return version

    def deploy_challenger(self, onnx: str | Path) -> int:
        """Serve ``onnx`` on the challenger's server (as its next classifier version); the weight must be 0."""
        if self.weight != 0:
            raise ServiceError(f"the challenger takes {self.weight} % of the traffic: roll it back or promote it "
                               "(set_weight(0) / promote()) before deploying another")
        self.challenger_onnx = Path(onnx)
        version = self._load_version("challenger", onnx)
        # Triton's latency summary (the canary's p95) holds the last 60 s of requests, whatever the PromQL window,
        # and a new ensemble version still reports under the old one (both measured on Triton 2.51): without this
        # reload the new challenger's first checks read its predecessor's latencies, taken at 50 and 100 % of the
        # traffic. Unloading drops a model's metrics; the reload starts them from zero (no traffic at 0 %)
        server, service = self.server("challenger"), self.repos["challenger"].service
        triton_client.unload_model(server.grpc_url, service)
        triton_client.load_model(server.grpc_url, service)
        return version

    def promote(self) -> int:
        """After a canary reached 100 %: the champion's server takes the challenger's classifier, then all traffic
        goes back to it (weight 0). Returns the champion server's new classifier version."""
        if self.weight != 100 or self.challenger_onnx is None:
            raise ServiceError(f"promote() follows a canary at 100 %; the challenger is at {self.weight} %")
        version = self._load_version("champion", self.challenger_onnx)
        self.champion_onnx = self.challenger_onnx
        self.set_weight(0)
        return version


# --- labelled traffic ------------------------------------------------------------------------------------------


def _request(pngs: Sequence[bytes]) -> tuple[bytes, int]:
    """A binary-tensor HTTP request body for the service (Triton's binary data extension): (body, JSON length)."""
    import tritonclient.http as th

    x = ens.image_batch(pngs)
    inp = th.InferInput(ens.IMAGE, list(x.shape), "BYTES")
    inp.set_data_from_numpy(x, binary_data=True)
    outs = [th.InferRequestedOutput(ens.LABELS, binary_data=True),
            th.InferRequestedOutput(ens.SCORES, binary_data=True)]
    body, json_size = th.InferenceServerClient.generate_request_body([inp], outputs=outs)
    return body, int(json_size or 0)


class _InThread(StartStop):
    """``_run`` in a daemon thread from ``start()`` until ``stop()`` (also at interpreter exit); a context manager."""

    thread_name = ""
    _thread: threading.Thread | None = None

    def __init__(self, join_s: float) -> None:
        self._stop = threading.Event()
        self.join_s = join_s  # how long stop() waits for the thread to end (s)

    def start(self: Any) -> Any:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()
            stop_at_exit(self)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.join_s)
            self._thread = None


class LabelledTraffic(_InThread):
    """Labelled digits through the front door at ``rate_rps`` (HTTP, one image a request), each answer counted for
    the variant that gave it (``feedback.record``) and seen by ``monitor`` (image, top-1 confidence)."""

    thread_name = "nvlab-labelled-traffic"

    def __init__(self, svc: CanaryService, feedback: Any, images: np.ndarray, labels: np.ndarray, *,
                 rate_rps: float = 20.0, monitor: Any = None, timeout_s: float = 10.0):
        self.svc, self.feedback, self.monitor = svc, feedback, monitor
        self.rate_rps = check_positive(rate_rps, "rate_rps", "LabelledTraffic", what="rate (labelled requests/s)")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        super().__init__(timeout_s + 5)  # a request in flight ends within timeout_s
        self.sent = self.errors = self.unattributed = 0
        self.set_stream(images, labels)

    def set_stream(self, images: np.ndarray, labels: np.ndarray) -> None:
        """Send these raw digits (N, 8, 8), values 0..16, with their labels from now on."""
        x, y = np.asarray(images, np.float32), np.asarray(labels)
        if x.ndim != 3 or x.shape[1:] != (8, 8) or len(x) != len(y) or not len(x):
            raise ValueError(f"images (N, 8, 8) with N labels; got {x.shape} and {y.shape}")
        pngs = [ens.encode_png(img) for img in x]
        with self._lock:
            self._stream = (x, y, [_request([p]) for p in pngs])
            self._i = 0

    def _one(self, x: np.ndarray, y: Any, body: bytes, json_size: int) -> None:
        import tritonclient.http as th

        url = f"{self.svc.http_url}/v2/models/{self.svc.model}/infer"
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(json_size),
                   **self.svc.headers}
        req = urllib.request.Request(url, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                upstream = r.headers.get(nginx_mod.UPSTREAM_HEADER, "")
                length = r.headers.get("Inference-Header-Content-Length")
                res = th.InferenceServerClient.parse_response_body(
                    r.read(), header_length=int(length) if length else None)
        except (urllib.error.URLError, OSError, ValueError):
            with self._lock:
                self.errors += 1
            return
        labels, scores = res.as_numpy(ens.LABELS), res.as_numpy(ens.SCORES)
        top = labels[0][0]
        predicted = top.decode() if isinstance(top, bytes) else str(top)
        # with a retry nginx lists every server it tried ("a:1, b:2"): the last one answered
        variant = self.svc.variant_of(upstream.split(",")[-1].strip())
        with self._lock:
            self.sent += 1
            if variant is None:
                self.unattributed += 1
        if variant is not None:
            self.feedback.record(variant, predicted, int(y))
        if self.monitor is not None:
            self.monitor.observe(x[None], [float(scores[0][0])])

    def _run(self) -> None:
        period = 1.0 / self.rate_rps
        nxt = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                x, y, reqs = self._stream
                i = self._i % len(y)
                self._i += 1
            self._one(x[i], y[i], *reqs[i])
            nxt += period
            if (delay := nxt - time.monotonic()) > 0:
                self._stop.wait(delay)
            else:
                nxt = time.monotonic()  # behind: do not burst to catch up


class BackgroundLoad(_InThread):
    """Lab 07's open-loop load in a thread, in segments of ``segment_s`` until ``stop()``: the canary runs under
    it. ``set_target`` switches what the next segment sends (the drift). ``results``: one ``LoadResult`` per
    segment; ``errors`` and ``sent`` sum them."""

    thread_name = "nvlab-background-load"

    def __init__(self, target: Any, rate_rps: float, *, segment_s: float = 5.0, timeout_s: float = 10.0):
        rate_rps = check_positive(rate_rps, "rate_rps", "BackgroundLoad", what="rate (requests/s)")
        self.target, self.rate_rps, self.segment_s, self.timeout_s = target, rate_rps, segment_s, timeout_s
        self.results: list[Any] = []
        self.failure: BaseException | None = None
        super().__init__(segment_s + timeout_s + 10)  # the running segment ends, every request answered

    def set_target(self, target: Any) -> None:
        self.target = target

    @property
    def errors(self) -> int:
        return sum(r.errors_total for r in self.results)

    @property
    def sent(self) -> int:
        return sum(r.sent_total for r in self.results)

    def _run(self) -> None:
        seed = 0
        while not self._stop.is_set():
            try:
                self.results.append(load.run_open_loop(self.target, self.rate_rps, self.segment_s, warmup_s=0.0,
                                                       window_s=min(1.0, self.segment_s), seed=seed,
                                                       timeout_s=self.timeout_s))
            except BaseException as err:  # shown by stop(), not lost in a thread
                self.failure = err
                return
            seed += 1

    def stop(self) -> None:
        """Let the running segment finish (every request answered), then stop; re-raise a failure of the load."""
        super().stop()
        if self.failure is not None:
            err, self.failure = self.failure, None
            raise err

    def __str__(self) -> str:
        p95 = max((r.p95_ms for r in self.results if np.isfinite(r.p95_ms)), default=float("nan"))
        return (f"open-loop load at {self.rate_rps:g} req/s: {self.sent} sent in {len(self.results)} segments of "
                f"{self.segment_s:g} s, {self.errors} failed, worst segment p95 {p95:.1f} ms")
