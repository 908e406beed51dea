"""Lab 01's rates from the student's own timing and the roofline they sit on: 01.2 a matmul's TFLOP/s and 01.3 a
copy's GB/s, timed on this machine's device with an instrumented reference timer; 01.4-01.6 arithmetic intensity,
the H200's ridge point and which roof bounds saxpy. Units: ms, TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 bytes/s."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lab_utils import timing
from lab_utils.course import specs
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    References,
    Wrong,
    close_to,
    fastest_ratio,
    match_slip,
    number,
    one_of,
    run_student,
    source_as,
)
from lab_utils.exercises.lab01.timing_loop import chip, grading_device, one_cpu_thread

# --- the instrumented timer handed to q2 and q3 -----------------------------------------------------------


def _rng_state(device: str) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.startswith("cuda"):
        states.append(torch.cuda.get_rng_state(device))
    return states


class _Timer:
    """The reference timer, as the student's function receives it: ``timer(fn) -> ms`` (median per call).

    It records what it saw: whether ``fn`` drew random numbers (it creates its inputs on every call), what
    ``fn`` returned, and the milliseconds it handed back.
    """

    def __init__(self, device: str, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.calls: list[dict[str, Any]] = []

    def __call__(self, fn: Any) -> float:
        if not callable(fn):
            raise Wrong(f"timer(...) takes the function to time, e.g. timer(lambda: a @ b); you passed a "
                        f"{type(fn).__name__} (the result of calling it?)")
        before = _rng_state(self.device)
        out = fn()
        drew = any(not torch.equal(x, y) for x, y in zip(before, _rng_state(self.device), strict=True))
        ms = timing.benchmark(fn, reps=self.iters, warmup=self.warmup, device=self.device).median_ms
        self.calls.append({"ms": ms, "random": drew, "out": out, "fn": fn})
        return ms


def _timed_call(timer: _Timer, what: str) -> dict[str, Any]:
    if not timer.calls:
        raise Wrong(f"your function never called timer(...): time {what} with it, e.g. ms = timer(lambda: ...)")
    last = timer.calls[-1]
    if last["random"]:
        raise Wrong("the function you timed draws random numbers: it creates its inputs (torch.randn) on every "
                    "call, so the timing includes allocation and random-number generation. Create the tensors "
                    f"once, before, and time only {what}.")
    return last


def _judge_rate(value: Any, timer: _Timer, expected_of: Callable[[float], float], slips: dict[float, str],
                unit: str, call: str) -> float:
    got = number(value, f"{call}'s result")
    candidates = [expected_of(c["ms"]) for c in timer.calls]  # the rate from any time the timer handed back
    if any(math.isclose(got, e, rel_tol=0.01) for e in candidates):
        return got
    expected = candidates[-1]
    ratio = got / expected
    slip = match_slip(ratio, slips, 0.02)
    if slip:
        raise Wrong(f"{call} returned {got:.4g} {unit}; from the {timer.calls[-1]['ms']:.4g} ms your timer "
                    f"measured it is {expected:.4g} {unit}: {slip}")
    raise Wrong(f"{call} returned {got:.4g} {unit}, {ratio:.3g}x what the {timer.calls[-1]['ms']:.4g} ms your timer "
                f"measured gives ({expected:.4g} {unit}).")


def _ratio_to_reference(timed: dict[str, Any], reference: Callable[[], Any], device: str, reps: int,
                        band: tuple[float, float]) -> float:
    """Time of what the student timed / time of the reference operation, fastest against fastest."""
    def ms(fn: Callable[[], Any]) -> Callable[[], float]:
        return lambda: timing.benchmark(fn, reps=reps, warmup=1, device=device).median_ms

    return fastest_ratio(ms(timed["fn"]), ms(reference), band, first=timed["ms"])


# --- q2: TFLOP/s from your timing ---------------------------------------------------------------------------


def reference_matmul_tflops(n: int, device: str, timer: Callable[[Callable[[], Any]], float]) -> float:
    """TFLOP/s of an n×n×n float32 matmul: inputs made once, only ``a @ b`` timed, 2·n³ FLOPs."""
    a = torch.randn(n, n, device=device)  # inputs made once: random, never zeros
    b = torch.randn(n, n, device=device)
    ms = timer(lambda: a @ b)  # only the matmul is timed
    return 2 * n**3 / (ms * 1e-3) / 1e12  # 2·n³ FLOPs per matmul


def _grade_matmul_tflops(fn: Any) -> str:
    device = grading_device()
    n = 4096 if device == "cuda" else 256
    call = f"matmul_tflops({n}, {device!r}, timer)"
    timer = _Timer(device, iters=5, warmup=2)
    with one_cpu_thread(device):
        got = run_student(fn, n, device, timer, call=call, timeout_s=120)
        last = _timed_call(timer, "a @ b")
        out = last["out"]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, n):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise Wrong(f"the function you timed returned {shape}, not the {n}x{n} product: time lambda: a @ b")
        first = out.reshape(-1)[0]
        if bool(torch.all(out == first)):  # zeros or ones in, a constant out: no data to multiply
            what = "all zeros" if float(first) == 0 else f"{float(first):g} in every element"
            raise Wrong(f"the product you timed is {what}: inputs from torch.zeros, torch.ones or torch.full (or no "
                        "matmul at all) measure no real work. A GPU multiplies zeros faster than real data (they draw "
                        "less power: 894 against 788 TFLOP/s bf16 on an H200), so the rate would flatter it. Make "
                        "the inputs with torch.randn, once, and time lambda: a @ b.")
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        ratio = _ratio_to_reference(last, lambda: a @ b, device, reps=5, band=(0.2, 5))
    if ratio < 0.2:
        raise Wrong(f"what you timed ran {1 / ratio:.0f}x faster than a {n}x{n}x{n} float32 matmul here: is it "
                    "a * b (elementwise: n² multiplies) rather than a @ b, or inputs smaller or in lower precision "
                    "than n x n float32 (torch.randn's default)?")
    if ratio > 5:
        raise Wrong(f"what you timed ran {ratio:.0f}x slower than a {n}x{n}x{n} float32 matmul here: there is "
                    "more than the matmul in the timed function (a conversion, a copy to the CPU, .item()?)")
    slips = {
        0.5: "factor 2 missing: an n×n×n matmul does n³ multiply-adds, each 2 FLOPs (a multiply and an add): "
             "2·n³ FLOPs.",
        1e3: "that is GFLOP/s (1e9): divide FLOP/s by 1e12 for TFLOP/s.",
        1e12: "that is FLOP/s: divide by 1e12 for TFLOP/s.",
        1e-3: "milliseconds used as seconds: the timer returns ms, so seconds = ms / 1000 (or * 1e-3).",
        1 / n: "the FLOP count is 2·n² (one row times one column?); a matmul is 2·n³.",
        0.5 / n: "the FLOP count is n²; an n×n×n matmul is 2·n³ FLOPs.",
    }
    tflops = _judge_rate(got, timer, lambda ms: 2 * n**3 / (ms * 1e-3) / 1e12, slips, "TFLOP/s", call)
    return f"{tflops:.3g} TFLOP/s from {last['ms']:.3g} ms for a {n}x{n}x{n} float32 matmul on the {chip(device)}."


q2 = CodeExercise(
    name="01.2 TFLOP/s from your timing", var="matmul_tflops", grade=_grade_matmul_tflops,
    references=References("make the inputs, time a @ b with `timer` and count the FLOPs yourself",
                           reference_matmul_tflops),
    signature="matmul_tflops(n, device, timer) -> float",
    hints=[
        "Make two random n×n float32 tensors on `device` first, outside the timing; then give `timer` a function "
        "that does only the multiply (a lambda around a @ b). It returns ms per call.",
        "C[m,n] = A[m,k]·B[k,n] is m·n·k multiply-adds, and a multiply-add is 2 FLOPs: 2·n³ FLOPs for n×n×n.",
        "Units: ms to seconds (x 1e-3); FLOPs over seconds is FLOP/s, and 1 TFLOP/s is 1e12 FLOP/s.",
    ],
    solution_text=source_as(reference_matmul_tflops, "matmul_tflops(n, device, timer)"),
)

# --- q3: device-to-device copy bandwidth -------------------------------------------------------------------


def reference_copy_gbps(nbytes: int, device: str, timer: Callable[[Callable[[], Any]], float]) -> float:
    """GB/s of copying ``nbytes`` on ``device`` (dst.copy_(src)), counting the read and the write: 2·nbytes."""
    src = torch.randn(nbytes // 4, device=device)  # float32: 4 bytes per element
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + write: 2 x nbytes moved


def _grade_copy_gbps(fn: Any) -> str:
    device = grading_device()
    nbytes = 2**30 if device == "cuda" else 32 * 2**20  # well above the caches either way
    label = f"{nbytes // 2**20} MiB"
    call = f"copy_gbps({nbytes}, {device!r}, timer)"
    timer = _Timer(device, iters=3, warmup=1)
    with one_cpu_thread(device):
        got = run_student(fn, nbytes, device, timer, call=call, timeout_s=120)
        last = _timed_call(timer, "dst.copy_(src)")
        out = last["out"]
        if isinstance(out, torch.Tensor):
            size = out.numel() * out.element_size()
            if size == 4 * nbytes:
                raise Wrong(f"the tensor you copied holds {size} bytes, 4x nbytes: torch.empty(nbytes) of float32 "
                            "has 4 bytes per element. Use nbytes // 4 float32 elements (or dtype=torch.uint8).")
            if size != nbytes:
                raise Wrong(f"the tensor you copied holds {size} bytes, not nbytes = {nbytes}: size the buffers so "
                            "that they hold nbytes bytes (nbytes // 4 float32 elements)")
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
        dst = torch.empty_like(src)
        ratio = _ratio_to_reference(last, lambda: dst.copy_(src), device, reps=3, band=(1 / 3, 3))
    if ratio > 3:
        raise Wrong(f"what you timed took {ratio:.1f}x as long as copying {label} here: does the timed function "
                    "allocate (clone(), torch.empty, torch.randn) or copy more than nbytes?")
    if ratio < 1 / 3:
        raise Wrong(f"what you timed took {ratio:.2f}x the time of copying {label} here: are the buffers smaller "
                    "than nbytes (nbytes is bytes; a float32 element is 4 of them)?")
    gib = 2**30 / 1e9
    slips = {
        0.5: "a copy moves every byte twice: it reads nbytes from src and writes nbytes to dst, so 2 × nbytes "
             "cross the memory bus. You counted nbytes once (the factor-of-2 mistake).",
        1 / gib: "that is GiB/s (2**30 bytes); bandwidth is quoted in GB/s, 1e9 bytes.",
        0.5 / gib: "GiB/s and the bytes counted once: a copy moves 2 × nbytes, and GB/s means 1e9 bytes per second.",
        1e3: "that is MB/s (1e6): divide bytes per second by 1e9 for GB/s.",
        1e-3: "milliseconds used as seconds: the timer returns ms, so seconds = ms / 1000.",
        2.0: "counted 4 × nbytes: a copy reads nbytes and writes nbytes, 2 × nbytes in all.",
    }
    gbps = _judge_rate(got, timer, lambda ms: 2 * nbytes / (ms * 1e-3) / 1e9, slips, "GB/s", call)
    return f"{gbps:.4g} GB/s from {last['ms']:.3g} ms for {label} on the {chip(device)} (read + write counted)."


q3 = CodeExercise(
    name="01.3 copy bandwidth", var="copy_gbps", grade=_grade_copy_gbps,
    references=References("make the buffers, time the copy with `timer` and count the bytes yourself",
                           reference_copy_gbps),
    signature="copy_gbps(nbytes, device, timer) -> float",
    hints=[
        "Make src (random) and dst (empty, same shape) once, each holding nbytes bytes: nbytes // 4 float32 "
        "elements. Time only the copy: give `timer` a function that calls dst.copy_(src) (ms per call).",
        "A copy reads every byte of src and writes every byte of dst: it moves 2 × nbytes through memory.",
        "Units: ms to seconds (x 1e-3); bytes over seconds is bytes/s, and 1 GB/s is 1e9 bytes/s, as bandwidth "
        "is quoted.",
    ],
    solution_text=source_as(reference_copy_gbps, "copy_gbps(nbytes, device, timer)"),
)

# --- q4/q5/q6: arithmetic intensity, the ridge, which roof ---------------------------------------------

_SAXPY_INTENSITY = 2 / 12  # FLOP/byte: a multiply and an add per element; read x, read y, write y (fp32)
H200_RIDGE = specs.ridge_point(specs.H200_SXM.bf16_tflops, specs.H200_SXM.hbm_tbps)  # FLOP/byte, ~206 (datasheet)

q4 = Exercise(
    name="01.4 arithmetic intensity of saxpy", var="saxpy_intensity",
    grade=close_to(
        _SAXPY_INTENSITY, rel=0.05, reveal=False,
        why="Intensity = FLOPs / bytes moved to and from memory, per element of y = a*x + y in fp32.",
        slips={
            1.5: "the write counts too: y is read and written back, so 3 fp32 values move per element.",
            0.5: "half: a*x + y is 2 FLOPs per element (a multiply and an add), and fp32 is 4 bytes, not 8.",
            4.0: "count bytes, not elements: each fp32 value is 4 bytes.",
            36.0: "inverted: intensity is FLOPs per byte, not bytes per FLOP.",
        },
    ),
    hints=[
        "Per element: how many FLOPs does a*x + y take, and how many values move between memory and "
        "the chip (reads and writes)?",
        "2 FLOPs (multiply, add). x and y are read, y is written: 3 values of fp32, 4 bytes each.",
        "Intensity is FLOPs over bytes, both per element: the FLOPs of one element over the bytes it moves.",
    ],
    solution_text="saxpy_intensity = 2 / (3 * 4)   # 0.167 FLOP/byte: 2 FLOPs; read x, read y, write y, 4 bytes each",
)

q5 = Exercise(
    name="01.5 roofline ridge of the H200", var="ridge_flop_per_byte",
    grade=close_to(
        H200_RIDGE, rel=0.02, reveal=False,
        why="Ridge = peak FLOP/s / bandwidth in bytes/s, for dense bf16 on the H200 datasheet.",
        slips={
            **dict.fromkeys((1e-3, 1e3), "a units slip (factor 1000): TFLOP/s is 1e12 FLOP/s and TB/s is 1e12 "
                                         "bytes/s, so divide 989 by 4.8, or 989e12 by 4.8e12."),
            1 / H200_RIDGE**2: "inverted: the ridge is FLOP/s divided by bytes/s (FLOP per byte).",
            0.5: "half: that is the TF32 peak (494.5 TFLOP/s); the question asks for dense bf16 (989).",
            2.0: "double: 1979 TFLOP/s is the sparse bf16 (or dense FP8) figure; use dense bf16 (989).",
            67 / 989: "that is the FP32 ridge without tensor cores (67 TFLOP/s); the question asks for bf16.",
        },
    ),
    hints=[
        "The ridge point is where a roofline's slanted (bandwidth) and flat (compute) parts meet: "
        "peak FLOP/s / bandwidth in bytes/s.",
        "H200 datasheet: 989 TFLOP/s dense bf16 (tensor cores), 4.8 TB/s HBM3e.",
        "Divide the two in base units (FLOP/s over bytes/s: tera is 1e12 for both); the result is in FLOP/byte.",
    ],
    solution_text="ridge_flop_per_byte = 989e12 / 4.8e12   # ~206 FLOP/byte: ops below it are memory-bound",
)


# Whole answers that mean the same as each choice (a roofline's two roofs go by several names).
_BOUND_SYNONYMS = {
    "memory": ["memory-bound", "memory bandwidth", "memory-bandwidth-bound", "bandwidth", "bandwidth-bound",
               "HBM-bound", "memory limited", "bandwidth limited"],
    "compute": ["compute-bound", "math", "math-bound", "FLOP-bound", "FLOPs-bound", "compute limited",
                "arithmetic-bound"],
}


q6 = Exercise(
    name="01.6 saxpy: memory- or compute-bound", var="saxpy_bound",
    grade=one_of("memory", ["memory", "compute"], synonyms=_BOUND_SYNONYMS,
                 why=f"saxpy's ~0.17 FLOP/byte is far below the H200's ridge point (~{H200_RIDGE:.0f} FLOP/byte): "
                     "the chip waits on memory, not on arithmetic."),
    hints=[
        "Compare the op's arithmetic intensity (01.4) with the GPU's ridge point: peak FLOP/s divided by "
        "memory bandwidth.",
        f"The H200's ridge is about {H200_RIDGE:.0f} FLOP/byte; below it, the op cannot use the arithmetic "
        "the chip has.",
        "0.17 FLOP/byte is more than a thousand times below the ridge: answer \"memory\" or \"compute\".",
    ],
    solution_text='saxpy_bound = "memory"   # 0.17 FLOP/byte << ~206 FLOP/byte: time = bytes / bandwidth',
)

