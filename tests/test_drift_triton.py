"""Drift statistics from the service's preprocessing step: the python backend computes the PSI of the digits it
decodes against the training reference and exports it as Triton custom metrics. Held-out digits read low, rotated
ones high, on Triton's own metrics endpoint."""

from __future__ import annotations

import re
import time
import urllib.request

from _triton import require_service

from lab_utils.mlops import deploy, drift, tracking
from lab_utils.procs import temporary_folder
from lab_utils.serving import ensemble as ens


def _psi(metrics_url: str) -> dict[str, float]:
    """``{feature: PSI}`` from a Triton metrics endpoint (one preprocessing instance)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^{drift.PSI_METRIC}\{{feature="(\w+)",instance="[^"]+"\}} (\S+)$', text, re.M)}


def _window(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    m = re.search(rf"^{drift.WINDOW_METRIC}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _latency_counts(metrics_url: str, model: str) -> dict[str, float]:
    """``{version: requests}`` in Triton's latency summary of ``model`` (the series the canary's p95 reads), once it
    counts a request: Triton records one after its answer is sent (a CI run read 0 right after an answer)."""
    deadline = time.monotonic() + 10
    while True:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        counts = {m.group(1): float(m.group(2)) for m in re.finditer(
            rf'^nv_inference_request_summary_us_count\{{model="{model}",version="(\d+)"\}} (\S+)$', text, re.M)}
        if any(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def test_preprocessing_step_exports_input_drift():
    require_service()
    data = tracking.digits_data()
    result = tracking.train_digits(data["x_train"], data["y_train"], data["x_test"], data["y_test"], epochs=1)
    bins = drift.reference_bins(drift.image_features(data["x_train"]))
    with temporary_folder("drift-test") as folder:
        onnx = ens.export_classifier(result.model, folder)
        with deploy.CanaryService(onnx, drift_reference=bins, drift_window=200, stop_grace_s=0.3) as svc:
            url, metrics = svc.server("champion").grpc_url, svc.server("champion").metrics_url
            held_out = [ens.encode_png(x) for x in data["x_test"][:200]]
            for i in range(0, 200, 50):
                ens.classify(url, held_out[i:i + 50])
            assert _window(metrics) == 200
            calm = _psi(metrics)
            assert set(calm) == set(drift.FEATURES), calm
            # held-out digits, through the PNG round trip, stay under the alert (PSI's small-sample bias with 200
            # images and 10 bins is ~0.05; the round trip itself once put a pixel of 4 across the ink threshold)
            assert max(calm.values()) < drift.PSI_ALERT / 2, calm
            rotated = [ens.encode_png(x) for x in drift.shift(data["x_test"][:200], "rotated", 1.0)]
            for i in range(0, 200, 50):
                ens.classify(url, rotated[i:i + 50])
            shifted = _psi(metrics)
            assert shifted["ink_fraction"] > max(drift.PSI_ALERT, 4 * calm["ink_fraction"]), (calm, shifted)

            # a deployed challenger starts with a latency summary of its own: the previous classifier's requests
            # (Triton's summary keeps the last 60 s of them) are not judged as the new one's
            chall = svc.server("challenger")
            ens.classify(chall.grpc_url, held_out[:50])
            service = svc.repos["challenger"].service
            assert _latency_counts(chall.metrics_url, service) == {"1": 1.0}
            assert svc.deploy_challenger(onnx) == 2
            ens.classify(chall.grpc_url, held_out[:50])
            assert _latency_counts(chall.metrics_url, service) == {"1": 1.0}
