"""Labelled feedback for Prometheus, served from a thread of this process (prometheus_client): the counters a
canary's accuracy guard reads; and ``MetricsServer``, the base the drift exporter builds on.

``MetricsServer(collectors, port=None)``: a registry with ``collectors`` served at ``http://127.0.0.1:PORT/metrics``
(a free port unless given); ``stop()`` shuts it down (safe twice, and at interpreter exit).
``FeedbackExporter``: ``record(variant, predicted, label)`` counts labelled answers per variant as
``nvlab_feedback_total{variant}`` and ``nvlab_feedback_correct_total{variant}``; accuracy over a window is
``increase(correct) / increase(total)`` (``canary.QUERIES["accuracy"]``)."""

from __future__ import annotations

import threading
from typing import Any

# the base lives with the other exporters (monitoring); re-exported here for lab 08's modules
from lab_utils.monitoring.gpu_exporter import MetricsServer  # noqa: F401

FEEDBACK_TOTAL = "nvlab_feedback_total"  # counter: labelled requests answered, per variant
FEEDBACK_CORRECT = "nvlab_feedback_correct_total"  # counter: of those, answered with the right label
VARIANT_LABEL = "variant"


class FeedbackExporter(MetricsServer):
    """Labelled feedback per variant: requests whose true label is known, and how many the variant got right."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        super().__init__()
        self.variants = ("champion", "challenger")
        # prometheus_client adds "_total" to a counter's name: these expose FEEDBACK_TOTAL and FEEDBACK_CORRECT
        self._total = Counter(FEEDBACK_TOTAL.removesuffix("_total"), "labelled requests answered",
                              [VARIANT_LABEL], registry=self.registry)
        self._correct = Counter(FEEDBACK_CORRECT.removesuffix("_total"), "labelled requests answered correctly",
                                [VARIANT_LABEL], registry=self.registry)
        for v in self.variants:  # every series exists from the first scrape: increase() has a start value
            self._total.labels(v)
            self._correct.labels(v)
        self._lock = threading.Lock()
        self.counts = {v: [0, 0] for v in self.variants}  # variant -> [total, correct], for tables

    def record(self, variant: str, predicted: Any, label: Any) -> bool:
        """Count one labelled answer of ``variant``; returns whether it was right (compared as strings)."""
        if variant not in self.counts:
            raise ValueError(f"variant={variant!r}: not one of {self.variants}")
        ok = str(predicted) == str(label)
        with self._lock:
            self._total.labels(variant).inc()
            self.counts[variant][0] += 1
            if ok:
                self._correct.labels(variant).inc()
                self.counts[variant][1] += 1
        return ok
