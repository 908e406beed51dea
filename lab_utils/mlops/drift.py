"""Drift: the inputs (and the model's confidence) move away from what it was trained on, while every service metric
stays green. PSI and the two-sample KS statistic against the training reference, shifted digits to serve, an
exporter of the statistics for Prometheus, and alert rules checked by promtool.

- ``psi``, ``ks_statistic``, ``image_features`` (pixels 0..16, positions in px), ``confidence`` (max softmax).
- ``rotated``, ``noisy``, ``rescaled``, ``shift(images, kind, strength)``: raw digits (N, 8, 8) moved away.
- ``DriftReference``, ``drift_table``, ``DriftMonitor(reference, window=300)`` (images), ``DriftExporter(monitor)``.
- ``drift_rules(...)``, ``write_drift_rules(folder)`` (promtool-checked), ``write_drift_rules_test(folder)``.

Design notes: docs/internals.md#lab_utilsmlopsdriftpy"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from PIL import Image

from lab_utils.args import check_int, check_positive
from lab_utils.mlops.feedback import MetricsServer
from lab_utils.monitoring.prometheus import check_rules, write_config

# the statistics live with the service's preprocessing model, which computes them too (one implementation)
from lab_utils.serving.backend.drift_stats import (  # noqa: F401 (re-exported: the lab's names)
    FEATURES,
    INK,
    KS_METRIC,
    PSI_METRIC,
    WINDOW_METRIC,
    as_digits,
    bin_edges,
    image_features,
    ks_statistic,
    psi,
    reference_bins,
    sample,
)

_INPUT_DRIFT_WHY = ("the served images no longer look like the training data: check accuracy on labelled samples, "
                    "and retrain on recent data")
_CONFIDENCE_DRIFT_WHY = "the model is less sure of its answers than on held-out data"
PSI_ALERT = 0.25  # rule of thumb: < 0.1 stable, 0.1-0.25 moderate shift, > 0.25 significant
KS_ALERT = 0.2  # with a window of 300 images against 1440, KS's 1 % critical value is ~0.10
CONFIDENCE = "confidence"
SHIFTS = ("rotated", "noisy", "rescaled")
CONFIDENCE_METRIC = "nvlab_prediction_confidence"


def confidence(logits: Any) -> np.ndarray:
    """The top class's softmax probability per row of ``logits`` (N, classes): 0..1."""
    z = np.asarray(logits, dtype=float)
    if z.ndim != 2 or z.shape[1] < 2:
        raise ValueError(f"logits: shape (N, classes) expected, got {z.shape} (scores already softmaxed? then take "
                         "their max per row)")
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return (p.max(axis=1) / p.sum(axis=1)).astype(float)


# --- shifted digits ----------------------------------------------------------------------------------------------


def _pil_map(x: np.ndarray, fn: Any) -> np.ndarray:
    """``fn(the digit as a PIL float image)`` for each digit, clipped to 0..16."""
    out = np.empty_like(x)
    for i, img in enumerate(x):
        out[i] = np.asarray(fn(Image.fromarray(img.astype(np.float32), mode="F")), dtype=np.float32)
    return np.clip(out, 0, 16)


def rotated(images: Any, degrees: float = 30.0) -> np.ndarray:
    """Each digit rotated by ``degrees``, bilinear, about its centre."""
    return _pil_map(as_digits(images), lambda im: im.rotate(float(degrees), resample=Image.Resampling.BILINEAR))


def noisy(images: Any, sigma: float = 3.0, seed: int | None = 0) -> np.ndarray:
    """Gaussian noise of ``sigma`` (pixel units, of 16) added, clipped to 0..16."""
    check_positive(sigma, "sigma", "noisy", zero_ok=True, what="noise in pixel units (0..16 scale)")
    x = as_digits(images)
    return np.clip(x + np.random.default_rng(seed).normal(0, sigma, x.shape).astype(np.float32), 0, 16)


def rescaled(images: Any, factor: float = 0.6) -> np.ndarray:
    """Each digit zoomed by ``factor`` about the centre (< 1: smaller, as from a farther camera), bilinear."""
    if not (isinstance(factor, (int, float)) and 0.2 <= factor <= 3):
        raise ValueError(f"factor={factor!r}: a zoom between 0.2 and 3 (0.6 shrinks the digit to 60 %)")
    x = as_digits(images)
    h, w = x.shape[1:]
    cy, cx = (h - 1) / 2, (w - 1) / 2
    # PIL's affine maps output (u, v) to input (a u + b v + c, d u + e v + f): the inverse zoom about the centre
    coeffs = (1 / factor, 0, cx - cx / factor, 0, 1 / factor, cy - cy / factor)
    return _pil_map(x, lambda im: im.transform((w, h), Image.Transform.AFFINE, coeffs,
                                            resample=Image.Resampling.BILINEAR))


def shift(images: Any, kind: str, strength: float = 1.0, seed: int | None = 0) -> np.ndarray:
    """A shift by name: ``rotated`` (30 deg x strength), ``noisy`` (sigma 3 x strength), ``rescaled`` (zoom
    1 - 0.4 x strength)."""
    make = {"rotated": lambda: rotated(images, 30.0 * strength),
            "noisy": lambda: noisy(images, 3.0 * strength, seed),
            "rescaled": lambda: rescaled(images, 1 - 0.4 * strength)}
    if kind not in make:
        raise ValueError(f"kind={kind!r}: one of {SHIFTS}")
    return make[kind]()


# --- the reference and the report --------------------------------------------------------------------------------


@dataclass
class DriftReference:
    """The training data's features (and the model's confidences on held-out data), with PSI's bin edges."""

    features: dict[str, np.ndarray]
    edges: dict[str, np.ndarray]

    @classmethod
    def from_images(cls, images: Any, confidences: Any = None, bins: int = 10) -> DriftReference:
        feats = image_features(images)
        if confidences is not None:
            feats[CONFIDENCE] = sample(confidences, "confidences")
        return cls(feats, {k: bin_edges(v, bins) for k, v in feats.items()})

    def statistics(self, images: Any, confidences: Any = None) -> dict[str, dict[str, float]]:
        """{feature: {"psi": ..., "ks": ...}} of a batch against this reference."""
        feats = image_features(images)
        if confidences is not None and CONFIDENCE in self.features:
            feats[CONFIDENCE] = sample(confidences, "confidences")
        return {k: {"psi": psi(self.features[k], v, edges=self.edges[k]), "ks": ks_statistic(self.features[k], v)}
                for k, v in feats.items() if k in self.features}


def drift_table(reference: DriftReference, images: Any, confidences: Any = None) -> pd.DataFrame:
    """One row per feature: PSI, KS, and whether each is over its alert threshold."""
    stats = reference.statistics(images, confidences)
    return pd.DataFrame([{"feature": k, "psi": s["psi"], "ks": s["ks"], "psi_alert": s["psi"] > PSI_ALERT,
                          "ks_alert": s["ks"] > KS_ALERT} for k, s in stats.items()])


class DriftMonitor:
    """A sliding window of the last ``window`` images (and confidences) seen, compared with the reference."""

    def __init__(self, reference: DriftReference, window: int = 300):
        check_int(window, "window", "DriftMonitor", minimum=10, what="recent images compared; 300 is usual")
        self.reference, self.window = reference, window
        self._images: collections.deque[np.ndarray] = collections.deque(maxlen=window)
        self._conf: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self.seen = 0
        self._confidence_hist: Any = None  # a prometheus_client Histogram, set by DriftExporter

    def observe(self, images: Any, confidences: Any = None) -> None:
        """Add served images (raw digits, (N, 8, 8)) and, optionally, the model's confidence on each."""
        x = as_digits(images)
        conf = None if confidences is None else sample(confidences, "confidences")
        if conf is not None and len(conf) != len(x):
            raise ValueError(f"observe: {len(x)} images but {len(conf)} confidences; one per image")
        with self._lock:
            self._images.extend(x)
            self.seen += len(x)
            if conf is not None:
                self._conf.extend(conf.tolist())
                if self._confidence_hist is not None:
                    for c in conf:
                        self._confidence_hist.observe(float(c))

    def size(self) -> int:
        with self._lock:
            return len(self._images)

    def statistics(self) -> dict[str, dict[str, float]]:
        """PSI and KS per feature over the window ({} before any image)."""
        with self._lock:
            if not self._images:
                return {}
            x = np.stack(list(self._images))
            conf = np.array(self._conf) if len(self._conf) else None
        return self.reference.statistics(x, conf)


class _DriftCollector:
    """Computes the statistics when Prometheus scrapes (a window of 300 images: about a millisecond)."""

    def __init__(self, monitor: DriftMonitor, features: Sequence[str] | None = None):
        self.monitor, self.features = monitor, features

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        stats = self.monitor.statistics()
        p = GaugeMetricFamily(PSI_METRIC, "population stability index against the training reference",
                              labels=["feature"])
        k = GaugeMetricFamily(KS_METRIC, "two-sample KS statistic against the training reference", labels=["feature"])
        for feature, s in stats.items():
            if self.features is not None and feature not in self.features:
                continue
            p.add_metric([feature], s["psi"])
            k.add_metric([feature], s["ks"])
        yield p
        yield k
        yield GaugeMetricFamily(WINDOW_METRIC, "images in the drift window", value=self.monitor.size())


class DriftExporter(MetricsServer):
    """``monitor``'s statistics served for Prometheus (on a free port): PSI and KS per feature, the window's size,
    and the histogram of prediction confidence."""

    def __init__(self, monitor: DriftMonitor, *, features: Sequence[str] | None = None):
        from prometheus_client import Histogram

        # features: which statistics to export (None: all; [CONFIDENCE] where the service's preprocessing step
        # exports the inputs' own)
        super().__init__([_DriftCollector(monitor, features)])
        self.monitor = monitor
        monitor._confidence_hist = Histogram(CONFIDENCE_METRIC, "top-class softmax probability of served predictions",
                                             buckets=(0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0), registry=self.registry)


# --- alert rules ---------------------------------------------------------------------------------------------------


def drift_rules(*, psi_threshold: float = PSI_ALERT, ks_threshold: float = KS_ALERT, for_s: int = 10,
                features: Sequence[str] = ("pixels", "mean_intensity", "ink_fraction", "center_row", "center_col"),
                min_window: int = 50) -> dict[str, Any]:
    """Alerting rules: ``InputDrift`` (PSI of an input feature over ``psi_threshold``), ``ConfidenceDrift`` (KS of
    prediction confidence over ``ks_threshold``), each held ``for_s`` seconds and only once ``min_window`` images
    are in the window (a handful of images is no evidence)."""
    check_positive(psi_threshold, "psi_threshold", "drift_rules", what="PSI (0.25 is the usual 'significant shift')")
    if not (isinstance(ks_threshold, (int, float)) and 0 < ks_threshold < 1):
        raise ValueError(f"ks_threshold={ks_threshold!r}: between 0 and 1")
    check_int(for_s, "for_s", "drift_rules", minimum=0, what="whole seconds")
    feats = "|".join(features)
    enough = f"on() ({WINDOW_METRIC} >= {min_window})"
    return {"groups": [{"name": "nvlab_drift", "rules": [
        {"alert": "InputDrift",
         "expr": f'max by (feature) ({PSI_METRIC}{{feature=~"{feats}"}}) > {psi_threshold:g} and {enough}',
         "for": f"{for_s}s", "labels": {"severity": "warning"},
         "annotations": {"summary": "input drift: PSI of {{ $labels.feature }} is {{ $value | printf \"%.2f\" }}",
                         "description": _INPUT_DRIFT_WHY}},
        {"alert": "ConfidenceDrift",
         "expr": f'max by (feature) ({KS_METRIC}{{feature="{CONFIDENCE}"}}) > {ks_threshold:g} and {enough}',
         "for": f"{for_s}s", "labels": {"severity": "warning"},
         "annotations": {"summary": "prediction confidence drifted: KS {{ $value | printf \"%.2f\" }}",
                         "description": _CONFIDENCE_DRIFT_WHY}}]}]}


def write_drift_rules(folder: str | Path, check: bool = True, **kwargs: Any) -> Path:
    """``drift_rules(**kwargs)`` written as ``drift_rules.yml`` (JSON, which YAML includes) in ``folder``, checked by
    ``promtool check rules`` when ``check`` and promtool is installed (``ConfigError`` with promtool's words)."""
    return write_config(drift_rules(**kwargs), Path(folder) / "drift_rules.yml", check_rules if check else None)


def write_drift_rules_test(folder: str | Path, rules: str | Path, for_s: int = 10) -> Path:
    """A ``promtool test rules`` file for ``rules``: a drifting feature fires ``InputDrift`` after ``for_s`` s, a
    stable one and a too-small window fire nothing, drifting confidence fires ``ConfidenceDrift``."""
    # series every 15 s, the drift from 30 s on: pending at 30 s, firing at the first evaluation >= for_s later
    after = 30 + 15 * (for_s // 15 + 1) + 15
    test = {"rule_files": [str(Path(rules).resolve())], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [
            {"series": f'{PSI_METRIC}{{feature="pixels"}}', "values": "0.02 0.03 0.6x30"},
            {"series": f'{PSI_METRIC}{{feature="ink_fraction"}}', "values": "0.01x32"},
            {"series": f'{KS_METRIC}{{feature="{CONFIDENCE}"}}', "values": "0.05 0.05 0.4x30"},
            {"series": WINDOW_METRIC, "values": "300x32"}],
        "alert_rule_test": [
            {"eval_time": "15s", "alertname": "InputDrift", "exp_alerts": []},
            {"eval_time": f"{after}s", "alertname": "InputDrift", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "feature": "pixels"},
                "exp_annotations": {"summary": "input drift: PSI of pixels is 0.60",
                                    "description": _INPUT_DRIFT_WHY}}]},
            {"eval_time": f"{after}s", "alertname": "ConfidenceDrift", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "feature": CONFIDENCE},
                "exp_annotations": {"summary": "prediction confidence drifted: KS 0.40",
                                    "description": _CONFIDENCE_DRIFT_WHY}}]},
        ]}, {
        "interval": "15s",
        "input_series": [{"series": f'{PSI_METRIC}{{feature="pixels"}}', "values": "0.6x32"},
                         {"series": WINDOW_METRIC, "values": "10x32"}],
        "alert_rule_test": [{"eval_time": f"{after}s", "alertname": "InputDrift", "exp_alerts": []}]}]}
    return write_config(test, Path(folder) / "drift_rules_test.yml")
