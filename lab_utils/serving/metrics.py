"""The Prometheus text exposition format, parsed: what Triton's ``/metrics`` (and any exporter) serves.

Below ``monitoring`` so that serving code (Triton's cache counters, lab 07's service) can read a metrics page
without the Prometheus server's module; ``lab_utils.monitoring.prometheus`` re-exports these names.
"""

from __future__ import annotations

import re
import urllib.request

__all__ = ["parse_exposition", "metric_types", "metric_samples"]


def parse_exposition(text: str) -> list[tuple[dict[str, str], float]]:
    """Samples of a Prometheus text exposition: ``({"__name__": ..., labels...}, value)``, with
    prometheus_client's parser (the one the Python client ships)."""
    from prometheus_client.parser import text_string_to_metric_families

    # The parser names counter samples "<family>_total" even where the text has no suffix (Triton's counters
    # have none); Prometheus keeps the exposed name, and so does this.
    exposed = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?=[{\s])", text, flags=re.M))
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name
            if name not in exposed and name.endswith("_total") and name[:-6] in exposed:
                name = name[:-6]
            out.append(({"__name__": name, **s.labels}, float(s.value)))
    return out


def metric_types(text: str) -> dict[str, str]:
    """{family: type} from a text exposition's ``# TYPE`` lines (counter, gauge, summary, histogram...)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


def metric_samples(metrics_url: str, timeout_s: float = 5.0) -> list[tuple[dict[str, str], float]]:
    """The samples a metrics page serves now: ``({"__name__": ..., labels...}, value)``."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
        return parse_exposition(r.read().decode())
