"""Lab 01 experiments on the CPU with small sizes (fast); GPU-only behaviour is skipped without a GPU."""

from __future__ import annotations

import math
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")  # tests only: no display

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from _retry import tried

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _one_blas_thread():
    """CPU timings here compare two clocks on the same work. With two BLAS threads on a shared 2-core
    machine, a thread that loses its core stalls the other at every barrier and one measurement comes out
    many times slower than the next; one thread makes the comparison about the clocks, not the scheduler."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

from lab_utils.course.specs import H200_SXM
from lab_utils.gpu import bench as cb
from lab_utils.gpu import bench_plots

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def sweep() -> pd.DataFrame:
    return cb.matmul_sweep([64, 128], device="cpu", reps=3, warmup=1)


@pytest.fixture(scope="module")
def copies() -> pd.DataFrame:
    return cb.copy_bandwidth([4 * cb.MIB, 8 * cb.MIB], device="cpu", reps=3, warmup=1)


def _reset_tf32() -> None:
    torch.set_float32_matmul_precision("highest")  # torch's defaults
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.fp32_precision = "none"
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.backends.mkldnn.matmul.fp32_precision = "none"


def test_import_does_no_work():
    code = ("import threading, torch, lab_utils.gpu.bench, lab_utils.gpu.bench_plots; "
            "print(torch.cuda.is_initialized(), threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "1"], out.stdout  # no CUDA context, no thread started


# ----------------------------------------------------------------------------------------- devices, input


def test_resolve_device():
    assert cb.resolve_device("cpu") == "cpu"
    assert cb.resolve_device("auto") == ("cuda" if HAS_CUDA else "cpu")
    with pytest.raises(ValueError, match="'cpu', 'cuda'"):
        cb.resolve_device("tpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without a GPU")
def test_cuda_without_gpu_says_so():
    with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False.*device='cpu'"):
        cb.matmul_sweep([64], device="cuda")


def test_bad_arguments_name_the_argument():
    valid = r"valid dtypes are \['fp32', 'tf32', 'fp16', 'bf16', 'fp8'\]"
    with pytest.raises(ValueError, match=r"matmul_sweep\(dtypes=.*" + valid):
        cb.matmul_sweep([64], dtypes=["fp64"], device="cpu")
    with pytest.raises(ValueError, match="sizes="):
        cb.matmul_sweep([0], device="cpu")
    with pytest.raises(ValueError, match="reps="):
        cb.copy_bandwidth([cb.MIB], device="cpu", reps=0)
    with pytest.raises(ValueError, match="n_kernels="):
        cb.launch_overhead(n_kernels=-1, device="cpu")
    with pytest.raises(ValueError, match=r"dtype='tf32'.*tensor cores"):
        cb.bare_matmul_loop(64, "tf32", 2, "cpu")


# ----------------------------------------------------------------------------------------- TF32 flag


def test_tf32_context_uses_the_new_switch_and_restores_it():
    m = torch.backends.cuda.matmul
    if not hasattr(m, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision API")
    _reset_tf32()
    try:
        before = cb._precision_state(torch)
        assert before == {"cuda.matmul": "none"}
        with cb.tf32_matmul():
            assert m.fp32_precision == "tf32"
        assert cb._precision_state(torch) == before
        with cb.tf32_matmul(False):
            assert m.fp32_precision == "ieee"  # full fp32, said explicitly
        assert cb._precision_state(torch) == before
        # The legacy getter still answers afterwards: the block left no mix of old and new settings behind.
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        _reset_tf32()


def test_tf32_context_restores_after_exception_and_user_setting():
    m = torch.backends.cuda.matmul
    if not hasattr(m, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision API")
    try:
        m.fp32_precision = "tf32"  # the user's own choice
        before = cb._precision_state(torch)
        with pytest.raises(KeyError), cb.tf32_matmul(False):
            assert m.fp32_precision == "ieee"
            raise KeyError("inside")
        assert m.fp32_precision == "tf32"
        assert cb._precision_state(torch) == before
    finally:
        _reset_tf32()


def test_tf32_context_after_the_legacy_switch():
    # A notebook that used the deprecated allow_tf32 first: the block still switches and restores exactly.
    m = torch.backends.cuda.matmul
    if not hasattr(m, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision API")
    try:
        torch.set_float32_matmul_precision("high")  # what allow_tf32 = True sets
        before = cb._precision_state(torch)
        with cb.tf32_matmul(False):
            assert m.fp32_precision == "ieee"
        assert cb._precision_state(torch) == before == {"cuda.matmul": "tf32"}
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        _reset_tf32()


# ----------------------------------------------------------------------------------------- experiments


def test_async_pitfall_cpu_agrees():
    # Synchronous on the CPU: all three clocks time the same work (generous bound, three tries: a shared 2-core box
    # can slow one of the three timed blocks that run one after the other).
    df = tried(lambda: cb.async_pitfall(256, "cpu", reps=15, warmup=2),
               lambda d: d["ratio_to_benchmark"].between(0.2, 5).all())
    methods = ["host clock, no synchronize", "host clock + synchronize", "benchmark (host clock)"]
    assert list(df["method"]) == methods
    assert not df["async_launch"].any()
    assert (df["median_ms"] > 0).all() and (df["apparent_tflops"] > 0).all()
    assert df["ratio_to_benchmark"].between(0.2, 5).all()


def test_first_call_cost_cpu():
    df = cb.first_call_cost(96, "cpu", reps=5)
    assert list(df["call"]) == ["first call", "steady state (median)"]
    assert (df["latency_ms"] > 0).all()
    assert df["x_steady"].iloc[1] == pytest.approx(1.0)


def test_matmul_sweep_cpu(sweep):
    assert list(sweep.columns) == cb.SWEEP_COLUMNS
    assert len(sweep) == 2 * len(cb.DTYPES)
    ok = sweep[sweep["status"] == "ok"]
    assert set(ok["dtype"]) == {"fp32", "fp16", "bf16"}
    assert (ok["tflops"] > 0).all() and (ok["median_ms"] > 0).all()
    assert ok["pct_of_peak"].isna().all()  # no datasheet peak for a CPU
    # The reported rate is the FLOPs over the median time.
    r = ok.iloc[0]
    assert r["tflops"] == pytest.approx(r["flops"] / (r["median_ms"] * 1e-3) / 1e12)
    # flops and intensity: 2n^3 over (3 n^2 itemsize) for square fp32.
    r = sweep[(sweep["dtype"] == "fp32") & (sweep["n"] == 128)].iloc[0]
    assert r["flops"] == 2 * 128**3
    assert r["intensity_flop_per_byte"] == pytest.approx(2 * 128**3 / (3 * 128**2 * 4))
    fp8 = sweep[(sweep["dtype"] == "fp8") & (sweep["n"] == 128)].iloc[0]
    assert fp8["intensity_flop_per_byte"] == pytest.approx(2 * 128**3 / (2 * 128**2 + 2 * 128**2))


def test_tf32_and_fp8_skipped_on_cpu_with_reasons(sweep):
    skipped = sweep[sweep["status"] == "skipped"]
    assert set(skipped["dtype"]) == {"tf32", "fp8"}
    assert skipped["tflops"].isna().all()
    for reason in skipped.loc[skipped["dtype"] == "tf32", "reason"]:
        assert "needs an NVIDIA GPU with tensor cores" in reason
    for reason in skipped.loc[skipped["dtype"] == "fp8", "reason"]:
        assert "needs compute capability >= 8.9" in reason


def test_sweep_and_bare_loop_count_the_same_flops_on_cpu():
    """Both report 2·n³ FLOP over their own median time: the FLOP count, not the CPU's speed, is what is tested.

    Their speeds are compared on the GPU (``helper_over_bare_loop`` in the reference run: 0.99); on a shared
    2-core CPU the two timings can differ by more than 2x from one call to the next."""
    n = 256
    row = cb.matmul_sweep([n], dtypes=["fp32"], device="cpu", reps=3, warmup=1).iloc[0]
    assert row["tflops"] == pytest.approx(2 * n**3 / (row["median_ms"] * 1e-3) / 1e12, rel=1e-6)
    bare = cb.bare_matmul_loop(n, "fp32", iters=3, device="cpu", warmup=1)
    assert bare > 0 and math.isfinite(bare)


def test_copy_bandwidth_cpu(copies):
    assert list(copies["size_bytes"]) == [4 * cb.MIB, 8 * cb.MIB]
    assert (copies["bytes_moved"] == 2 * copies["size_bytes"]).all()
    # Some plausible DRAM/cache rate: more than 0.1 GB/s, less than 10 TB/s.
    assert copies["gbps"].between(0.1, 10_000).all()
    r = copies.iloc[0]
    assert r["gbps"] == pytest.approx(r["bytes_moved"] / (r["median_ms"] * 1e-3) / 1e9)


def test_copy_bandwidth_default_cpu_sizes_exceed_caches():
    # Not run (too slow for a unit test); the defaults are what the lab uses on a laptop.
    import inspect

    src = inspect.getsource(cb.copy_bandwidth)
    assert "(64 * MIB, 256 * MIB)" in src


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only answer")
def test_host_device_bandwidth_empty_on_cpu():
    df = cb.host_device_bandwidth(cb.MIB, reps=2)
    assert df.empty
    assert list(df.columns) == cb.HOST_DEVICE_COLUMNS
    assert "CUDA GPU" in df.attrs["reason"]


def test_launch_overhead_cpu():
    df = cb.launch_overhead(n_kernels=200, numel=64, device="cpu", reps=3, warmup=1)
    eager = df.set_index("mode").loc["eager"]
    graph = df.set_index("mode").loc["cuda_graph"]
    assert eager["available"] and eager["us_per_kernel"] > 0
    assert eager["us_per_kernel"] == pytest.approx(eager["median_ms"] * 1e3 / 200)
    assert not graph["available"] and "CUDA" in graph["reason"] and math.isnan(graph["us_per_kernel"])


def test_roofline_points(sweep, copies):
    df = cb.roofline_points(sweep, copies, device="cpu", elementwise_numel=2**20, reps=3)
    assert list(df.columns) == cb.ROOFLINE_COLUMNS
    assert set(df["kind"]) == {"matmul", "elementwise", "copy"}
    assert (df["kind"] == "matmul").sum() == (sweep["status"] == "ok").sum()
    ew = df[df["kind"] == "elementwise"].iloc[0]
    assert ew["intensity_flop_per_byte"] == pytest.approx(1 / 12)
    assert ew["tflops"] > 0 and ew["tbps"] == pytest.approx(ew["tflops"] * 12)
    # Each row shows only what it measured: no bandwidth for a matmul, no intensity 0 (or 0 TFLOP/s) for a copy.
    mm, cp = df[df["kind"] == "matmul"], df[df["kind"] == "copy"]
    assert mm["tbps"].isna().all() and (mm["tflops"] > 0).all() and (mm["intensity_flop_per_byte"] > 0).all()
    assert cp["intensity_flop_per_byte"].isna().all() and cp["tflops"].isna().all() and (cp["tbps"] > 0).all()
    assert df.attrs["measured_peak_tflops"] == pytest.approx(sweep["tflops"].max())
    assert df.attrs["measured_bw_tbps"] == pytest.approx(copies["gbps"].max() / 1e3)
    with pytest.raises(ValueError, match="matmul_sweep"):
        cb.roofline_points(copies, None, device="cpu")


# ----------------------------------------------------------------------------------------- plots


def _measured(pts: pd.DataFrame) -> dict[str, float]:
    return {k: pts.attrs[k] for k in ("measured_peak_tflops", "measured_bw_tbps")}


def test_plots_return_figures(sweep, copies):
    fig = bench_plots.plot_matmul_sweep(sweep)
    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.axes[0].lines) == 3  # fp32, fp16, bf16 measured; no peaks on a CPU

    pts = cb.roofline_points(sweep, copies, device="cpu", elementwise_numel=2**16, reps=2)
    fig = bench_plots.plot_roofline(pts, H200_SXM.bf16_tflops, H200_SXM.hbm_tbps, **_measured(pts))
    assert isinstance(fig, matplotlib.figure.Figure)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert any("datasheet ridge 206" in t.get_text() for t in ax.texts)

    fig = bench_plots.plot_roofline(pts, None, None, **_measured(pts))
    assert isinstance(fig, matplotlib.figure.Figure)
    with pytest.raises(ValueError, match="no roof"):
        bench_plots.plot_roofline(pts, None, None)

    fig = bench_plots.plot_bandwidth(copies)
    assert isinstance(fig, matplotlib.figure.Figure) and len(fig.axes[0].lines) == 1


def test_plot_peak_lines_and_host_device_groups():
    sweep = pd.DataFrame({"dtype": ["bf16", "bf16"], "n": [1024, 2048], "status": ["ok", "ok"],
                          "tflops": [400.0, 700.0], "peak_tflops": [989.0, 989.0]})
    fig = bench_plots.plot_matmul_sweep(sweep)
    assert len(fig.axes[0].lines) == 2  # the measured line and its dashed peak
    hd = pd.DataFrame({"direction": ["H2D", "D2H", "H2D", "D2H"],
                       "host_memory": ["pinned", "pinned", "pageable", "pageable"],
                       "size_bytes": [2**30] * 4, "gbps": [54.8, 55.0, 20.0, 18.0],
                       "peak_gbps": [63.0] * 4})
    fig = bench_plots.plot_bandwidth(hd)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "H2D pinned" in labels and "D2H pageable" in labels and any("63" in s for s in labels)
    with pytest.raises(ValueError, match="missing columns"):
        bench_plots.plot_bandwidth(pd.DataFrame({"x": [1]}))


# ----------------------------------------------------------------------------------------- GPU only


@needs_gpu
def test_gpu_async_pitfall_shows_the_bug():
    df = cb.async_pitfall(8192, "cuda", dtype="bf16", reps=10).set_index("method")
    assert df["async_launch"].all()
    # Without synchronize the host clock sees only the launch: far less than the real time.
    assert df.loc["host clock, no synchronize", "ratio_to_benchmark"] < 0.5
    assert 0.8 < df.loc["host clock + synchronize", "ratio_to_benchmark"] < 1.5


@needs_gpu
def test_gpu_sweep_runs_every_dtype_and_helper_matches_bare_loop():
    df = cb.matmul_sweep([4096], device="cuda", reps=10, warmup=3)
    cc = torch.cuda.get_device_capability()
    expected_ok = {"fp32", "fp16", "bf16"} | ({"tf32"} if cc >= (8, 0) else set()) | (
        {"fp8"} if cc >= (8, 9) else set()
    )
    ok = df[df["status"] == "ok"]
    assert set(ok["dtype"]) == expected_ok, df[["dtype", "status", "reason"]]
    assert (ok["tflops"] > 0).all()
    by = ok.set_index("dtype")["tflops"]
    if "tf32" in by:
        assert by["tf32"] > 1.3 * by["fp32"]  # TF32 really switched on (and fp32 really off)
    if "fp8" in by:
        assert by["fp8"] > by["bf16"]
    helper = cb.matmul_sweep([8192], dtypes=["bf16"], device="cuda", reps=20)["tflops"].iloc[0]
    bare = cb.bare_matmul_loop(8192, "bf16", iters=20, device="cuda")
    assert helper / bare > 0.97, (helper, bare)


@needs_gpu
def test_gpu_fp8_matches_reference():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    case = cb.make_matmul(256, "fp8", "cuda")
    a, b = case.inputs
    assert a.is_contiguous() and b.t().is_contiguous()  # A row-major, B column-major, as _scaled_mm wants
    out = case.fn().float()
    # The same product of the fp8-rounded inputs in float64: a wrong layout or scale would miss by far.
    ref = a.float().double() @ b.float().double()
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < 1e-2, rel


def test_make_matmul_cpu_matches_float64():
    for dtype, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        case = cb.make_matmul(64, dtype, "cpu")
        a, b = case.inputs
        assert a.abs().sum() > 0  # random, never zeros
        ref = a.double() @ b.double()
        rel = float((case.fn().double() - ref).norm() / ref.norm())
        assert rel < tol, (dtype, rel)


@needs_gpu
def test_gpu_host_device_and_graphs():
    hd = cb.host_device_bandwidth(64 * cb.MIB, reps=3)
    assert len(hd) == 4 and (hd["gbps"] > 0).all()
    pinned = hd[hd["host_memory"] == "pinned"].set_index("direction")["gbps"]
    assert pinned["H2D"] > 1.0
    lo = cb.launch_overhead(n_kernels=500, numel=256, device="cuda", reps=5).set_index("mode")
    assert lo.loc["cuda_graph", "available"]
    assert lo.loc["cuda_graph", "speedup_vs_eager"] > 1.0
    cp = cb.copy_bandwidth([256 * cb.MIB], device="cuda", reps=5)
    assert cp["gbps"].iloc[0] > 100
