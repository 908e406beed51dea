"""Lab 07's checks run against the lab's service: ``use_service(service)`` names it, ``bound_service()`` hands it to
a check (or says why there is none)."""

from __future__ import annotations

from typing import Any

from lab_utils.exercises.framework import NotApplicable

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
