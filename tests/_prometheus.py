"""Tests that need Prometheus (and promtool): skip without them, fail under ``NVLAB_REQUIRE_PROMETHEUS=1`` (CI)."""

from __future__ import annotations

import pytest

from lab_utils.monitoring import prometheus


def require_prometheus(*binaries: str) -> None:
    """Skip (or fail where Prometheus is required) unless ``binaries`` (default: prometheus and promtool) are here."""
    why = prometheus.missing(*binaries)
    if why is None:
        return
    if prometheus.required():
        pytest.fail(f"{prometheus.REQUIRE_ENV}=1 but {why}")
    pytest.skip(why)
