"""Drift statistics of served digits, in one place for the lab (``lab_utils.mlops.drift``) and for the service's
preprocessing model, which computes them on the images it decodes and exports them as Triton custom metrics.

Copied beside the preprocessing model's ``model.py`` as ``nvlab_drift.py``: NumPy only, nothing from ``lab_utils``.
The model keeps ``reference_bins`` (each feature's bin edges and reference shares: a JSON parameter) and a ``Window``
of the last images' features.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import numpy as np

INK = 4.0  # a pixel above 4 of 16 counts as ink
EPS = 1e-4  # floor for empty bins' shares: PSI's log would be infinite
FEATURES = ("pixels", "mean_intensity", "ink_fraction", "center_row", "center_col")
PSI_METRIC, KS_METRIC, WINDOW_METRIC = "nvlab_drift_psi", "nvlab_drift_ks", "nvlab_drift_window_images"


def sample(x: Any, name: str) -> np.ndarray:
    """``x`` as a flat float array, refused when empty or not finite."""
    a = np.asarray(x, dtype=float).ravel()
    if a.size == 0:
        raise ValueError(f"{name}: no values (give at least one)")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: NaN or infinite values; clean them first")
    return a


def as_digits(images: Any, name: str = "images") -> np.ndarray:
    """Raw digits as (N, 8, 8) float32 (accepts (N, 1, 8, 8) and one (8, 8) image)."""
    x = np.asarray(images, dtype=np.float32)
    if x.ndim == 4 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim == 2 and x.shape == (8, 8):
        x = x[None]
    if x.ndim != 3 or x.shape[0] == 0 or x.shape[1:] != (8, 8):
        raise ValueError(f"{name}: raw digits of shape (N, 8, 8), values 0..16; got shape {x.shape}")
    return x


def image_features(images: Any) -> dict[str, np.ndarray]:
    """Per-image statistics of raw digits (N, 8, 8): mean intensity (0..16), ink fraction (share of pixels above
    4), centre of mass (row, col in px); and ``pixels``, every pixel value."""
    x = as_digits(images)
    mass = x.sum(axis=(1, 2))
    safe = np.where(mass > 0, mass, 1.0)
    rows = np.arange(x.shape[1], dtype=np.float32)[None, :, None]
    cols = np.arange(x.shape[2], dtype=np.float32)[None, None, :]
    mid_r, mid_c = (x.shape[1] - 1) / 2, (x.shape[2] - 1) / 2
    return {"pixels": x.ravel(), "mean_intensity": x.mean(axis=(1, 2)), "ink_fraction": (x > INK).mean(axis=(1, 2)),
            "center_row": np.where(mass > 0, (x * rows).sum(axis=(1, 2)) / safe, mid_r),
            "center_col": np.where(mass > 0, (x * cols).sum(axis=(1, 2)) / safe, mid_c)}


def bin_edges(reference: Any, bins: int = 10) -> np.ndarray:
    """Inner bin edges at the reference's quantiles (equal shares), duplicates dropped (discrete values such as
    pixels 0..16 give fewer bins); the outer bins reach to -inf and +inf."""
    ref = sample(reference, "reference")
    if not (isinstance(bins, int) and bins >= 2):
        raise ValueError(f"bins={bins!r}: an integer >= 2 (10 is usual)")
    qs = np.quantile(ref, np.linspace(0, 1, bins + 1)[1:-1])
    return np.unique(qs)


def shares(x: Any, edges: Any) -> np.ndarray:
    """Each bin's share of ``x`` (bins right-closed between ``edges``), floored at ``EPS``."""
    e = np.asarray(edges, dtype=float)
    idx = np.searchsorted(e, np.asarray(x, dtype=float), side="right")
    counts = np.bincount(idx, minlength=len(e) + 1).astype(float)
    return np.maximum(counts / counts.sum(), EPS)


def psi_from_shares(r: np.ndarray, c: np.ndarray) -> float:
    """Population stability index of shares ``c`` against reference shares ``r``: sum (c - r) ln(c / r)."""
    return float(np.sum((c - r) * np.log(c / r)))


def psi(reference: Any, current: Any, bins: int = 10, edges: Any = None) -> float:
    """Population stability index: sum over bins of (c - r) ln(c / r), r and c the reference's and the current
    sample's shares per bin (bins at the reference's quantiles unless ``edges``). 0 for the same distribution."""
    ref, cur = sample(reference, "reference"), sample(current, "current")
    e = bin_edges(ref, bins) if edges is None else np.asarray(edges, dtype=float)
    return psi_from_shares(shares(ref, e), shares(cur, e))


def ks_statistic(reference: Any, current: Any) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs (0..1)."""
    ref, cur = np.sort(sample(reference, "reference")), np.sort(sample(current, "current"))
    values = np.concatenate([ref, cur])
    cdf_ref = np.searchsorted(ref, values, side="right") / len(ref)
    cdf_cur = np.searchsorted(cur, values, side="right") / len(cur)
    return float(np.max(np.abs(cdf_ref - cdf_cur)))


def reference_bins(features: Mapping[str, Any], bins: int = 10) -> dict[str, dict[str, list[float]]]:
    """``{feature: {"edges": [...], "shares": [...]}}`` of reference features: all PSI needs, small enough for a
    model's configuration parameter (JSON)."""
    out = {}
    for k, v in features.items():
        e = bin_edges(v, bins)
        out[k] = {"edges": [float(a) for a in e], "shares": [float(a) for a in shares(v, e)]}
    return out


class Window:
    """The features of the last ``size`` images seen, and their PSI against reference bins (``reference_bins``)."""

    def __init__(self, bins: Mapping[str, Mapping[str, Any]], size: int = 200):
        if not (isinstance(size, int) and size >= 10):
            raise ValueError(f"drift window size={size!r}: the number of recent images compared, >= 10")
        unknown = sorted(set(bins) - set(FEATURES))
        if unknown:
            raise ValueError(f"drift reference features {unknown}: not among {FEATURES}")
        self.bins = {k: (np.asarray(b["edges"], float), np.asarray(b["shares"], float)) for k, b in bins.items()}
        self.size = size
        self._images: collections.deque[np.ndarray] = collections.deque(maxlen=size)

    def observe(self, images: Any) -> None:
        self._images.extend(as_digits(images))

    def __len__(self) -> int:
        return len(self._images)

    def psi(self) -> dict[str, float]:
        """PSI per feature over the window ({} before any image)."""
        if not self._images:
            return {}
        feats = image_features(np.stack(list(self._images)))
        return {k: psi_from_shares(r, shares(feats[k], e)) for k, (e, r) in self.bins.items()}
