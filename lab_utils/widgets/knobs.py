"""Lab 04's knob panel: dynamic batching on/off, preferred batch sizes, queue delay, instances and the load's
concurrency. Apply redeploys the model with those knobs (``serving.steps.deploy``); Measure runs one closed-loop
measurement (``serving.steps.measure``) and appends a row to the step table and a point to the latency–throughput
plot."""

from __future__ import annotations

import copy
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as w
import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import display

from lab_utils.serving import server as triton_server
from lab_utils.serving import steps as triton_lab
from lab_utils.widgets.core import Panel, interactive, show


def _sizes(text: str) -> list[int]:
    """``"4, 8"`` as ``[4, 8]``; ValueError naming the text when it is not whole numbers > 0."""
    try:
        sizes = [int(t) for t in text.replace(";", ",").split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"preferred sizes {text!r}: write whole numbers separated by commas, e.g. 4, 8") from None
    if any(s < 1 for s in sizes):
        raise ValueError(f"preferred sizes {text!r}: each size is a whole number >= 1")
    return sizes


class KnobPanel(Panel):
    """Controls for one model's knobs on a running ``server``; ``rows`` are the measurements (the step table's)."""

    def __init__(self, server: Any, repo: Path, base_config: Mapping[str, Any], make_inputs: Any,
                 settings: triton_lab.LoadSettings, *, gpus: int = 0, concurrency: int = 8,
                 rows: Sequence[Mapping[str, Any]] = (), batching: bool = True, preferred: Sequence[int] = (),
                 delay_us: int = 0, instances: int = 1):
        self.server, self.repo, self.make_inputs, self.settings, self.gpus = server, Path(repo), make_inputs, \
            settings, gpus
        self.base = copy.deepcopy(dict(base_config))
        self.base.pop("dynamic_batching", None)
        self.kind = (self.base.get("instance_group") or [{}])[0].get("kind", "KIND_CPU")
        self.rows: list[dict[str, Any]] = [dict(r) for r in rows]
        self.applied: dict[str, Any] | None = None
        style = {"description_width": "initial"}
        self.batching = w.Checkbox(value=batching, description="dynamic batching", indent=False)
        self.preferred = w.Text(value=", ".join(map(str, preferred)), description="preferred batch sizes",
                                placeholder="e.g. 4, 8", style=style)
        self.delay_us = w.BoundedIntText(value=delay_us, min=0, max=100_000, step=100,
                                         description="max queue delay (µs)", style=style)
        self.instances = w.BoundedIntText(value=instances, min=1, max=8, description="instances", style=style)
        self.concurrency = w.BoundedIntText(value=concurrency, min=1, max=256, description="concurrency (clients)",
                                            style=style)
        self.apply_button = w.Button(description="Apply (redeploy)")
        self.measure_button = w.Button(description="Measure", button_style="primary")
        self.apply_button.on_click(lambda _b: self._guard(self.apply))
        self.measure_button.on_click(lambda _b: self._guard(self.measure))
        self.status = w.HTML()
        self.table_out, self.plot_out = w.Output(), w.Output()
        self.widget = w.VBox([w.HBox([self.batching, self.preferred, self.delay_us]),
                              w.HBox([self.instances, self.concurrency, self.apply_button, self.measure_button]),
                              self.status, self.table_out, self.plot_out])

    def config(self) -> dict[str, Any]:
        """The model configuration the controls describe (``config.pbtxt``'s fields)."""
        cfg = copy.deepcopy(self.base)
        if self.batching.value:
            batching: dict[str, Any] = {}
            if sizes := _sizes(self.preferred.value):
                batching["preferred_batch_size"] = sizes
            if self.delay_us.value:
                batching["max_queue_delay_microseconds"] = int(self.delay_us.value)
            cfg["dynamic_batching"] = batching
        cfg["instance_group"] = [{"kind": self.kind, "count": int(self.instances.value)}]
        return cfg

    def label(self) -> str:
        """The knobs in a few words: the step's name in the table and the plot."""
        if not self.batching.value:
            knobs = "no batching"
        else:
            pref = _sizes(self.preferred.value)
            knobs = "batching" + (f" preferred {pref}" if pref else "") + \
                (f" delay {self.delay_us.value} µs" if self.delay_us.value else "")
        return f"{knobs}, {self.instances.value} instance{'s' if self.instances.value > 1 else ''}"

    def stopped(self) -> str | None:
        """Why the server takes no requests now (what to run first), shown in the status line; None while it runs."""
        if why := triton_server.not_serving(self.server):
            self.status.value = html.escape(why)
        return why

    def apply(self) -> float | None:
        """Redeploy the model with the controls' configuration; seconds the load took (None: the server is stopped,
        the status line says what to run first)."""
        if self.stopped():
            return None
        cfg = self.config()
        self.status.value = f"deploying: {self.label()} ..."
        seconds = triton_lab.deploy(self.server, self.repo, cfg, gpus=self.gpus)
        self.applied = cfg
        self.status.value = f"deployed <b>{self.label()}</b> in {seconds:.2f} s"
        return seconds

    def measure(self) -> dict[str, Any] | None:
        """Apply first when the controls changed since the last Apply; then measure and append the row (None: the
        server is stopped, the status line says what to run first)."""
        if self.stopped():
            return None
        if self.config() != self.applied:
            self.apply()
        c = int(self.concurrency.value)
        self.status.value = f"measuring <b>{self.label()}</b> at concurrency {c} ..."
        row = triton_lab.measure(self.server, self.config()["name"], self.make_inputs, c, self.settings,
                                 label=self.label())
        self.rows.append(row)
        self.status.value = (f"<b>{self.label()}</b>, concurrency {c}: {row['throughput_infer_s']:.1f} infer/s, "
                             f"p95 {row['p95_ms']:.2f} ms{'' if row['stable'] else ' (NOT stable)'}")
        self._render()
        return row

    def table(self) -> pd.DataFrame:
        """The step table of every measurement so far (each against the one before)."""
        return triton_lab.step_table(self.rows)

    def figure(self) -> Any:
        """p95 against throughput: one point per measurement, labelled by its knobs."""
        curves: dict[str, list[dict[str, Any]]] = {}
        for r in self.rows:
            curves.setdefault(r["step"], []).append(r)
        fig = triton_lab.plot_latency_throughput({k: pd.DataFrame(v) for k, v in curves.items()},
                                                 title="Your knob settings: p95 against throughput").figure
        plt.close(fig)
        return fig

    def _render(self) -> None:
        with self.table_out:
            self.table_out.clear_output(wait=True)
            display(self.table().round(2))
        with self.plot_out:
            self.plot_out.clear_output(wait=True)
            display(self.figure())

    def headless(self) -> None:
        row = self.measure()
        if row is None:
            print(f"knob panel: {html.unescape(self.status.value)}")
            return
        print(f"knob panel (interactive in JupyterLab): measured {row['step']} at concurrency {row['concurrency']}")
        display(self.table().round(2))
        display(self.figure())


def knob_panel(server: Any, repo: Path, base_config: Mapping[str, Any], make_inputs: Any,
               settings: triton_lab.LoadSettings, **kwargs: Any) -> KnobPanel:
    """Show the panel on the running ``server`` (headless: measure the initial knobs once and print the table)."""
    panel = KnobPanel(server, repo, base_config, make_inputs, settings, **kwargs)
    if interactive() and panel.rows:
        panel._render()
    return show(panel)
