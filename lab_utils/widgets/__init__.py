"""Interactive panels (ipywidgets) for the labs, and progress bars for long cells.

Each panel has one entry point a notebook calls in one line: :func:`roofline_explorer` (lab 01),
:func:`knob_panel` (lab 04), :func:`live_view` (lab 05), :func:`quiz_panel` (lab 09). In JupyterLab the panel is
shown and its controls re-run the measurement; headless (see :func:`interactive`) the same call prints the result
of the panel's initial values instead, so papermill, nbval and the tests see text, not a widget.

Importing this package imports neither torch nor ipywidgets: each panel's module is loaded on first use."""

from __future__ import annotations

from typing import Any

from lab_utils.widgets.core import HEADLESS_ENV, ProgressBar, interactive, progress, progress_bar, show

__all__ = ["HEADLESS_ENV", "interactive", "progress", "progress_bar", "ProgressBar", "show", "roofline_explorer",
           "knob_panel", "live_view", "quiz_panel"]


def roofline_explorer(*args: Any, **kwargs: Any) -> Any:
    """Lab 01: pick a dtype and a size, measure the matmul here, see it beside the H200 reference points."""
    from lab_utils.widgets.roofline import roofline_explorer as make  # lazy: pulls torch

    return make(*args, **kwargs)


def knob_panel(*args: Any, **kwargs: Any) -> Any:
    """Lab 04: Triton's batching, delay, instance and concurrency knobs; Apply redeploys, Measure runs a load."""
    from lab_utils.widgets.knobs import knob_panel as make  # lazy: pulls pandas and the serving stack

    return make(*args, **kwargs)


def live_view(*args: Any, **kwargs: Any) -> Any:
    """Lab 05: QPS, p95 and queue time from Prometheus while a load runs (a context manager)."""
    from lab_utils.widgets.live import live_view as make  # lazy: pulls pandas

    return make(*args, **kwargs)


def quiz_panel(*args: Any, **kwargs: Any) -> Any:
    """Lab 09: the quiz one question at a time, graded on Submit."""
    from lab_utils.widgets.quiz_view import quiz_panel as make  # lazy: pulls pandas

    return make(*args, **kwargs)
