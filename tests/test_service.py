"""Lab 07's service against the real components: two Triton servers behind nginx, PNGs through the ensemble, bad
input refused with a clear 4xx and the service healthy after, Prometheus scraping both servers and nginx, the SLO
rules and dashboard checked by promtool, a hot update under load without a failed request, and nothing left
running: after stop(), and after the kernel that started it is killed mid-lab."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tempfile
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from _prometheus import require_prometheus
from _retry import tried
from _triton import KernelOutput, require_service

from lab_utils import procs
from lab_utils.monitoring import prometheus
from lab_utils.monitoring import service_monitoring as sm
from lab_utils.serving import client as triton_client
from lab_utils.serving import ensemble as ens
from lab_utils.serving import nginx as nginx_mod
from lab_utils.serving import server as triton_server
from lab_utils.serving import service
from lab_utils.serving.metrics import metric_samples
from nvlab.ops import notebooks

_require_all = require_service


def _prometheus_here():
    require_prometheus("prometheus", "promtool")


# the service is conftest.py's, shared with the other file of its group (SHARED_GROUPS)


@pytest.fixture(scope="module")
def svc(service_stack):
    return service_stack


def test_a_start_finds_nginx_renders_its_config_and_checks_the_repository_once(svc, monkeypatch):
    """Starting a service looks nginx up once, renders its config once and validates the model repository once
    (a repository given here: the service checks it; its two Triton servers do not again). Before: nginx was looked
    up five times, its config rendered three times, the repository validated by each server."""
    from collections import Counter

    from lab_utils.serving import nginx as nginx_mod
    from lab_utils.serving import repository as triton_repo
    from lab_utils.serving import server as server_mod

    if nginx_mod.missing():
        pytest.skip(nginx_mod.missing())
    counts: Counter = Counter()

    def count(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: counts.update([name]) or real(*a, **k))

    for module, name in ((nginx_mod, "find_nginx"), (nginx_mod, "render_config"),
                         (triton_repo, "validate_repository"), (server_mod, "validate_repository")):
        count(module, name)
    with service.Service(repo=svc.repo, servers=2, use_nginx=True) as again:
        assert again.via == "nginx" and len(again.servers) == 2 and again.health()["service_ready"]
    assert counts == {"find_nginx": 1, "render_config": 1, "validate_repository": 1}, counts


def test_every_file_using_the_shared_service_is_in_its_group():
    """A file using tests/conftest.py's service_stack outside the "service" group (the root conftest.py's
    SHARED_GROUPS) would start a second service on another worker."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("nvlab_root_conftest", root / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)  # by path: `import conftest` may give tests/conftest.py
    users = {f"tests/{p.name}" for p in (root / "tests").glob("test_*.py") if "service_stack" in p.read_text()}
    assert users == {f for f, g in conftest.SHARED_GROUPS.items() if g == "service"}


# --- without a running service ---------------------------------------------------------------------------------


def test_bad_arguments_fail_before_anything_starts():
    with pytest.raises(ValueError, match="servers"):
        service.Service(servers=0)
    with pytest.raises(ValueError, match="cache"):
        service.Service(cache="ensemble")
    with pytest.raises(ValueError, match="client_max_body_size"):
        service.Service(client_max_body_size="big")
    with pytest.raises(ValueError, match="rate_limit_rps"):
        service.Service(rate_limit_rps=-1)


def test_lab08_traffic_refuses_a_rate_that_is_not_a_finite_number_above_zero():
    from lab_utils.mlops import deploy

    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match=r"BackgroundLoad\(rate_rps="):
            deploy.BackgroundLoad(None, bad)
        with pytest.raises(ValueError, match=r"LabelledTraffic\(rate_rps="):
            deploy.LabelledTraffic(None, None, np.zeros((1, 8, 8)), np.zeros(1), rate_rps=bad)
    assert deploy.BackgroundLoad(None, 5).rate_rps == 5.0


def test_service_rules_pass_promtool_and_their_tests():
    _prometheus_here()
    assert "SUCCESS" in prometheus.check_rules(sm.SERVICE_RULES_FILE)
    assert "SUCCESS" in prometheus.test_rules(sm.SERVICE_RULES_TEST_FILE)


def test_committed_service_dashboard_is_generated_and_every_expression_passes_promtool(tmp_path):
    assert sm.SERVICE_DASHBOARD_FILE.read_text() == sm.dashboard_text(), \
        "regenerate: python -c 'from lab_utils.monitoring import service_monitoring as m; " \
        "m.SERVICE_DASHBOARD_FILE.write_text(m.dashboard_text())'"
    _prometheus_here()
    from lab_utils.monitoring import panels

    rules = [{"record": f"nvlab:service_dashboard:{i}", "expr": expr}
             for i, (_, expr) in enumerate(panels.dashboard_expressions(sm.SERVICE_DASHBOARD_FILE, window="30s"))]
    assert len(rules) == len(sm.SERVICE_PANELS) and all(p.description for p in sm.SERVICE_PANELS)
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert "SUCCESS" in prometheus.check_rules(path)


# --- the running service ---------------------------------------------------------------------------------------


def test_accuracy_through_nginx_over_both_protocols_and_both_servers(svc):
    t0 = time.time()
    http, grpc = svc.accuracy("http"), svc.accuracy("grpc", batch_size=7)
    assert http["accuracy"] > 0.9 and http["wrong"] == grpc["wrong"] and http["via"] == "nginx"
    assert abs(http["accuracy"] - svc.repo.facts["accuracy"]) < 0.01
    seen = svc.lb.access_summary(since=t0)
    assert set(seen["by_upstream"]) == set(svc.backends("http")) | set(svc.backends("grpc")), seen
    assert seen["by_listener"].keys() == {"http", "grpc"} and set(seen["by_status"]) == {200}
    assert all(svc.health().values())


# every route family of Triton's APIs that the front door must refuse: (call, args), for both tritonclients
REFUSED_CALLS = [("unload_model", ("{model}",)), ("load_model", ("{model}",)), ("get_model_repository_index", ()),
                 ("get_inference_statistics", ()), ("get_inference_statistics", ("{model}",)),
                 ("get_server_metadata", ()), ("get_system_shared_memory_status", ()),
                 ("register_system_shared_memory", ("r", "/nvlab_no_such_region", 64)),
                 ("unregister_system_shared_memory", ()), ("get_cuda_shared_memory_status", ()),
                 ("get_trace_settings", ()), ("update_trace_settings", ("{model}", {"trace_level": ["TIMESTAMPS"]})),
                 ("get_log_settings", ()), ("update_log_settings", ({"log_verbose_level": 1},))]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_front_door_refuses_model_control_and_every_operator_route(svc, protocol):
    """With the client's API key, a request to unload the model, read the repository index, the statistics, the
    server's metadata, shared memory, trace or log settings is refused at the door (HTTP 403, gRPC
    PERMISSION_DENIED, with the reason), no Triton server sees it, and the model serves on; inference, model
    metadata, config, readiness and health pass."""
    from tritonclient.utils import InferenceServerException

    c = triton_client.client(svc.url(protocol), protocol)
    key, t0 = {k.lower(): v for k, v in svc.headers.items()}, time.time()  # gRPC metadata keys are lowercase
    try:
        assert c.is_server_live(headers=key) and c.is_server_ready(headers=key)
        assert c.is_model_ready(svc.model, headers=key)
        assert c.get_model_metadata(svc.model, headers=key) and c.get_model_config(svc.model, headers=key)
        passed = len(svc.lb.access_rows(since=t0))
        for name, args in REFUSED_CALLS:
            args = tuple(a.format(model=svc.model) if isinstance(a, str) else a for a in args)
            with pytest.raises(InferenceServerException) as refused:
                getattr(c, name)(*args, headers=key)
            want = "403" if protocol == "http" else "StatusCode.PERMISSION_DENIED"
            assert refused.value.status() == want and "not served through the front door" in \
                refused.value.message(), (name, refused.value.status(), refused.value.message())
    finally:
        c.close()
    if protocol == "grpc":  # a stream carries many requests past the per-request rate limit: refused too
        import queue

        import tritonclient.grpc as grpcclient

        errors: queue.Queue = queue.Queue()
        stream = triton_client.client(svc.grpc_url, "grpc")
        try:
            stream.start_stream(callback=lambda result, error: errors.put(error), headers=key)
            image = grpcclient.InferInput(ens.IMAGE, [1, 1], "BYTES")
            image.set_data_from_numpy(ens.image_batch(ens.digits_pngs("test", 1)[0]))
            with contextlib.suppress(InferenceServerException):  # the refusal may have ended the stream already
                stream.async_stream_infer(svc.model, [image])
            error = errors.get(timeout=10)
            assert error is not None and "not served through the front door" in str(error), error
        finally:
            stream.stop_stream()
            stream.close()
    if protocol == "http":  # Triton's LLM routes, and an unload hidden behind a dot segment: plain POSTs
        import http.client

        for path in (f"/v2/models/{svc.model}/generate", f"/v2/models/{svc.model}/generate_stream",
                     f"/v2/models/{svc.model}/infer/../../../repository/models/{svc.model}/unload"):
            conn = http.client.HTTPConnection(svc.lb.host, svc.lb.http_port, timeout=10)  # the path as written
            try:
                conn.request("POST", path, b"{}", {**svc.headers, "Content-Type": "application/json"})
                r = conn.getresponse()
                status, answer = r.status, json.loads(r.read())
            finally:
                conn.close()
            assert status == 403 and "not served through the front door" in answer["error"], (path, status, answer)
    rows = svc.lb.access_rows(since=t0)[passed:]
    assert len(rows) >= len(REFUSED_CALLS) and all(r["upstream"] is None for r in rows), rows  # refused at the door
    good = ens.digits_pngs("test", 1)[0]
    assert all(svc.health().values()) and svc.classify(good, protocol)[0][0][0] in ens.DIGIT_LABELS
    states = {m["name"]: m.get("state") for m in triton_client.repository_index(svc.servers[0].grpc_url)}
    assert states[svc.model] == "READY"  # the unload never reached a server


def _png(size, noise=False):
    from PIL import Image

    a = (np.random.default_rng(0).integers(0, 256, size[::-1], dtype=np.uint8) if noise
         else np.zeros(size[::-1], np.uint8))
    buf = io.BytesIO()
    Image.fromarray(a, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def _attempt(svc, inputs, headers=None, protocol="http"):
    from tritonclient.utils import InferenceServerException

    try:
        service.infer(svc.url(protocol), svc.model, inputs, protocol=protocol,
                      headers=svc.headers if headers is None else headers)
        return "200", ""
    except InferenceServerException as err:
        return str(err.status()), str(err.message())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_input_is_a_clear_4xx_and_the_service_stays_healthy(svc, protocol):
    good = ens.digits_pngs("test", 1)[0][0]
    bad = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    cases = [  # inputs, headers, the status, words the message must hold
        ({"IMAGE": ens.image_batch([b"hello"])}, None, bad, ["not an image file", "send the encoded file"]),
        ({"IMAGE": ens.image_batch([_png((5000, 3000))])}, None, bad, ["5000x3000 px, 15.0 Mpx", "resize it"]),
        ({"IMAGE": ens.image_batch([_png((1, 1))])}, None, bad, ["1x1 px", "minimum of 8 px"]),
        ({"IMAGE": np.zeros((1, 1), np.float32)}, None, bad, ["FP32", "BYTES"]),
        # nginx's own refusals reach a gRPC client as gRPC statuses with the same words
        ({"IMAGE": ens.image_batch([good])}, {}, "401" if protocol == "http" else "StatusCode.UNAUTHENTICATED",
         ["API key"]),
        ({"IMAGE": ens.image_batch([b"\x89PNG" + bytes(13 << 20)])}, None,  # 13 MiB, over nginx's 12m
         "413" if protocol == "http" else "StatusCode.RESOURCE_EXHAUSTED", ["body over", "12m"]),
        ({"IMAGE": ens.image_batch([ens.decompression_bomb()])}, None, bad, ["px, over this service's limit",
                                                                             "resize it"]),
        ({"IMAGE": ens.image_batch([ens.photo_jpegs(1)[0][:4000]])}, None, bad, ["JPEG", "truncated"]),
    ]
    for inputs, headers, status, words in cases:
        got, message = _attempt(svc, inputs, headers, protocol)
        assert got == status and all(w in message for w in words), (status, got, message)
    assert all(svc.health().values()) and svc.classify([good], protocol)[0][0][0] in ens.DIGIT_LABELS


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_phone_photos_up_to_12_megapixels_pass_nginx_and_are_answered(svc, protocol):
    """A 1920x1080 and a 4000x3000 JPEG photo (formerly 413 at nginx's 1m, and 400 at the model's 256 KiB and
    1024 px a side) are answered through nginx; a file over the model's 8 MiB is a 400 naming the limit."""
    photos = ens.photo_jpegs(1, shape=(1920, 1080)) + ens.photo_jpegs(1, shape=(4000, 3000), seed=1)
    for photo in photos:
        got, message = _attempt(svc, {"IMAGE": ens.image_batch([photo])}, protocol=protocol)
        assert got == "200", (len(photo), got, message)
    got, message = _attempt(svc, {"IMAGE": ens.image_batch([photos[1] + bytes(9 << 20)])}, protocol=protocol)
    assert got == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT") and "8 MiB" in message, message


MALFORMED = [  # body -> words of the reason; Triton itself answers each with 500 (its JSON parser's errors)
    (b'{"inputs": [', "not valid JSON: Expecting value at line 1 column 13"),
    (b"hello", "not valid JSON"),
    (b'{"inputs": []} trailing', "not valid JSON: Extra data"),
    (b'{"inputs": NaN}', "NaN is not JSON"),
    (b'{"inputs": "\xff"}', "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"[1, 2, 3]", "is a list, not a JSON object"),
    (b"{}", 'has no "inputs"'),
    (b'{"inputs": 5}', '"inputs" is a number, not a list'),
    (b'{"inputs": [{"shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]}', 'inputs[0] has no "name"'),
    (b'{"inputs": [{"name": "IMAGE", "shape": "1", "datatype": "BYTES", "data": ["x"]}]}',
     "inputs[0].shape must be a list of integers >= 0"),
    (b'{"inputs": [{"name": "IMAGE", "shape": [-1, 1], "datatype": "BYTES", "data": ["x"]}]}',
     "inputs[0].shape must be a list of integers >= 0, got [-1, 1]"),
    (b'{"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": 5, "data": ["x"]}]}',
     "inputs[0].datatype is a number, not a string"),
    (b'{"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES", "data": [5]}]}',
     "inputs[0].data holds a number where a BYTES tensor takes strings"),
    (b'{"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES", "data": [null]}]}',
     "inputs[0].data holds null where a BYTES tensor takes strings"),
    (b'{"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}], "outputs": 3}',
     '"outputs" is a number, not a list'),
]


def test_a_malformed_json_body_is_a_400_naming_the_problem_never_a_500(svc):
    """Invalid JSON, JSON of the wrong shape or types, no "inputs": Triton calls each an internal error (500); through
    the front door each is a 400 with a one-line reason, the request counted against the Triton server that got it,
    and the service healthy after."""
    t0 = time.time()
    for body, words in MALFORMED:
        status, answer = service.send_raw(svc.http_url, body, svc.headers, model=svc.model)
        assert status == 400 and words in answer["error"] and "\n" not in answer["error"], (body[:60], status, answer)
    rows = svc.lb.access_rows(since=t0)
    assert len(rows) == len(MALFORMED) and {r["status"] for r in rows} == {400}
    assert {r["upstream"] for r in rows} <= set(svc.backends("http"))  # Triton's, not the check's, address
    # what the model refuses stays Triton's own 400
    request = {"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES", "data": ["not an image"]}]}
    status, answer = service.send_raw(svc.http_url, json.dumps(request).encode(), svc.headers, model=svc.model)
    assert status == 400 and "not an image file" in answer["error"]
    assert all(svc.health().values()) and svc.classify(ens.digits_pngs("test", 1)[0])[0][0][0] in ens.DIGIT_LABELS


def test_a_body_of_another_type_is_a_415_before_any_server_reads_it(svc):
    """Text, a raw JPEG or a file upload posted to the inference URL: nginx answers 415 naming the type it takes; a
    KServe v2 JSON request with a charset still passes (so does curl -d's form type), and the service stays healthy."""
    import urllib.error
    import urllib.request

    photo = ens.photo_jpegs(1)[0]
    url = f"{svc.url('http')}/v2/models/{svc.model}/infer"
    for ctype, body in [("text/plain", b"hello"), ("image/jpeg", photo), ("multipart/form-data; boundary=x", photo)]:
        req = urllib.request.Request(url, data=body, method="POST", headers={**svc.headers, "Content-Type": ctype})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        message = json.loads(err.value.read())["error"]
        assert err.value.code == 415 and "application/json" in message, (ctype, err.value.code, message)
    request = {"inputs": [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES", "data": ["not an image"]}]}
    req = urllib.request.Request(url, data=json.dumps(request).encode(), method="POST",
                                 headers={**svc.headers, "Content-Type": "application/json; charset=utf-8"})
    with pytest.raises(urllib.error.HTTPError) as err:  # reaches Triton: its 400 for the bytes, not nginx's 415
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and "not an image file" in err.value.read().decode()
    assert all(svc.health().values()) and svc.classify(ens.digits_pngs("test", 1)[0], "http")[0][0][0] in \
        ens.DIGIT_LABELS


def test_where_a_requests_time_goes_per_step_model_and_process(svc):
    """At two offered rates: Triton's stages per step model summed over both servers, the batch sizes, the CPU per
    process group, and the client's own lag, in one table, and its stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    from lab_utils.serving import breakdown

    with pytest.raises(ValueError, match="rates_rps"):
        breakdown.where_time_goes(svc, svc.target("http"), [])
    df = breakdown.where_time_goes(svc, svc.target("http"), [20, 60], duration_s=2.0, warmup_s=0.5)
    assert set(df["model"]) == set(svc.repo.models) and set(df["offered_rps"]) == {20, 60}
    for rate, rows in df.groupby("offered_rps"):
        rows = rows.set_index("model")
        ensemble, clf = rows.loc[svc.repo.service], rows.loc[svc.repo.classifier]
        assert ensemble["errors"] == 0 and ensemble["requests"] >= 0.8 * rate * 2, ensemble
        assert abs(clf["requests"] - ensemble["requests"]) <= 0.1 * ensemble["requests"] + 2, rows["requests"]
        assert clf["compute_infer_ms"] > 0 and clf["batch_avg"] >= 1 and rows.loc[svc.repo.preprocess,
                                                                                 "compute_infer_ms"] > 0
        assert ensemble["request_ms"] >= clf["compute_infer_ms"]
        assert ensemble["cpu_python_stubs_cores"] > 0 and ensemble["cpu_client_cores"] > 0
        assert ensemble["send_lag_p99_ms"] < 1000
    ax = breakdown.plot_split(df)
    assert len(ax.patches) == len(breakdown.STAGES) * int(df["batch_avg"].notna().sum())


def test_the_digits_service_holds_its_slo_as_lab_07_runs_it_in_quick_mode(svc):
    """Lab 07's SLO on the CPU tier, as its quick run measures it: 100 requests/s of open-loop load for 10 s through
    nginx, every answer checked, p95 under 100 ms, no error, every window stable (``capacity.meets_slo``).

    The schedule is dealt over two client processes: on CI's 2 cores, beside the other workers' notebooks and servers,
    one client process was starved into sending late (send lag p99 74-398 ms) and missed the first try in nearly
    every run, twice in a row in three runs. Two processes get twice one process's share of the cores; the service is
    the same. Up to four runs; four misses are a real fault."""
    from lab_utils.serving import capacity, load

    slo = tried(lambda: load.run_open_loop(svc.target("http", verify=True), 100, 10.0, warmup_s=2.0, timeout_s=10.0,
                                           processes=2),
                lambda r: capacity.meets_slo(r, 100.0)[0], tries=4,
                why=lambda r: f"{capacity.meets_slo(r, 100.0)[1]}; client send lag p99 {r.send_lag_p99_ms:.0f} ms")
    ok, why = capacity.meets_slo(slo, 100.0)
    assert ok, (why, str(slo), slo.error_messages)


def test_over_the_rate_limit_is_a_429_and_the_limit_comes_back(svc):
    good = ens.digits_pngs("test", 1)[0][0]
    svc.lb.options.update(rate_limit_rps=5, rate_burst=0)
    svc.lb.reload()
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda _: _attempt(svc, {"IMAGE": ens.image_batch([good])}), range(24)))
    finally:
        svc.lb.options.update(rate_limit_rps=service.RATE_LIMIT_RPS, rate_burst=service.RATE_BURST)
        svc.lb.reload()
    refused = [m for s, m in got if s == "429"]
    assert len(refused) >= 20 and "rate limit" in refused[0] and "5r/s" in refused[0], got  # at most ~1 passes
    assert all(s == "200" for s, _ in (_attempt(svc, {"IMAGE": ens.image_batch([good])}) for _ in range(10)))


def test_monitoring_scrapes_both_tritons_and_nginx(svc):
    _prometheus_here()
    mon = svc.own(sm.ServiceMonitoring(svc, for_s=1.0, window="5s").start())
    try:
        targets = mon.metrics.targets()
        assert sorted(targets["job"]) == ["nginx", "triton", "triton"] and (targets["health"] == "up").all()
        for _ in range(20):
            svc.classify(ens.digits_pngs("test", 1)[0])
        mon.metrics.wait_for('sum(nvlab_nginx_requests_total{status="200"}) >= 20', timeout_s=20)
        mon.metrics.wait_for("count(nvlab_nginx_upstream_requests_total) >= 2", timeout_s=10)  # both servers
        assert mon.metrics.value("sum(nvlab_nginx_request_duration_seconds_count)") >= 20
        assert set(mon.metrics.rules()["name"]) >= {"ServiceP95OverSLO", "ServiceErrors", "ServiceBackendDown"}
        for p in sm.SERVICE_PANELS:  # every dashboard expression evaluates against the live series
            mon.metrics.query(p.expression("5s"))
    finally:
        mon.stop()
        mon.stop()  # twice is fine
    assert not mon.alive() and not mon.exporter.alive()


def test_hot_update_under_load_has_no_failed_request(svc):
    ens.write_classifier_version(svc.repo.path, 2, epochs=3, seed=1)
    try:
        up = service.hot_update(svc, 2, rate_rps=50, duration_s=8.0, pause_s=0.8)
        assert up.result.errors_total == 0, up.result.error_messages
        assert up.states == {"1": "UNAVAILABLE: unloaded", "2": "READY"}, up.states
        # the windows that saw traffic: on a busy machine the switch can outlast the load, and the sampler's last
        # windows (until the switch ends) then hold no requests at all (seen in a nightly run)
        busy = up.timeline[(up.timeline["v1_rps"] + up.timeline["v2_rps"]) > 0]
        assert busy["v1_rps"].iloc[:3].sum() > 0 and busy["v2_rps"].iloc[-3:].sum() > 0, up.timeline
        assert busy["v1_rps"].iloc[-3:].sum() == 0, up.timeline
        assert [s["step"] for s in up.steps][-1].startswith("v1 unloaded") and len(up.steps) == 6
        assert np.isfinite(up.switch_p95_ms())
        assert svc.accuracy("http", n=100)["accuracy"] > 0.9
    finally:
        ens.set_served_versions(svc.repo.path, [1])
        for s in svc.servers:
            from lab_utils.serving import client as triton_client

            triton_client.load_model(s.grpc_url, ens.CLASSIFIER)
    with pytest.raises(FileNotFoundError, match="write version 7 first"):
        service.hot_update(svc, 7)


def test_stop_leaves_nothing_and_twice_is_fine():
    _require_all()
    s = service.Service(stop_grace_s=0.3).start()
    pids = [p for t in s.servers for p in procs.group_members(t.pid)] + procs.group_members(s.lb.pid)
    shm = [t._shm_prefix for t in s.servers]
    prefix, workdir = s.lb.prefix, s.workdir
    assert len(pids) >= 2 * 4 and all(list(Path("/dev/shm").glob(f"{p}*")) for p in shm)
    s.stop()
    s.stop()
    assert not [p for p in pids if procs.pid_alive(p)] and not nginx_mod.leftover_nginx(prefix)
    assert not any(list(Path("/dev/shm").glob(f"{p}*")) for p in shm) and not workdir.exists()
    assert not s.alive() and s not in triton_server.running_servers()


# --- a killed kernel ---------------------------------------------------------------------------------------------


def _gone(pids, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not [p for p in pids if procs.pid_alive(p)]:
            return True
        time.sleep(0.1)
    return False


def test_killed_kernel_leaves_no_nginx_triton_stub_or_shared_memory(svc):
    """A Jupyter kernel runs lab 07's setup (the service, its monitoring) and is SIGKILLed mid-lab: every Triton
    server and stub, nginx's master and workers, Prometheus and the exporter's thread end with it; `nvlab doctor`
    removes what no exit handler could (the folders and shared-memory regions named by the kernel's PID). Lab 08's
    champion and challenger are this same ``Service`` (``deploy.CanaryService``); its MLflow server's end with a
    killed owner is ``test_mlops.py::test_nothing_left_when_the_owner_is_killed``. The kernel's service serves the
    module's repository: a second build, which trains the classifier, was 5 of a start's 10 s."""
    import base64
    import pickle

    from nvlab import cli

    _require_all()
    _prometheus_here()
    jupyter_client = pytest.importorskip("jupyter_client")
    run_id = f"pytest-service-kill-{uuid.uuid4().hex[:8]}"
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env=dict(os.environ, **{notebooks.RUN_ID_ENV: run_id}))
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        repo = base64.b64encode(pickle.dumps(svc.repo)).decode()
        code = textwrap.dedent(f"""
            import base64, json, pickle
            from lab_utils import procs
            from lab_utils.monitoring import service_monitoring as sm
            from lab_utils.serving import ensemble as ens, service
            svc = service.Service(repo=pickle.loads(base64.b64decode({repo!r}))).start()
            mon = sm.start_monitoring(svc)
            svc.classify(ens.digits_pngs("test", 2)[0])
            pids = [p for t in svc.servers for p in procs.group_members(t.pid)] + procs.group_members(svc.lb.pid)
            pids += [mon.metrics.pid]
            nginx_prefixes, shm = [str(svc.lb.prefix)], [t._shm_prefix for t in svc.servers]
        """) + 'print("STATE", json.dumps({"pids": pids, "nginx": nginx_prefixes, "shm": shm}))\n'

        out = KernelOutput()
        reply = kc.execute_interactive(code, timeout=360, output_hook=out)
        assert reply["content"]["status"] == "ok", out.text
        state = json.loads(out.text.split("STATE", 1)[1].strip().splitlines()[0])
        pids = state["pids"]
        # 2 Triton servers with 3 stubs each, nginx's master and a worker, Prometheus
        assert len(pids) >= 2 * 4 + 2 and all(procs.pid_alive(p) for p in pids)
        assert all(list(Path("/dev/shm").glob(f"{p}*")) for p in state["shm"])
        kc.stop_channels()
        kernel_pid = km.provisioner.process.pid
        os.kill(kernel_pid, signal.SIGKILL)
        left = [p for p in pids if procs.pid_alive(p)] if not _gone(pids, 20.0) else []
        assert not left, f"still running after the kernel was killed: {left}"
        assert not any(nginx_mod.leftover_nginx(prefix) for prefix in state["nginx"])
        assert _gone([int(line.split()[0]) for line in notebooks.leftover_processes(run_id)], 10.0), \
            notebooks.leftover_processes(run_id)
        # the folders named by the kernel's PID: doctor removes them below, unless another test worker's next
        # temporary folder already swept them (their owner is dead)
        owned = list(Path(tempfile.gettempdir()).glob(f"nvlab-*-{kernel_pid}-*"))
        doctor = io.StringIO()
        with contextlib.redirect_stdout(doctor), contextlib.redirect_stderr(doctor):
            assert cli.main(["doctor"]) == 0, doctor.getvalue()
        assert not [p for p in owned if p.exists()], [p for p in owned if p.exists()]
        assert not any(list(Path("/dev/shm").glob(f"{p}*")) for p in state["shm"])
    finally:
        if km.is_alive():
            km.shutdown_kernel(now=True)


# The overload test is the file's last: its flood and the drain after it are the service tests' largest burst of
# CPU (22-26 s in CI). In the middle of the file it ran beside lab 08's good canary in each of three timed CI runs
# (the service group and lab 08's notebook both start first); in one of them the canary's latency guard read the
# good challenger's p95 at 70.9 ms against the champion's 19.6 ms and rolled it back (as in 3 earlier runs of
# about 40: 121-157 ms against 18-27 ms). Last, it runs beside lab 08's drift and retraining cells, which judge no
# latency. That alone did not end those rollbacks: a later run rolled a good challenger back the same way (89.8 ms
# against 11.2 ms).
FLOOD_BATCH = 16  # digits per request of the overload test (at most the ensemble's max_batch_size)
DRAIN_S = 20.0  # s: the flood's admitted work drains within this (twice, still falling); the flood alone: minutes


def test_an_overload_leaves_no_backlog(svc):
    """Far over capacity, Triton refuses what its bounded queues cannot hold (``ensemble.MAX_QUEUE``) instead of
    queueing minutes of work: straight after the overload, a light load is answered within the SLO, no error."""
    from lab_utils.serving.load import run_open_loop

    # the server's own endpoint: nginx's rate limit would refuse the flood before the queues see it. Every request is
    # a different batch of 16 digits: a repeated request is a response-cache hit that never queues, and one digit a
    # request left the queues short of full on a 2-core machine (CI: 12,088 requests at 3,000/s, none refused). Two
    # seconds are enough: alone, 5,844 of 5,976 requests were refused (4 s: 11,967 of 12,088, the same drain after)
    rng = np.random.default_rng(7)
    pngs = service.all_pngs()
    target = svc.target("grpc", pngs[:1])
    target.payloads = [{ens.IMAGE: ens.image_batch([pngs[i] for i in rng.choice(len(pngs), FLOOD_BATCH)])}
                       for _ in range(6_500)]
    target.batch = FLOOD_BATCH
    target.url, target.headers = triton_client.host_port(svc.servers[0].grpc_url), None
    flood = run_open_loop(target, 3000, 2.0, warmup_s=0.0, timeout_s=2.0)
    assert flood.errors_total > 0, flood  # it was an overload
    # what was admitted drains in seconds: a bounded queue holds at most MAX_QUEUE requests per step model (an
    # unbounded one held the whole flood, minutes of work). Triton's pending gauge can keep a few of the requests
    # whose clients gave up (2 s) counted for good (seen: 20 that never moved; its ensemble counts are known to drift,
    # triton-inference-server/server#6494), so the count must reach 0 or a remainder that no longer moves, under one
    # queue's bound; the light load after it shows whether anything still waits in front of new requests
    t0, seen = time.monotonic(), []
    while True:
        seen.append(sum(v for labels, v in metric_samples(svc.servers[0].metrics_url)
                        if labels["__name__"] == "nv_inference_pending_request_count"))
        if seen[-1] == 0 or (len(seen) >= 12 and len(set(seen[-12:])) == 1):  # 0, or 3 s unchanged
            break
        # a busy machine drains slower (a CI run beside other work: 56 -> 24 in the last 3 s of 20): a count still
        # falling gets up to twice DRAIN_S; an unbounded queue's thousands fail the bound below all the same
        waited = time.monotonic() - t0
        if waited >= 2 * DRAIN_S or (waited >= DRAIN_S and not (len(seen) >= 12 and seen[-1] < seen[-12])):
            break
        time.sleep(0.25)
    assert seen[-1] == 0 or (len(set(seen[-12:])) == 1 and seen[-1] < ens.MAX_QUEUE), \
        f"{seen[-1]} requests still pending {time.monotonic() - t0:.0f} s after the flood (last counts {seen[-12:]})"
    # measured again only when the client itself sent late (CI's 2 cores, seen: send lag p99 182 ms, p95 204 ms):
    # then its latencies say nothing of the server; a backlog behind an on-time client fails at once
    after = tried(lambda: run_open_loop(svc.target("grpc"), 40, 3.0, warmup_s=0.5, timeout_s=5.0),
                  lambda r: (r.errors_total == 0 and r.p95_ms < 100) or r.send_lag_p99_ms <= 20)
    assert after.errors_total == 0 and after.p95_ms < 100, (str(after), after.error_messages)
