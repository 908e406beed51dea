"""What lab 08's checks share: the service's model names, and what the lab binds the checks to (its tracking
server, its A/B result)."""

from __future__ import annotations

from typing import Any

from lab_utils.monitoring import prometheus

SERVICE_MODEL = "digits_service"
DECOY_MODEL = "digits_preprocess"  # another model on the same Triton servers: its requests are not the service's
Q2_WINDOW = "3s"


VARIANTS = ("champion", "challenger")


# --- what the checks are bound to -----------------------------------------------------------------------------

_BOUND: dict[str, Any] = {}


def use_tracking(server: Any) -> None:
    """The MLflow tracking server (a started ``TrackingServer``) q1 logs its runs to."""
    _BOUND["tracking"] = server
    print(f"q1 logs to the tracking server at {server.url}")


def use_ab(result: Any) -> None:
    """The A/B result (``abtest.AbResult``) q5 compares the verdict with."""
    _BOUND["ab"] = result
    print(f"q5 checks the verdict against the measured result: B - A = {result.test.diff:+.2%}, 95 % interval "
          f"[{result.boot_low:+.2%}, {result.boot_high:+.2%}]")


def _prometheus_missing() -> str | None:
    why = prometheus.missing()
    return f"this check runs your code on a real Prometheus: {why}" if why else None
