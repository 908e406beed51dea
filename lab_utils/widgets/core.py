"""When a panel is interactive, how it is shown, and the progress bars of the long loops and callbacks.

The rule, in one line: a panel is interactive in an IPython kernel unless ``NVLAB_HEADLESS=1`` or the course's own
executors run the notebook (``nvlab run`` with papermill and the test suite's nbval set ``NVLAB_RUN_ID``)."""

from __future__ import annotations

import html
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from lab_utils.args import check_int, check_positive
from lab_utils.procs import env_flag

HEADLESS_ENV = "NVLAB_HEADLESS"  # 1: print instead of showing widgets (papermill run by hand, a script)
# Set by nvlab.ops.notebooks and the test suite for every kernel they start (a layer above: named, not imported).
_RUN_ID_ENV = "NVLAB_RUN_ID"


def _in_kernel() -> bool:
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return bool(shell) and getattr(shell, "kernel", None) is not None


def interactive() -> bool:
    """True when widgets can be seen and used: see the module docstring for the rule."""
    if env_flag(HEADLESS_ENV) or os.environ.get(_RUN_ID_ENV):
        return False
    return _in_kernel()


def show(panel: Any) -> Any:
    """Display ``panel.widget`` when :func:`interactive`, else print ``panel.headless()`` (its initial result).

    Returns the panel, so a notebook (or a test) can drive it further; it displays as nothing itself."""
    if interactive():
        from IPython.display import display

        display(panel.widget)
    else:
        panel.headless()
    return panel


class Panel:
    """Base of the panels: ``widget`` is what JupyterLab shows, ``headless()`` prints the same result as text.

    A returned panel shows nothing of its own when it ends a cell (the widget or the text is already out)."""

    widget: Any
    status: Any  # the ipywidgets.HTML line the panel reports in

    def headless(self) -> None:
        raise NotImplementedError

    def _guard(self, action: Callable[[], Any]) -> Any:
        """``action()``; a failure (a refused choice, a failed measurement) is shown in ``status``, not lost in a
        callback's log, and the panel stays usable (None then)."""
        try:
            return action()
        except Exception as err:  # noqa: BLE001 (shown to the student)
            self.status.value = error_html(err)
            return None

    def _ipython_display_(self) -> None:
        pass


def error_html(err: BaseException) -> str:
    """An error as a panel shows it (red, escaped): a callback's exception would otherwise go to the kernel's log,
    where the student does not look."""
    return f"<span style='color:#b00'>{type(err).__name__}: {html.escape(str(err))}</span>"


def _check_bar(total: Any, desc: Any, where: str) -> None:
    if total is not None:
        check_int(total, "total", where, minimum=0, what="the number of steps, or None")
    if not isinstance(desc, str):
        raise TypeError(f"{where}(desc={desc!r}): a label, a str")


def progress(iterable: Iterable[Any], total: int | None = None, desc: str = "") -> Iterator[Any]:
    """``iterable`` with a progress bar: tqdm's (a widget in JupyterLab) when :func:`interactive`, else one line when
    the loop ends (``desc: N steps in S s``, seconds of wall time). ``total``: the number of items expected (None:
    unknown, or ``len(iterable)``). The hook the long loops of ``lab_utils`` take as ``progress=``.

    Steps count when the loop comes back for the next item, as tqdm counts them; a loop left early (``break``, an
    error) still ends its bar or prints its line."""
    _check_bar(total, desc, "progress")
    if not isinstance(iterable, Iterable):
        raise TypeError(f"progress({type(iterable).__name__}): needs something to loop over (a list, a range, ...)")
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    # checked here, at the call, not at the first step of the loop (a generator's body runs only then)
    return _steps(iterable, total, desc)


def _steps(iterable: Iterable[Any], total: int | None, desc: str) -> Iterator[Any]:
    with ProgressBar(total, desc, every_s=math.inf) as bar:  # closed also when the consumer stops early
        for item in iterable:
            yield item
            bar.update()


class ProgressBar:
    """A progress display driven by calls instead of a loop (see :func:`progress_bar`): ``update()`` per step,
    ``close()`` at the end (twice is harmless); a context manager that closes on leaving the block."""

    def __init__(self, total: int | None, desc: str, every_s: float):
        self.total, self.desc, self.every_s = total, desc, every_s
        self.n, self.closed = 0, False
        self._t0 = self._last = time.perf_counter()
        self._tqdm: Any = None
        if interactive():
            from tqdm.auto import tqdm

            self._tqdm = tqdm(total=total, desc=desc, leave=False)

    def update(self, step: Any = 1) -> None:
        """Advance by ``step`` when it is a whole number; anything else (a load window, a step's record: what an
        ``on_window=`` or ``on_step=`` callback passes) counts as one step, so ``on_window=bar.update`` works.
        Headless, a line ``desc: n/total after S s`` at most every ``every_s`` seconds."""
        if self.closed:
            return
        n = step if isinstance(step, int) and not isinstance(step, bool) else 1
        if n < 0:
            raise ValueError(f"ProgressBar.update({step!r}): steps done, a whole number >= 0")
        self.n += n
        if self._tqdm is not None:
            self._tqdm.update(n)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            of = f"/{self.total}" if self.total is not None else ""
            print(f"{self.desc or 'progress'}: {self.n}{of} after {now - self._t0:.0f} s")

    def close(self) -> None:
        """End the bar (interactive) or print the closing line ``desc: N steps in S s`` (headless)."""
        if self.closed:
            return
        self.closed = True
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            print(f"{self.desc or 'done'}: {self.n} step{'s' if self.n != 1 else ''} in "
                  f"{time.perf_counter() - self._t0:.1f} s")

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(total: int | None = None, desc: str = "", every_s: float = 10.0) -> ProgressBar:
    """A progress display for work that reports by callback (``run_open_loop(..., on_window=bar.update)``), where
    :func:`progress` needs a loop: tqdm's bar when :func:`interactive`, else a short line at most every ``every_s``
    seconds and one when it closes (``desc: N steps in S s``, as :func:`progress` prints). ``total``: steps
    expected (None: unknown). Use it as a context manager, or call ``close()``::

        with widgets.progress_bar(total=60, desc="SLO run") as bar:
            result = load.run_open_loop(target, 100, 60, on_window=bar.update)"""
    _check_bar(total, desc, "progress_bar")
    return ProgressBar(total, desc, check_positive(every_s, "every_s", "progress_bar", what="number of seconds"))

