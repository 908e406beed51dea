"""Lab 07's service: the one the checks use (``use_service`` names it, ``bound_service()`` hands it to a check or
says why there is none), and its configuration checked in it: q1 the ensemble's ``config.pbtxt`` (loaded on one of
its Triton servers), q3 nginx's upstream block over the two Triton servers (``nginx -t``, then traffic)."""

from __future__ import annotations

import contextlib
import pprint
import shutil
from typing import Any

import numpy as np

from lab_utils.exercises.framework import Exercise, NotApplicable, References, Wrong, hands_out
from lab_utils.procs import http_ok
from lab_utils.serving import client as triton_client
from lab_utils.serving import ensemble as ens
from lab_utils.serving import nginx as nginx_mod
from lab_utils.serving import repository as triton_repo

_BOUND: list[Any] = []  # the service use_service named, if any


def use_service(service: Any) -> None:
    """The running service the checks load models into, send requests to and read the logs of."""
    _BOUND[:] = [service]
    print(f"checks run against the service at {service.http_url} ({service.via}; {len(service.servers)} Triton)")


def bound_service() -> Any:
    """The service use_service named, or NotApplicable saying why there is none to check against."""
    if not _BOUND:
        raise NotApplicable("no service to check against yet: run the cell that starts it (it calls "
                            "ex.use_service(svc)).")
    if not _BOUND[0].alive():
        raise NotApplicable("the lab's service is not running: start it again and rerun this check.")
    return _BOUND[0]


Q1_NAME = "digits_mine"  # the name the student's ensemble is loaded under (beside the service's own)


# --- q1: the ensemble --------------------------------------------------------------------------------------


@hands_out  # its result passes the check it answers: refused as an answer
def reference_ensemble(name: str = Q1_NAME) -> dict[str, Any]:
    """PNG bytes -> digits_preprocess -> digits_classifier -> digits_postprocess -> top-3 labels and scores: the
    service's own ensemble under another name, without the response cache."""
    return ens.ensemble_config(name, cache=False)


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
    svc = bound_service()
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
                           "lab_utils.exercises.lab07.reference_ensemble",
                           "lab_utils.serving.ensemble.ensemble_config"),
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


# --- q3: the upstream block ---------------------------------------------------------------------------------


@hands_out  # its result passes the check it answers: refused as an answer
def reference_upstream(backends: list[str]) -> str:
    """An upstream block over ``backends`` (``host:port`` of each Triton's HTTP endpoint)."""
    lines = "\n".join(f"    server {b};" for b in backends)
    return f"upstream triton_http {{\n{lines}\n}}"


def _grade_upstream(block: Any) -> str:
    if not isinstance(block, str):
        raise Wrong(f"give the block as text (a str), not a {type(block).__name__}")
    svc = bound_service()
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
    try:  # what happened to each: an HTTP status, or the failure's name (an answer that is not HTTP/1 at all)
        answers = [http_ok(f"{lb.http_url}/v2/health/ready", timeout_s=5) for _ in range(12)]
        summary = lb.access_summary()
    finally:
        lb.stop()
    seen = set(summary["by_upstream"])
    bad = sorted({what for ok, what in answers if not ok})
    if bad:
        raise Wrong(f"{sum(not ok for ok, _ in answers)} of 12 requests through it failed ({', '.join(bad)}): are the "
                    "servers Triton's HTTP endpoints, svc.backends('http')?")
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
    references=References("write the upstream block yourself",
                          "lab_utils.exercises.lab07.reference_upstream"),
    grade=_grade_upstream,
    hints=(
        "One `upstream NAME { ... }` block; inside, one `server HOST:PORT;` line per Triton server; every line "
        "ends with ';'.",
        "The servers' HTTP addresses are svc.backends('http') (a list of 'host:port').",
    ),
    solution_text='backends = svc.backends("http")\nupstream_block = f"""\nupstream triton_http {{\n'
                  '    server {backends[0]};\n    server {backends[1]};\n}}\n"""',
)
