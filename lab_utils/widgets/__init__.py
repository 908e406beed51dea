"""Interactive panels (ipywidgets) for the labs, and progress bars for long cells.

Each panel has one entry point a notebook calls in one line: :func:`roofline_explorer` (lab 01),
:func:`knob_panel` (lab 04), :func:`live_view` (lab 05), :func:`quiz_panel` (lab 09). In JupyterLab the panel is
shown and its controls re-run the measurement; headless (see :func:`interactive`) the same call prints the result
of the panel's initial values instead, so papermill, nbval and the tests see text, not a widget.

Importing this package imports neither torch nor ipywidgets: each panel's module is loaded on first use."""

from __future__ import annotations

import importlib
from typing import Any

from lab_utils.widgets.core import HEADLESS_ENV, ProgressBar, interactive, progress, progress_bar, show

__all__ = ["HEADLESS_ENV", "interactive", "progress", "progress_bar", "ProgressBar", "show", "roofline_explorer",
           "knob_panel", "live_view", "quiz_panel"]


# Each panel's module is imported on first use (lazy: roofline pulls torch; knobs, live and quiz_view pandas, knobs
# the serving stack too).
_PANELS = {"roofline_explorer": "roofline", "knob_panel": "knobs", "live_view": "live", "quiz_panel": "quiz_view"}


def __getattr__(name: str) -> Any:
    if name in _PANELS:
        return getattr(importlib.import_module(f"lab_utils.widgets.{_PANELS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
