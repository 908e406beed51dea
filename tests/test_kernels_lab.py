"""Lab 01b: the kernel checks run real Triton kernels (its interpreter on CPU tensors here), right, blank and wrong;
the launchers, guard bands and timing helpers; the lab's number with a letter; the generated lab runs green.

Without triton these tests skip, unless ``NVLAB_REQUIRE_KERNELS=1`` (CI installs the ``kernels`` extra), where they
fail."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REQUIRE_ENV = "NVLAB_REQUIRE_KERNELS"
if importlib.util.find_spec("triton") is None:
    why = "triton is not installed (pip install -e '.[kernels]')"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)

from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests  # noqa: E402

from lab_utils.course import catalog, probe  # noqa: E402
from lab_utils.exercises import lab01b  # noqa: E402
from lab_utils.exercises.framework import Status  # noqa: E402
from lab_utils.gpu import kernels  # noqa: E402
from nvlab.ops import notebooks  # noqa: E402

HERE = kernels.load_triton("cpu")  # the interpreter: TRITON_INTERPRET=1 before any kernel below is decorated
triton, tl = HERE.triton, HERE.tl
from lab_utils.gpu import triton_kernels as ref  # noqa: E402

ROOT = catalog.repo_root()


# --- answers, right and wrong, as a student writes them ----------------------------------------------------------

@triton.jit
def add_right(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def add_no_mask(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + tl.load(y_ptr + offs))


@triton.jit
def add_mask_le(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs <= n  # one lane too many
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def add_no_pid(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def add_blank(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    ...  # YOUR CODE HERE


@triton.jit
def softmax_right(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):
    row, cols = tl.program_id(0), tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=m, other=-float("inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=m)


@triton.jit
def softmax_other_zero(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):
    row, cols = tl.program_id(0), tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(in_ptr + row * in_row_stride + cols, mask=m, other=0.0)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=m)


@triton.jit
def softmax_no_max(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):
    row, cols = tl.program_id(0), tl.arange(0, BLOCK)
    m = cols < n_cols
    e = tl.exp(tl.load(in_ptr + row * in_row_stride + cols, mask=m, other=-float("inf")))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=m)


@triton.jit
def softmax_no_mask(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):
    row, cols = tl.program_id(0), tl.arange(0, BLOCK)
    x = tl.load(in_ptr + row * in_row_stride + cols)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0))


@triton.jit
def softmax_n_cols_as_stride(out_ptr, in_ptr, in_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):
    row, cols = tl.program_id(0), tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(in_ptr + row * n_cols + cols, mask=m, other=-float("inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=m)


@triton.jit
def matmul_variant(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MASK_K: tl.constexpr,
                   ACCUMULATE: tl.constexpr, MASK_STORE: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        if MASK_K:
            a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        else:
            a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak, mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=rn[None, :] < N, other=0.0)
        if ACCUMULATE:
            acc += tl.dot(a, b)
        else:
            acc = tl.dot(a, b)
    if MASK_STORE:
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc,
                 mask=(rm[:, None] < M) & (rn[None, :] < N))
    else:
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc)


class _Bound:
    """``matmul_variant`` with its flags fixed, launched as the check launches a student's kernel."""

    def __init__(self, **flags: bool) -> None:
        self.fn = matmul_variant.fn
        self.flags = {k.upper(): v for k, v in flags.items()}

    def __getitem__(self, grid):
        return lambda *args, **kw: matmul_variant[grid](*args, **kw, **self.flags)

    def __call__(self, *args):  # a jit function is callable too (only inside another kernel)
        raise RuntimeError("launch it as kernel[grid](...)")


CASES = [
    (lab01b.q1, [add_right], [ref.add_kernel, add_no_mask, add_mask_le, add_no_pid, lambda *a: 0, 3]),
    (lab01b.q2, [977, 977.0], [976, 1_000_003, 1_000_003 / 1024, 978]),
    (lab01b.q3, [8, 8.0], [256, 32, 128, 1024, 7.5]),
    (lab01b.q4, [softmax_right], [ref.softmax_kernel, softmax_other_zero, softmax_no_max, softmax_no_mask,
                                  softmax_n_cols_as_stride]),
    (lab01b.q5, [_Bound(mask_k=True, accumulate=True, mask_store=True)],
     [ref.matmul_kernel, _Bound(mask_k=False, accumulate=True, mask_store=True),
      _Bound(mask_k=True, accumulate=False, mask_store=True), _Bound(mask_k=True, accumulate=True, mask_store=False)]),
]

test_right, test_wrong, test_blank = standard_tests(CASES)
test_hints, test_solutions = hint_and_solution_tests(exercises_of(lab01b))


def test_every_exercise_has_cases():
    assert {id(ex) for ex, *_ in CASES} == {id(ex) for ex in exercises_of(lab01b)}


def test_the_course_kernel_as_an_answer_is_refused_naming_it():
    out = check(lab01b.q1, ref.add_kernel)
    assert out.status is Status.INCORRECT and "lab_utils.gpu.triton_kernels.add_kernel" in out.message
    again = triton.jit(ref.softmax_kernel.fn)  # the same function under another decorator
    assert "triton_kernels.softmax_kernel" in check(lab01b.q4, again).message


def test_a_blank_kernel_is_not_attempted_and_names_its_hint():
    out = check(lab01b.q1, add_blank)
    assert out.status is Status.NOT_ATTEMPTED
    assert "`ex.q1.hint()`" in out.message  # "01b.1 ..." is the lab's ex.q1


@pytest.mark.parametrize(("kernel", "symptom"), [
    (add_no_mask, "wrote 21 element(s) outside `out`"),
    (add_mask_le, "is the mask `offs <= n`?"),
    (add_no_pid, "every program wrote the first block"),
])
def test_a_wrong_add_kernel_is_refused_naming_the_symptom(kernel, symptom):
    out = check(lab01b.q1, kernel)
    assert out.status is Status.INCORRECT and symptom in out.message, out.message
    assert "n=1003, BLOCK=256" in out.message  # the odd size where it shows


@pytest.mark.parametrize(("kernel", "symptom"), [
    (softmax_other_zero, "loaded as 0"),
    (softmax_no_max, "exp(100) overflows float32"),
    (softmax_no_mask, "outside the rows of `out`"),
    (softmax_n_cols_as_stride, "the strides, not n_cols"),
])
def test_a_wrong_softmax_is_refused_naming_the_symptom(kernel, symptom):
    out = check(lab01b.q4, kernel)
    assert out.status is Status.INCORRECT and symptom in out.message, out.message


@pytest.mark.parametrize(("flags", "symptom"), [
    ({"mask_k": False}, "NaN in C: a load read outside A or B"),
    ({"accumulate": False}, "only the last K step's product"),
    ({"mask_store": False}, "outside C"),
])
def test_a_wrong_matmul_is_refused_naming_the_symptom(flags, symptom):
    out = check(lab01b.q5, _Bound(**{"mask_k": True, "accumulate": True, "mask_store": True, **flags}))
    assert out.status is Status.INCORRECT and symptom in out.message, out.message


def test_without_triton_the_kernel_checks_are_not_applicable_and_say_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    missing = kernels.load_triton("cpu")
    assert missing.mode == "missing" and not missing.runs

    @missing.triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: missing.tl.constexpr):  # defined, never run
        return x_ptr + n

    out = lab01b.q1.check(add_kernel, quiet=True)
    assert out.status is Status.NOT_APPLICABLE and kernels.KERNELS_INSTALL in out.message, out.message
    with pytest.raises(RuntimeError, match=r"triton\.program_id: triton is not installed"):
        missing.tl.program_id(0)


# --- guard bands, launchers, timings -------------------------------------------------------------------------------

def test_guarded_counts_what_a_kernel_writes_outside_its_view():
    g = kernels.guarded((3, 5), torch.float32, "cpu", (1, 2))
    assert g.view.shape == (3, 5) and g.view.stride() == (9, 1) and g.spilled() == 0
    g.view.fill_(1.0)
    assert g.spilled() == 0
    g.base[0, 0] = 7.0
    g.base[4, 8] = float("nan")
    assert g.spilled() == 2
    nan_fill = kernels.guarded((4,), torch.float32, "cpu", (3,), fill=float("nan"), values=torch.arange(4.0))
    assert nan_fill.spilled() == 0 and nan_fill.view.tolist() == [0.0, 1.0, 2.0, 3.0]


@triton.jit
def loop_sum(x_ptr, out_ptr, n):
    acc = 0.0
    for i in range(0, n, 1):  # bounded by a kernel argument: the interpreter calls its __index__
        acc += tl.load(x_ptr + i)
    tl.store(out_ptr, acc)


def test_an_older_interpreters_loop_bound_is_mended_under_numpy_2_4(monkeypatch):
    """triton-lang/triton#9171 (triton 3.6, which torch 2.11 pins, under NumPy >= 2.4): the interpreter's old
    ``__index__`` put back, a loop bounded by a kernel argument fails as it did on the GPU runner; after
    ``compat.triton_interpreter.apply()`` it runs and sums right, and a second apply changes nothing."""
    import numpy as np
    from triton.runtime import interpreter as interp

    from lab_utils.compat import triton_interpreter

    try:
        int(np.array([3]))
        pytest.skip(f"NumPy {np.__version__} still takes int() of a one-element array: nothing to mend")
    except TypeError:
        pass
    current = interp._patch_lang_tensor

    def before_the_fix(tensor, scope):
        current(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interp, "_patch_lang_tensor", before_the_fix)
    x, out = torch.arange(10, dtype=torch.float32), torch.zeros(1)
    with pytest.raises(Exception, match="only 0-dimensional arrays"):
        loop_sum[(1,)](x, out, 10)
    assert triton_interpreter.apply() and not triton_interpreter.apply()
    loop_sum[(1,)](x, out, 10)
    assert out.item() == 45.0


def test_launchers_run_the_reference_kernels_on_awkward_sizes():
    x, y = torch.randn(1003), torch.randn(1003)
    out = torch.empty_like(x)
    assert kernels.launch_add(ref.add_kernel, x, y, out, block=256) == (4,)
    assert torch.equal(out, x + y)
    s = torch.randn(5, 130) * 4
    o = torch.empty_like(s)
    assert kernels.launch_softmax(ref.softmax_kernel, s, o) == (5,) and kernels.softmax_block(130) == 256
    assert torch.allclose(o, torch.softmax(s, dim=1), atol=1e-6)
    a, b = torch.randn(50, 40, dtype=torch.float16), torch.randn(40, 30, dtype=torch.float16)
    c = torch.empty(50, 30, dtype=torch.float16)
    assert kernels.launch_matmul(ref.matmul_kernel, a, b, c, kernels.MatmulConfig(32, 16, 16)) == (2, 2)
    assert (c.float() - a.float() @ b.float()).abs().max() < 0.05


def test_timing_helpers_and_the_roofline_rows():
    import matplotlib

    matplotlib.use("Agg")
    from lab_utils.gpu import bench_plots

    adds = kernels.time_add(ref.add_kernel, 3000, "cpu", reps=1)
    soft = kernels.time_softmax(ref.softmax_kernel, 4, 100, "cpu", reps=1, warps=(4,))
    torch_only = kernels.time_softmax(None, 4, 100, "cpu", reps=1)
    mms = kernels.time_matmul(ref.matmul_kernel, 48, "cpu", reps=1, configs=(kernels.MatmulConfig(32, 32, 16),))
    assert list(adds["label"]) == ["triton add", "torch.add"] and (adds["gbps"] > 0).all()
    assert list(torch_only["label"]) == ["torch.softmax", "unfused torch chain"]
    assert soft["label"].iloc[0] == "triton softmax (num_warps=4)" and len(soft) == 3
    assert mms["label"].iloc[-1] == "cuBLAS (a @ b)" and (mms["tflops"] > 0).all()
    points = kernels.roofline_rows(adds, soft, mms)
    assert list(points.columns) == kernels.ROOFLINE_COLUMNS and len(points) == 7
    assert points.loc[points["kind"] == "triton add", "intensity_flop_per_byte"].iloc[0] == pytest.approx(1 / 12)
    ax = bench_plots.plot_roofline(points, None, None, measured_peak_tflops=1.0, measured_bw_tbps=0.01)
    assert ax is not None
    matplotlib.pyplot.close("all")


def test_timing_refuses_a_kernel_that_computes_the_wrong_thing():
    with pytest.raises(ValueError, match="did not compute x \\+ y"):
        kernels.time_add(add_no_pid, 3000, "cpu", reps=1)


def test_reference_points_place_a_run_on_the_roofline():
    run = {"triton_softmax_gbps": 4000.0, "triton_matmul_tflops": 600.0, "matmul_n": 8192}
    pts = kernels.reference_points(run)
    soft = pts[pts["kind"] == "H200 triton softmax"].iloc[0]
    assert soft["tflops"] == pytest.approx(4.0 * 5 / 8) and soft["tbps"] == pytest.approx(4.0)
    mm = pts[pts["kind"] == "H200 triton matmul"].iloc[0]
    assert mm["intensity_flop_per_byte"] == pytest.approx(8192 / 3) and mm["tflops"] == 600.0
    assert kernels.reference_points({}).empty


# --- a lab numbered with a letter ----------------------------------------------------------------------------------

def test_lab_01b_sits_between_01_and_02_wherever_labs_are_listed():
    numbers = [lab.number for lab in catalog.LABS]
    assert numbers[1:4] == ["01", "01b", "02"]
    assert all(catalog.lab_by_number(n).slug == "gpu_kernels" for n in ("01b", "1b", "01B", "01b_gpu_kernels"))
    assert catalog.lab_by_number("1").number == "01"
    names = [p.name for p in sorted((ROOT / "solutions").glob(catalog.NOTEBOOK_GLOB))]
    assert names.index("01b_gpu_kernels.ipynb") == names.index("01_cuda_timing.ipynb") + 1
    assert [p.name for p in notebooks.select(["1b"], all_=False, solutions=True)] == ["01b_gpu_kernels.ipynb"]
    assert "01b_gpu_kernels.ipynb" in {p.name for p in notebooks.select([], all_=True, solutions=False)}
    assert any(t.lab == "01b" and t.notebook for t in probe.lab_tiers(probe.probe()))


# --- the generated lab, blanks and all, on the CPU tier ----------------------------------------------------------

@pytest.mark.notebooks
def test_generated_lab_runs_green_with_its_blanks_on_the_cpu_tier(tmp_path):
    res = notebooks.execute(ROOT / "labs" / "01b_gpu_kernels.ipynb", tmp_path, {"quick": True},
                            run_id="pytest-labs-01b", timeout_s=300)
    assert res.ok, res.error
    assert notebooks.leftover_processes("pytest-labs-01b") == []
    executed = json.loads(res.output.read_text())
    checks = ["".join("".join(o.get("text", "")) for o in c["outputs"]) for c in executed["cells"]
              if c["cell_type"] == "code" and ".check(" in "".join(c["source"])]
    assert len(checks) == 5 and all("not attempted" in t for t in checks), checks
    recorded = {r["name"] for r in json.loads((tmp_path / "results_01b.json").read_text())}
    assert {"torch_softmax_gbps", "unfused_softmax_gbps"} <= recorded


# --- ./course's Triton step -----------------------------------------------------------------------------------------

def _triton_step(tmp_path, env_extra: dict[str, str], triton_imports: bool) -> subprocess.CompletedProcess[str]:
    """./course's install_triton alone (sourced), its installer failing as offline (pip pointed at an index that
    cannot answer, and the install itself refused: this venv has triton); where ``triton_imports`` is False,
    `python -c 'import triton'` fails as on a machine without it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "NVLAB_KERNELS", "UV_"))}
    env.update(PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin", PIP_CONFIG_FILE=os.devnull,
               PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_DEFAULT_TIMEOUT="5", PIP_NO_INPUT="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", NVLAB_INSTALLER="pip", TMPDIR=str(tmp_path), **env_extra)
    no_triton = "python() { [ \"$1 $2\" != '-c import triton' ] && command python \"$@\"; }; "
    fake = "pip_install() { return 1; }; " + ("" if triton_imports else no_triton)
    return subprocess.run(["bash", "-c", f'source ./course && {fake}install_triton && echo "setup goes on"'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_course_triton_step_offline_says_so_in_one_line_and_goes_on(tmp_path):
    out = _triton_step(tmp_path, {}, triton_imports=False)
    assert out.returncode == 0 and out.stdout.strip() == "setup goes on", out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("course: ")]
    assert lines[0].startswith("course: installing Triton, the kernel language for lab 01b (triton>="), lines
    assert lines[-1].startswith("course: Triton not installed (offline?)") and "'.[kernels]'" in lines[-1], lines


@pytest.mark.parametrize(("env", "imports"), [({}, True), ({"NVLAB_KERNELS": "0"}, False)])
def test_course_triton_step_leaves_a_present_triton_alone_and_obeys_nvlab_kernels_0(tmp_path, env, imports):
    out = _triton_step(tmp_path, env, triton_imports=imports)
    assert out.returncode == 0 and out.stdout.strip() == "setup goes on" and out.stderr == "", out.stderr


_NO_TRITON = '''
import importlib.util, sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoTriton())
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "triton" else _find(name, *a, **k)
'''


@pytest.mark.notebooks
def test_generated_lab_runs_green_without_triton_and_says_how_to_install_it(tmp_path, monkeypatch):
    block = tmp_path / "no-triton"
    block.mkdir()
    (block / "sitecustomize.py").write_text(_NO_TRITON)  # the lab's kernel process sees no triton at all
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(block), os.environ.get("PYTHONPATH")])))
    res = notebooks.execute(ROOT / "labs" / "01b_gpu_kernels.ipynb", tmp_path / "run", {"quick": True},
                            run_id="pytest-labs-01b-no-triton", timeout_s=300)
    assert res.ok, res.error
    cells = [c for c in json.loads(res.output.read_text())["cells"] if c["cell_type"] == "code"]
    text = ["".join("".join(o.get("text", "")) for o in c["outputs"]) for c in cells]
    setup = next(t for t in text if "Skipped here" in t)
    assert f"Install it: {kernels.KERNELS_INSTALL}" in setup
    kernel_checks = [t for c, t in zip(cells, text, strict=True) if any(
        f"ex.q{n}.check(" in "".join(c["source"]) for n in (1, 4, 5))]
    assert len(kernel_checks) == 3 and all("not applicable on this tier" in t for t in kernel_checks), kernel_checks
    recorded = {r["name"] for r in json.loads((tmp_path / "run" / "results_01b.json").read_text())}
    assert {"torch_softmax_gbps", "unfused_softmax_gbps"} <= recorded
