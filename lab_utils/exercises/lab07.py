"""Lab 07 exercises: the service's code and configuration, checked against the running service.

``use_service(service)`` tells the checks which service (``lab_utils.serving.service.Service``) to use. q1 the
ensemble's ``config.pbtxt`` (a dict or pbtxt text); q2 the preprocessing step, ``preprocess(items) -> [N, 1, 8,
8] float32``; q3 nginx's upstream block over the two Triton servers; q4 the capacity search,
``find_capacity(probe, lo_rps, hi_rps, slo_ms, tolerance) -> float``; q5 the GPU decode step,
``gpu_preprocess(items, decode_jpeg, device) -> torch.Tensor [N, 3, 64, 64]``; q6 the capacity plan,
``servers_needed(peak_rps, capacity_rps, headroom, spares) -> int``. Rates are in requests/s, latencies in ms.
Nothing is imported or started at import.

Design notes: docs/internals.md#lab_utilsexerciseslab07py
"""

from __future__ import annotations

import contextlib
import io
import math
import pprint
import random
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lab_utils.course.session import quick_mode
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    NotApplicable,
    References,
    Wrong,
    hands_out,
    integer,
    number,
    run_student,
    source_as,
)
from lab_utils.serving import client as triton_client
from lab_utils.serving import ensemble as ens
from lab_utils.serving import load
from lab_utils.serving import nginx as nginx_mod
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.load import LoadResult

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "use_service", "decode_jpeg", "jpeg_decoder", "reference_gpu_preprocess",
    "Q5_SIZE", "IMAGENET_MEAN", "IMAGENET_STD",
    "Q1_NAME", "PIXEL_SCALE", "SIZE", "MAX_PIXELS", "Q4_LO_RPS", "Q4_HI_RPS", "Q4_TOLERANCE", "SLO_MS",
    "reference_ensemble", "reference_preprocess", "reference_find_capacity", "reference_upstream",
    "reference_servers_needed", "SimulatedService", "pixel_stats",
]

SLO_MS = 100.0
Q1_NAME = "digits_mine"  # the name the student's ensemble is loaded under (beside the service's own)
SIZE = 8  # px: what the classifier was trained on
PIXEL_SCALE = 16 / 255  # PNG grey 0..255 -> the digits' 0..16
MAX_PIXELS = ens.MAX_IMAGE_PIXELS  # px (12.6 M): a larger image is refused, as the service refuses it
Q5_SIZE = 64  # px: the side q5's check asks for (the ResNet-50 service's is 224)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # per RGB channel, on the 0..1 scale
Q4_LO_RPS, Q4_HI_RPS, Q4_TOLERANCE = 25.0, 2500.0, 0.3  # the real search's range (req/s) and tolerance


def pixel_stats() -> tuple[float, float]:
    """(mean, std) of the training digits in 0..16 units: what the preprocessing normalizes with."""
    raw = ens.digits_raw_split()
    return raw["mean"], raw["std"]


# --- the service the checks use -----------------------------------------------------------------------------


_BOUND: list[Any] = []  # the service use_service named, if any


def use_service(service: Any) -> None:
    """The running service the checks load models into, send requests to and read the logs of."""
    _BOUND[:] = [service]
    print(f"checks run against the service at {service.http_url} ({service.via}; {len(service.servers)} Triton)")


def _service() -> Any:
    """The service use_service named, or NotApplicable saying why there is none to check against."""
    if not _BOUND:
        raise NotApplicable("no service to check against yet: run the cell that starts it (it calls "
                            "ex.use_service(svc)).")
    if not _BOUND[0].alive():
        raise NotApplicable("the lab's service is not running: start it again and rerun this check.")
    return _BOUND[0]


# --- reference implementations (later cells use these) ------------------------------------------------------


@hands_out  # its result passes the check it answers: refused as an answer
def reference_ensemble(name: str = Q1_NAME) -> dict[str, Any]:
    """PNG bytes -> digits_preprocess -> digits_classifier -> digits_postprocess -> top-3 labels and scores."""
    return {
        "name": name, "platform": "ensemble", "max_batch_size": 64,
        "input": [{"name": "IMAGE", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "LABELS", "data_type": "TYPE_STRING", "dims": [3]},
                   {"name": "SCORES", "data_type": "TYPE_FP32", "dims": [3]}],
        "ensemble_scheduling": {"step": [
            {"model_name": "digits_preprocess", "model_version": -1,
             "input_map": {"IMAGE": "IMAGE"}, "output_map": {"PIXELS": "pixels"}},
            {"model_name": "digits_classifier", "model_version": -1,
             "input_map": {"input": "pixels"}, "output_map": {"logits": "logits"}},
            {"model_name": "digits_postprocess", "model_version": -1,
             "input_map": {"LOGITS": "logits"}, "output_map": {"LABELS": "LABELS", "SCORES": "SCORES"}},
        ]},
    }


def reference_preprocess(items: Any) -> np.ndarray:
    """Encoded images -> [N, 1, 8, 8] float32 as in training; ``ValueError`` naming a bad item."""
    from PIL import Image

    mean, std = pixel_stats()
    out = []
    for i, data in enumerate(np.asarray(items, dtype=object).reshape(-1)):
        try:
            img = Image.open(io.BytesIO(bytes(data)))
            img.load()
        except Exception:
            raise ValueError(f"item {i} is not an image file: send PNG or JPEG bytes") from None
        if img.size[0] * img.size[1] > MAX_PIXELS:
            raise ValueError(f"item {i} is {img.size[0]}x{img.size[1]} px, over {MAX_PIXELS / 1e6:.1f} Mpx: resize it")
        img = img.convert("L").resize((SIZE, SIZE), Image.Resampling.BOX)  # BOX: the mean of each block
        x = np.asarray(img, np.float32)[None] * PIXEL_SCALE  # [1, 8, 8] in the digits' 0..16
        out.append((x - mean) / std)
    return np.stack(out).astype(np.float32)


def reference_find_capacity(probe: Callable[[float], Any], lo_rps: float, hi_rps: float, slo_ms: float = SLO_MS,
                            tolerance: float = 0.1) -> float:
    """Bisection on the rate: the highest rate whose probe has no error, is stable and has p95 <= the SLO."""
    def ok(rate: float) -> bool:
        r = probe(rate)
        return r.errors == 0 and r.stable and r.p95_ms <= slo_ms

    if not ok(lo_rps):
        return 0.0
    if ok(hi_rps):
        return hi_rps
    while hi_rps - lo_rps > tolerance * hi_rps:
        mid = (lo_rps + hi_rps) / 2
        if ok(mid):
            lo_rps = mid
        else:
            hi_rps = mid
    return lo_rps


@hands_out  # its result passes the check it answers: refused as an answer
def reference_upstream(backends: list[str]) -> str:
    """An upstream block over ``backends`` (``host:port`` of each Triton's HTTP endpoint)."""
    lines = "\n".join(f"    server {b};" for b in backends)
    return f"upstream triton_http {{\n{lines}\n}}"


def reference_servers_needed(peak_rps: float, capacity_rps: float, headroom: float, spares: int = 1) -> int:
    """Servers for ``peak_rps`` when each may run at ``(1 - headroom)`` of its capacity, plus ``spares``."""
    return math.ceil(peak_rps / (capacity_rps * (1 - headroom))) + spares


# --- q1: the ensemble --------------------------------------------------------------------------------------


def _grade_ensemble(config: Any) -> str:
    from google.protobuf import json_format

    if not isinstance(config, (dict, str)):
        raise Wrong(f"give the configuration as a dict (as reference_ensemble's form) or config.pbtxt text, not a "
                    f"{type(config).__name__}")
    try:
        cfg = triton_repo.parse_config(config)
    except triton_repo.ConfigError as err:
        raise Wrong(f"Triton's schema refuses it: {err}") from None
    if cfg.name != Q1_NAME:
        raise Wrong(f"name is {cfg.name!r}: call it {Q1_NAME!r} (the check loads it beside the service's own "
                    f"{ens.SERVICE!r}, which keeps serving)")
    if cfg.platform != "ensemble":
        raise Wrong(f"platform is {cfg.platform!r}: an ensemble is platform \"ensemble\" (no backend, no model file)")
    steps = [s.model_name for s in cfg.ensemble_scheduling.step]
    if steps != [ens.PREPROCESS, ens.CLASSIFIER, ens.POSTPROCESS]:
        raise Wrong(f"the steps are {steps}: the image is decoded first ({ens.PREPROCESS}), then classified "
                    f"({ens.CLASSIFIER}), then turned into labels ({ens.POSTPROCESS})")
    svc = _service()
    problems = ens.ensemble_problems(svc.repo.path, cfg)
    if problems:
        raise Wrong("the steps do not fit the models: " + "; ".join(f"{f}: {why}" for f, why in problems))
    server = svc.servers[0]
    folder = svc.repo.path / Q1_NAME
    try:
        try:
            ens.write_ensemble(svc.repo.path, config if isinstance(config, dict) else
                               json_format.MessageToDict(cfg, preserving_proto_field_name=True))
        except triton_repo.ConfigError as err:
            raise Wrong(f"the course's checks refuse it: {err}") from None
        try:
            triton_client.load_model(server.grpc_url, Q1_NAME)
        except RuntimeError as err:
            raise Wrong(f"Triton refused to load it: {str(err)[:400]}") from None
        pngs, _ = ens.digits_pngs("test", 12)
        try:
            mine = ens.classify(server.grpc_url, pngs, model=Q1_NAME)
        except Exception as err:
            raise Wrong(f"Triton loaded it, but a request through it failed: {str(err)[:300]}") from None
        ref = ens.classify(server.grpc_url, pngs, model=ens.SERVICE)
        if mine[0] != ref[0] or not np.allclose(mine[1], ref[1], atol=1e-5):
            raise Wrong(f"it answers, but not as the service: first image {mine[0][0]} (scores "
                        f"{np.round(mine[1][0], 3).tolist()}) where the service says {ref[0][0]}")
    finally:
        with contextlib.suppress(Exception):  # never loaded: nothing to unload
            triton_client.unload_model(server.grpc_url, Q1_NAME, wait_s=10)
        shutil.rmtree(folder, ignore_errors=True)
    return "Triton loaded it and it answered 12 held-out PNGs exactly as the service does."


q1 = Exercise(
    name="07.1 the ensemble",
    var="ensemble",
    references=References("write the ensemble's configuration yourself",
                           reference_ensemble, "lab_utils.serving.ensemble.ensemble_config"),
    grade=_grade_ensemble,
    hints=(
        "An ensemble has platform \"ensemble\", the service's inputs and outputs (IMAGE: TYPE_STRING [1]; LABELS: "
        "TYPE_STRING [3]; SCORES: TYPE_FP32 [3]) and ensemble_scheduling.step: one entry per model.",
        "Each step maps its model's tensor names to the ensemble's: input_map {model's input: ensemble tensor}, "
        "output_map {model's output: ensemble tensor}. A tensor must be produced before a step reads it.",
        "The models' tensors: digits_preprocess IMAGE -> PIXELS; digits_classifier input -> logits; "
        "digits_postprocess LOGITS -> LABELS, SCORES. Name the intermediate tensors e.g. 'pixels' and 'logits'.",
    ),
    solution_text="ensemble = " + pprint.pformat(reference_ensemble(), width=110, sort_dicts=False),
)


# --- q2: the preprocessing ----------------------------------------------------------------------------------


def _png(img: Any, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _q2_images(seed: int) -> list[bytes]:
    """Held-out digits as 32 px PNGs, and the same digits at other sizes and as RGB (drawn at random)."""
    from PIL import Image

    rng = random.Random(seed)
    raw = ens.digits_raw_split()
    idx = rng.sample(range(len(raw["x_test"])), 8)
    out = []
    for k, i in enumerate(idx):
        grey = np.clip(np.rint(raw["x_test"][i] * 255 / 16), 0, 255).astype(np.uint8)
        scale = (4, 2, 3, 8)[k % 4]
        img = Image.fromarray(grey, mode="L").resize((8 * scale, 8 * scale), Image.Resampling.NEAREST)
        out.append(_png(img.convert("RGB") if k % 3 == 2 else img))
    return out


def _grade_preprocess(fn: Any) -> str:
    images = _q2_images(random.randrange(10**6))
    items = ens.image_batch(images)
    got = run_student(fn, items, what="preprocess", call="preprocess(items)", timeout_s=60,
                      returns=np.ndarray, returns_text="a NumPy array [N, 1, 8, 8]")
    n = len(images)
    if got.shape != (n, 1, SIZE, SIZE):
        extra = (" (the channel axis is missing: [N, 1, 8, 8], as the classifier's input dims [1, 8, 8] plus the "
                 "batch)" if got.shape == (n, SIZE, SIZE) else "")
        raise Wrong(f"for {n} images it returned shape {tuple(got.shape)}; expected ({n}, 1, 8, 8){extra}")
    if got.dtype != np.float32:
        raise Wrong(f"dtype {got.dtype}: the classifier's input is TYPE_FP32 (np.float32)")
    where = "the service's preprocessing model"
    try:
        svc = _service()
        want = triton_client.infer(svc.servers[0].grpc_url, ens.PREPROCESS, {ens.IMAGE: items})[ens.PIXELS]
    except NotApplicable:
        want, where = reference_preprocess(items), "the reference preprocessing"
    err = float(np.abs(got - want).max())
    if err > 1e-3:
        mean, std = pixel_stats()
        ref_raw = want * std + mean  # the reference before normalizing: 0..16
        if np.abs(got - ref_raw).max() < 1e-2:
            raise Wrong("the values are the raw 0..16 pixels: normalize them, (x - mean) / std with the training "
                        "set's mean and std (ex.pixel_stats())")
        if min(np.abs(got * std + mean - ref_raw / PIXEL_SCALE).max(), np.abs(got - ref_raw / PIXEL_SCALE).max()) < 0.2:
            raise Wrong("the values are on the 0..255 scale: multiply by 16/255 (ex.PIXEL_SCALE) first, since the "
                        "digits were trained on 0..16, then normalize")
        raise Wrong(f"differs from {where} by up to {err:.3g} (normalized units). Resize with "
                    "Image.Resampling.BOX to 8x8 (the mean of each block: the exact inverse of the upscale; "
                    "bilinear differs), convert to grey ('L') first")
    from PIL import Image

    for what, data in [("text, not an image", b"hello, this is not an image"), ("an empty item", b""),
                       ("a 5000x3000 px (15 Mpx) image", _png(Image.new("L", (5000, 3000))))]:
        batch = ens.image_batch([images[0], images[1], data])
        try:
            run_student(fn, batch, what="preprocess", call=f"preprocess(items) with {what} as item 2",
                        timeout_s=60)
        except Wrong as w:
            text = str(w)
            if "ValueError" not in text:
                raise Wrong(f"with {what} as item 2 it raised something other than ValueError ({text[:200]}): "
                            "catch the decoder's error and raise ValueError naming the item, so the service "
                            "answers 400 (the client's fault), not 500") from None
            if "2" not in text.split("ValueError", 1)[1]:
                raise Wrong(f"with {what} as item 2 the ValueError does not name the item ({text[:200]}): say which "
                            "item (2) and what to send instead") from None
            continue
        raise Wrong(f"with {what} as item 2 it returned an answer: refuse it with ValueError naming the item (the "
                    f"service refuses images over {MAX_PIXELS / 1e6:.1f} Mpx; a decoded huge image costs memory for "
                    "nothing)")
    return f"its tensors match {where} on {n} PNGs (three sizes, grey and RGB), and bad items are refused."


q2 = CodeExercise(
    name="07.2 the preprocessing step",
    var="preprocess",
    references=References("decode, resize and normalize the images yourself", reference_preprocess),
    grade=_grade_preprocess,
    signature="preprocess(items) -> np.ndarray [N, 1, 8, 8] float32",
    hints=(
        "For each item: Image.open(io.BytesIO(bytes(item))), .convert('L'), .resize((8, 8), "
        "Image.Resampling.BOX); np.asarray(..., np.float32) * ex.PIXEL_SCALE; then (x - mean) / std; stack with "
        "a channel axis: [N, 1, 8, 8].",
        "Bad items: wrap Image.open (and img.load(), which decodes) in try/except and raise "
        "ValueError(f\"item {i} ...\"); check img.size[0] * img.size[1] > ex.MAX_PIXELS before resizing.",
    ),
    solution_text=source_as(reference_preprocess, "preprocess"),
)


# --- q3: the upstream block ---------------------------------------------------------------------------------


def _grade_upstream(block: Any) -> str:
    import urllib.request

    if not isinstance(block, str):
        raise Wrong(f"give the block as text (a str), not a {type(block).__name__}")
    svc = _service()
    if not nginx_mod.available(show=False):
        raise NotApplicable(f"nginx is not installed here: {nginx_mod.missing()}")
    want = set(svc.backends("http"))
    grpc_ports = set(svc.backends("grpc"))
    listed = set(nginx_mod._SERVER_LINE.findall(block))
    if listed & grpc_ports:  # nginx would speak HTTP/1.1 to an HTTP/2-only port: no valid answer comes back
        raise Wrong(f"it lists Triton's gRPC ports ({sorted(listed & grpc_ports)}) in an HTTP upstream: the HTTP "
                    "endpoints are svc.backends('http') (gRPC goes through grpc_pass, in an upstream of its own)")
    try:
        lb = nginx_mod.serve_upstream(block, api_keys=())
    except nginx_mod.NginxConfigError as err:
        raise Wrong(f"nginx refuses it: {err.problem}" + (f" (line {err.line})" if err.line else "") +
                    (f". Fix: {err.fix}" if err.fix else "")) from None
    try:
        statuses = []
        for _ in range(12):
            try:
                with urllib.request.urlopen(f"{lb.http_url}/v2/health/ready", timeout=5) as r:
                    statuses.append(r.status)
            except Exception as err:  # HTTPError (a status), or an answer that is not HTTP/1 at all
                statuses.append(getattr(err, "code", 0))
        summary = lb.access_summary()
    finally:
        lb.stop()
    seen = set(summary["by_upstream"])
    bad = [s for s in statuses if s != 200]
    if bad:
        raise Wrong(f"{len(bad)} of 12 requests through it failed (statuses {sorted(set(bad))}): are the servers "
                    "Triton's HTTP endpoints, svc.backends('http')?")
    missing = want - seen
    if missing:
        raise Wrong(f"only {sorted(seen)} answered; {sorted(missing)} got nothing: list every server of "
                    "svc.backends('http'), each on its own `server HOST:PORT;` line")
    shares = sorted(summary["by_upstream"].values())
    if shares[0] < 3:
        raise Wrong(f"requests per server {summary['by_upstream']}: one gets almost nothing (a weight far from the "
                    "others?); the servers are alike, so give them equal weights")
    return "nginx -t accepts it, and traffic through it reached both Triton servers."


q3 = Exercise(
    name="07.3 the nginx upstream",
    var="upstream_block",
    references=References("write the upstream block yourself", reference_upstream),
    grade=_grade_upstream,
    hints=(
        "One `upstream NAME { ... }` block; inside, one `server HOST:PORT;` line per Triton server; every line "
        "ends with ';'.",
        "The servers' HTTP addresses are svc.backends('http') (a list of 'host:port').",
    ),
    solution_text='backends = svc.backends("http")\nupstream_block = f"""\nupstream triton_http {{\n'
                  '    server {backends[0]};\n    server {backends[1]};\n}}\n"""',
)


# --- q4: the capacity search --------------------------------------------------------------------------------


class SimulatedService:
    """A service whose latency at a rate is known: p95 reaches the SLO at ``p95_edge_rps``; runs are unstable
    (the queue grows, slowly enough that p95 still looks fine) above ``stable_edge_rps``; fast failures (429s:
    quick, so latency looks low) above ``error_edge_rps``. The capacity is the lowest of the three edges."""

    def __init__(self, seed: int, lo: float, hi: float, trap: str):
        rng = random.Random(seed)
        self.capacity = rng.uniform(lo + 0.3 * (hi - lo), lo + 0.6 * (hi - lo))
        self.p95_edge = self.capacity if trap in ("p95", "none") else self.capacity * 1.4
        self.p50_edge = self.p95_edge * 1.3  # p50 stays under the SLO longer: p50 for p95 overshoots
        self.stable_edge = self.capacity if trap == "stable" else self.capacity * 1.6
        self.error_edge = self.capacity if trap == "errors" else self.capacity * 1.7
        self.calls: list[float] = []

    def probe(self, rate_rps: float) -> Any:
        self.calls.append(float(rate_rps))

        def lat(edge: float) -> float:  # SLO_MS exactly at the edge, growing fast after it
            return SLO_MS * (rate_rps / edge) ** 4

        errors = 0 if rate_rps <= self.error_edge else int(rate_rps * 0.05)
        p95, p50 = lat(self.p95_edge), lat(self.p50_edge)
        return LoadResult(
            mode="open", target="simulated", rate_rps=rate_rps, concurrency=None, offered_rps=rate_rps,
            achieved_rps=rate_rps if rate_rps <= self.stable_edge else 0.8 * rate_rps, throughput_infer_s=rate_rps,
            p50_ms=p50, p90_ms=(p50 + p95) / 2, p95_ms=p95, p99_ms=2 * p95, mean_ms=p50, requests=int(rate_rps * 5),
            errors=errors, timeouts=0, error_messages={"HTTP 429: over the rate limit": errors} if errors else {},
            windows=[], stable=rate_rps <= self.stable_edge, seconds=5.0)


def _grade_capacity(fn: Any) -> str:
    lo, hi, tol = 20.0, 1000.0, 0.05
    for trap in ("none", "p95", "stable", "errors"):
        sim = SimulatedService(random.randrange(10**6), lo, hi, trap)
        got = run_student(fn, sim.probe, lo, hi, SLO_MS, tol, what="find_capacity",
                          call=f"find_capacity(probe, {lo:g}, {hi:g}, {SLO_MS:g}, {tol:g})", timeout_s=30)
        got = number(got, "the capacity (requests per second)")
        calls = len(sim.calls)
        if not sim.calls:
            raise Wrong("it never called probe(rate): the capacity is measured, one open-loop run per rate tried")
        if calls > 15:
            raise Wrong(f"it ran {calls} probes for a range of {lo:g}..{hi:g} req/s at tolerance {tol:g}: bisection "
                        "needs about 7; each probe is a real load test of several seconds")
        c = sim.capacity
        if got > c * (1 + 1e-9):
            r = sim.probe(got)
            sim.calls.pop()
            if r.errors:
                why = (f"that run had errors ({r.errors} fast 429s, which keep the latency low): a rate with failed "
                       "requests does not meet the SLO")
            elif not r.stable:
                why = ("that run was not stable (the server fell behind, a queue built up): a rate the server cannot "
                       "sustain is not within capacity even when its p95 still looks fine")
            elif r.p50_ms <= SLO_MS:
                why = (f"its p95 is {r.p95_ms:.0f} ms, over the SLO; its p50 ({r.p50_ms:.0f} ms) is under it: the SLO "
                       "is on p95")
            else:
                why = f"its p95 is {r.p95_ms:.0f} ms, over the {SLO_MS:g} ms SLO"
            raise Wrong(f"it answered {got:.1f} req/s where the capacity is {c:.1f}: {why}")
        if got < c - 2 * tol * hi:
            raise Wrong(f"it answered {got:.1f} req/s where the capacity is {c:.1f}: too low. Keep halving the "
                        f"range [passing rate, failing rate] until it is narrower than tolerance x the upper rate, "
                        "and return the highest rate that passed")
    try:
        svc = _service()
    except NotApplicable as why:
        return f"it found the capacity of four simulated services ({why} The real search is skipped.)"

    target = svc.target("http")
    probes: list[dict[str, Any]] = []
    # (duration, warm-up) of each probe, s. The verdict (the answer is what its own probes say) does not depend on
    # the length: quick mode (CI) runs the shortest probe with three half-second windows.
    probe_s = (1.5, 0.5) if quick_mode() else (3.0, 1.0)

    def probe(rate: float) -> Any:
        if len(probes) >= 12:
            raise Wrong("more than 12 probes against the real service: stop when the range is narrower than the "
                        "tolerance")
        r = load.run_open_loop(target, float(rate), probe_s[0], warmup_s=probe_s[1], window_s=probe_s[1],
                               timeout_s=2.0)
        ok = r.errors == 0 and r.stable and r.p95_ms <= SLO_MS
        probes.append({"rate": float(rate), "ok": ok, "p95_ms": r.p95_ms})
        return r

    t0 = time.perf_counter()
    got = float(run_student(fn, probe, Q4_LO_RPS, Q4_HI_RPS, SLO_MS, Q4_TOLERANCE, what="find_capacity",
                            call=f"find_capacity(probe, {Q4_LO_RPS:g}, {Q4_HI_RPS:g}, {SLO_MS:g}, {Q4_TOLERANCE:g})",
                            timeout_s=120))
    passed = [p["rate"] for p in probes if p["ok"]]
    failed = [p["rate"] for p in probes if not p["ok"]]
    best = max([r for r in passed if not failed or r < min(failed)], default=0.0)
    if not math.isclose(got, best, rel_tol=1e-6, abs_tol=1e-6):
        raise Wrong(f"against the running service it returned {got:.1f} req/s, but its own probes say "
                    f"{best:.1f} (the highest rate that passed below the lowest that failed): {probes}")
    note = (f" Against the running service through {svc.via}: {got:.0f} req/s after {len(probes)} probes "
            f"({time.perf_counter() - t0:.0f} s).")
    return "it found the capacity of four simulated services (traps: p50, unstable runs, fast errors)." + note


q4 = CodeExercise(
    name="07.4 the capacity search",
    var="find_capacity",
    references=References("write the bisection over the rate yourself", reference_find_capacity),
    grade=_grade_capacity,
    signature="find_capacity(probe, lo_rps, hi_rps, slo_ms, tolerance) -> float",
    hints=(
        "A rate passes when its run has no error (r.errors == 0), is stable (r.stable) and r.p95_ms <= slo_ms.",
        "Try lo_rps (fails: return 0) and hi_rps (passes: return hi_rps); then while hi - lo > tolerance * hi: "
        "probe the middle; it becomes the new lo if it passed, the new hi if not. Return lo.",
    ),
    solution_text=source_as(reference_find_capacity, "find_capacity"),
)


# --- q6: the capacity plan ----------------------------------------------------------------------------------

_Q5_FIXED = [(1000.0, 180.0, 0.3, 1), (100.0, 350.0, 0.3, 1), (5000.0, 1200.0, 0.25, 2), (720.0, 240.0, 0.0, 0)]


def _grade_plan(fn: Any) -> str:
    rng = random.Random(random.randrange(10**6))
    cases = list(_Q5_FIXED) + [(round(rng.uniform(200, 20000)), round(rng.uniform(50, 2000)),
                                rng.choice([0.2, 0.3, 0.4]), rng.choice([1, 2])) for _ in range(20)]
    got_all = []
    for peak, cap, head, spares in cases:
        call = f"servers_needed({peak:g}, {cap:g}, {head:g}, {spares})"
        got = run_student(fn, peak, cap, head, spares, call=call, timeout_s=10)
        got_all.append(integer(got, f"{call} (a number of servers: math.ceil)"))
    slips = {  # a common mistake's answers on every case -> what it got wrong
        "the headroom is missing: each server may run at only (1 - headroom) x its capacity, so that a burst or a "
        "slow minute stays inside the SLO": lambda p, c, h, s: math.ceil(p / c) + s,
        "peak x (1 + headroom) is not peak / (1 - headroom): a server loaded to 70 % of capacity has 30 % headroom":
            lambda p, c, h, s: math.ceil(p * (1 + h) / c) + s,
        "the spare is missing: with just enough servers, one failing (or being updated) breaks the SLO; add "
        "`spares` on top": lambda p, c, h, s: math.ceil(p / (c * (1 - h))),
        "rounded down: 2.1 servers' worth of load needs 3 servers (math.ceil)":
            lambda p, c, h, s: round(p / (c * (1 - h))) + s,
    }
    want_all = [reference_servers_needed(*case) for case in cases]
    if got_all == want_all:
        return "right on the fixed cases and 20 drawn at random."
    i = next(k for k, (g, w) in enumerate(zip(got_all, want_all, strict=True)) if g != w)
    p, c, h, sp = cases[i]
    call = f"servers_needed({p:g}, {c:g}, {h:g}, {sp}) = {got_all[i]}, expected {want_all[i]}"
    for why, slip in slips.items():
        if got_all == [slip(*case) for case in cases]:
            raise Wrong(f"{call}: {why}")
    raise Wrong(f"{call}: servers = ceil(peak / (capacity x (1 - headroom))) + spares")


q6 = CodeExercise(
    name="07.6 the capacity plan",
    var="servers_needed",
    references=References("work out the number of servers yourself", reference_servers_needed),
    grade=_grade_plan,
    signature="servers_needed(peak_rps, capacity_rps, headroom, spares) -> int",
    hints=(
        "Each server may be loaded to (1 - headroom) x capacity_rps.",
        "The servers that carry the peak: the peak over what one server may carry, rounded up (math.ceil, never "
        "down); then `spares` on top.",
    ),
    solution_text=source_as(reference_servers_needed, "servers_needed"),
)


# --- q5: the GPU decode step ----------------------------------------------------------------------------------


def decode_jpeg(data: list[Any], mode: Any = None, device: Any = "cpu") -> list[Any]:
    """torchvision's batched ``decode_jpeg`` done by Pillow, for a machine without torchvision or a GPU: encoded
    JPEGs (uint8 tensors) -> uint8 [3, H, W] tensors on ``device`` (``mode`` is accepted and RGB is given)."""
    import torch
    from PIL import Image

    if isinstance(data, torch.Tensor):
        return decode_jpeg([data], mode, device)[0]
    out = []
    for t in data:
        rgb = np.array(Image.open(io.BytesIO(t.cpu().numpy().tobytes())).convert("RGB"))
        out.append(torch.from_numpy(rgb).permute(2, 0, 1).contiguous().to(device))
    return out


def jpeg_decoder() -> tuple[Callable[..., Any], str]:
    """(decode_jpeg, device): torchvision's nvJPEG decode on ``cuda`` where torchvision and a GPU are there, else
    this module's Pillow ``decode_jpeg`` on the CPU (the same call, so the same answer works on both)."""
    import torch

    if torch.cuda.is_available():
        with contextlib.suppress(ImportError, RuntimeError):
            from torchvision.io import decode_jpeg as nvjpeg  # optional: not in the CPU environment
            return nvjpeg, "cuda"
    return decode_jpeg, "cpu"


def reference_gpu_preprocess(items: Any, decode_jpeg: Callable[..., Any], device: Any, size: int = Q5_SIZE) -> Any:
    import torch
    import torch.nn.functional as F

    data = [torch.frombuffer(bytearray(bytes(item)), dtype=torch.uint8)
            for item in np.asarray(items, dtype=object).reshape(-1)]
    images = decode_jpeg(data, device=device)  # ONE call: nvJPEG decodes the batch together
    x = torch.stack([F.interpolate(img[None].float(), size=(size, size), mode="bilinear", antialias=True,
                                   align_corners=False)[0] for img in images])
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    return (x / 255 - mean) / std


def _grade_gpu_preprocess(fn: Any) -> str:
    import torch

    decode, device = jpeg_decoder()
    calls: list[int] = []

    def counted(data: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(data) if isinstance(data, (list, tuple)) else 1)
        return decode(data, *args, **kwargs)

    photos = ens.photo_jpegs(6, (80, 300), seed=random.randrange(10**6))
    items = ens.image_batch(photos)
    got = run_student(fn, items, counted, device, what="gpu_preprocess", call="gpu_preprocess(items, decode_jpeg, "
                      f"{device!r})", timeout_s=60, returns=torch.Tensor, returns_text="a torch tensor [N, 3, 64, 64]")
    n = len(photos)
    if len(calls) != 1:
        raise Wrong(f"decode_jpeg was called {len(calls)} times for {n} images: pass the whole list in ONE call "
                    "(decode_jpeg(list_of_tensors, device=device)); nvJPEG decodes a batch together, one call per "
                    "image pays its launch and synchronization every time")
    if tuple(got.shape) != (n, 3, Q5_SIZE, Q5_SIZE):
        raise Wrong(f"for {n} images it returned shape {tuple(got.shape)}; expected ({n}, 3, {Q5_SIZE}, {Q5_SIZE}): "
                    "resize each decoded [3, H, W] image to 64x64 and torch.stack them")
    if got.dtype != torch.float32:
        raise Wrong(f"dtype {got.dtype}: the classifier's input is float32 (img.float() before resizing)")
    if got.device.type != torch.device(device).type:
        raise Wrong(f"the tensor is on {got.device}, not {device}: keep the work where decode_jpeg put the images "
                    "(a copy to the CPU and back costs more than the decode)")
    want = reference_gpu_preprocess(items, decode, device)
    err = float((got - want).abs().mean())
    if err <= 0.02:
        return (f"its tensors match the reference on {n} JPEG photographs ({device}), decoded in one call, "
                f"mean difference {err:.4f}.")
    mean = torch.tensor(IMAGENET_MEAN, device=want.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=want.device).view(1, 3, 1, 1)
    pixels = (want * std + mean) * 255  # the reference before normalizing: 0..255
    slips = [(pixels / 255, "the values are on the 0..1 scale, not normalized: subtract ex.IMAGENET_MEAN and divide "
              "by ex.IMAGENET_STD per channel (view(1, 3, 1, 1))"),
             (pixels, "the values are the raw 0..255 pixels: divide by 255, then normalize with ex.IMAGENET_MEAN "
              "and ex.IMAGENET_STD"),
             ((pixels - mean) / std, "the 0..255 pixels were normalized with the 0..1 mean and std: divide by 255 "
              "first")]
    for value, why in slips:
        if float((got - value).abs().mean()) < 0.05:
            raise Wrong(why)
    raise Wrong(f"differs from the reference by {err:.3g} on average (normalized units): resize each image with "
                "F.interpolate(img[None].float(), size=(64, 64), mode='bilinear', antialias=True) (antialias, as "
                "Pillow does when it shrinks), on the 0..255 values, then (x / 255 - mean) / std")


q5 = CodeExercise(
    name="07.5 the GPU decode step",
    var="gpu_preprocess",
    references=References("decode the batch, resize and normalize it yourself", reference_gpu_preprocess),
    grade=_grade_gpu_preprocess,
    signature="gpu_preprocess(items, decode_jpeg, device) -> torch.Tensor [N, 3, 64, 64] float32 on device",
    hints=(
        "Each item is JPEG bytes: torch.frombuffer(bytearray(bytes(item)), dtype=torch.uint8) for every item of "
        "np.asarray(items, dtype=object).reshape(-1); then ONE decode_jpeg(list, device=device) call.",
        "Per decoded [3, H, W] uint8 image: F.interpolate(img[None].float(), size=(64, 64), mode='bilinear', "
        "antialias=True)[0]; torch.stack them; then (x / 255 - mean) / std with ex.IMAGENET_MEAN and "
        "ex.IMAGENET_STD as tensors of shape (1, 3, 1, 1) on the same device.",
    ),
    solution_text=source_as(reference_gpu_preprocess, "gpu_preprocess"),
)
