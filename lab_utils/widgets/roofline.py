"""Lab 01's roofline explorer: pick a dtype and a size, the matmul is measured on this machine and its point lands
on the H200's roofline beside the course's H200 reference points (``reference_runs/h200``, n = 8192)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets as w
import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import display

from lab_utils.args import check_int
from lab_utils.course import specs
from lab_utils.gpu import bench, bench_plots
from lab_utils.timing import matmul_flops
from lab_utils.widgets.core import Panel, interactive, show

REFERENCE_N = 8192  # the size at which the H200 reference run recorded each dtype's matmul


def reference_points() -> pd.DataFrame:
    """The H200 reference run's matmuls as roofline points (TFLOP/s at n = 8192, FLOP/byte)."""
    rows = [{"kind": "H200 reference", "dtype": d, "n": REFERENCE_N,
             "intensity_flop_per_byte": matmul_flops(REFERENCE_N, REFERENCE_N, REFERENCE_N)
             / bench.matmul_min_bytes(d, REFERENCE_N), "tflops": t}
            for d, t in specs.h200_reference_tflops().items()]
    return pd.DataFrame(rows, columns=["kind", "dtype", "n", "intensity_flop_per_byte", "tflops"])


class RooflineExplorer(Panel):
    """A dtype and a size picker; each change measures that matmul here (``bench.matmul_sweep``, one case) and
    redraws the H200 roofline with every point measured so far. ``points`` holds them (TFLOP/s, FLOP/byte)."""

    def __init__(self, device: str, sizes: Sequence[int], dtypes: Sequence[str] = bench.DTYPES, reps: int = 5,
                 dtype: str | None = None, n: int | None = None):
        # said here, at the call: a bad choice would otherwise surface as a traitlets error from inside ipywidgets
        if not sizes:
            raise ValueError(f"roofline_explorer(sizes={sizes!r}): matmul sizes n, e.g. [256, 512]")
        for s in sizes:
            check_int(s, "sizes", "roofline_explorer", what="each a matmul size n, e.g. [256, 512]")
        unknown = [d for d in dtypes if d not in bench.DTYPES]
        if not dtypes or unknown:
            raise ValueError(f"roofline_explorer(dtypes={dtypes!r}): choose among {list(bench.DTYPES)}")
        if dtype is not None and dtype not in dtypes:
            raise ValueError(f"roofline_explorer(dtype={dtype!r}): not among the offered dtypes {list(dtypes)}")
        if n is not None and n not in sizes:
            raise ValueError(f"roofline_explorer(n={n!r}): not among the offered sizes {list(sizes)}")
        check_int(reps, "reps", "roofline_explorer", what="timed repetitions per point")
        self.device, self.reps = device, reps
        self.points = pd.DataFrame(columns=["kind", "dtype", "n", "intensity_flop_per_byte", "tflops"])
        self.last: dict[str, Any] = {}
        self.dtype = w.Dropdown(options=list(dtypes), value=dtype or dtypes[0], description="dtype")
        self.size = w.Dropdown(options=[int(s) for s in sizes], value=int(n or sizes[0]), description="n")
        self.status = w.HTML()
        self.out = w.Output()
        self.widget = w.VBox([w.HBox([self.dtype, self.size]), self.status, self.out])
        self.dtype.observe(self._changed, "value")
        self.size.observe(self._changed, "value")

    def measure(self) -> dict[str, Any]:
        """Measure the chosen matmul here; the sweep's row (``status`` says when this device cannot run it)."""
        row = bench.matmul_sweep(sizes=[self.size.value], dtypes=[self.dtype.value], device=self.device,
                                 reps=self.reps).iloc[0].to_dict()
        if row["status"] == "ok":
            point = {"kind": "here", "dtype": row["dtype"], "n": row["n"],
                     "intensity_flop_per_byte": row["intensity_flop_per_byte"], "tflops": row["tflops"]}
            self.points = pd.concat([self.points.astype(object), pd.DataFrame([point]).astype(object)],
                                    ignore_index=True)
        self.last = row
        return row

    def summary(self) -> str:
        """One line about the last measurement, with the H200 reference for the same dtype."""
        r = self.last
        ref = specs.h200_reference_tflops().get(r["dtype"])
        ref_text = f"H200 reference {ref:,.1f} TFLOP/s at n={REFERENCE_N}" if ref else "no H200 reference"
        if r["status"] != "ok":
            return f"{r['dtype']} n={r['n']}: not measured here ({r['reason']}); {ref_text}"
        return (f"{r['dtype']} n={r['n']} on {r['device_name']}: {r['tflops']:.3g} TFLOP/s at "
                f"{r['intensity_flop_per_byte']:.1f} FLOP/byte ({r['median_ms']:.3g} ms); {ref_text}")

    def figure(self) -> Any:
        """The H200 datasheet roof (bf16) with its reference points and every point measured here."""
        h200 = specs.H200_SXM
        pts = pd.concat([reference_points(), self.points], ignore_index=True)
        pts[["intensity_flop_per_byte", "tflops"]] = pts[["intensity_flop_per_byte", "tflops"]].astype(float)
        fig = bench_plots.plot_roofline(pts, h200.tflops("bf16"), h200.hbm_tbps,
                                  title="Your matmuls on the H200 roofline (datasheet bf16 roof)")
        plt.close(fig)  # shown by display(), not again by the inline backend at the end of the cell
        return fig

    def _render(self) -> None:
        self.status.value = f"<b>{self.summary()}</b>"
        with self.out:
            self.out.clear_output(wait=True)
            display(self.figure())

    def _changed(self, _change: Any = None) -> None:
        self.status.value = f"measuring {self.dtype.value} n={self.size.value} ..."
        if self._guard(self.measure) is not None:
            self._render()

    def headless(self) -> None:
        self.measure()
        print(self.summary())
        display(self.figure())


def roofline_explorer(device: str, sizes: Sequence[int], dtypes: Sequence[str] = bench.DTYPES, reps: int = 5,
                      dtype: str | None = None, n: int | None = None) -> RooflineExplorer:
    """Show the explorer, opened on a first measurement (headless: print that measurement and plot it)."""
    panel = RooflineExplorer(device, sizes, dtypes, reps, dtype, n)
    if interactive():
        panel._changed()
    return show(panel)
