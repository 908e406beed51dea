"""Lab 06's exercise checks against right, blank and plausible wrong answers (run on this machine's real device);
the trace helpers against hand-computed traces; the planted programs, memory tables and the async-error demo."""

from __future__ import annotations

import copy
import math
import os
import random

import pytest
import torch
from _exercise_harness import as_written, check, exercises_of, hint_and_solution_tests, standard_tests
from torch.profiler import ProfilerActivity, profile, schedule

from lab_utils.exercises import lab06
from lab_utils.exercises.framework import Status
from lab_utils.profiling import errors, memory, nsight, programs
from lab_utils.profiling import trace as tr

# --- student-style answers ----------------------------------------------------------------------------------


def _activities():
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def profile_right_other_order(step, trace_path):
    prof = profile(schedule=schedule(wait=1, warmup=1, active=3), activities=_activities())
    prof.start()
    for _ in range(5):
        step()
        prof.step()
    prof.stop()
    prof.export_chrome_trace(trace_path)


def profile_no_schedule(step, trace_path):
    with profile(activities=_activities()) as prof:
        for _ in range(5):
            step()
            prof.step()
    prof.export_chrome_trace(trace_path)


def profile_wait_zero(step, trace_path):
    with profile(activities=_activities(), schedule=schedule(wait=0, warmup=1, active=3)) as prof:
        for _ in range(5):
            step()
            prof.step()
    prof.export_chrome_trace(trace_path)


def profile_no_export(step, trace_path):
    with profile(activities=_activities(), schedule=schedule(wait=1, warmup=1, active=3)) as prof:
        for _ in range(5):
            step()
            prof.step()


def profile_four_steps(step, trace_path):
    with profile(activities=_activities(), schedule=schedule(wait=1, warmup=1, active=3)) as prof:
        for _ in range(4):
            step()
            prof.step()
    prof.export_chrome_trace(trace_path)


def _window(trace):
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "kernel"]
    t0 = min(e["ts"] for e in steps)
    t1 = max([e["ts"] + e["dur"] for e in steps] + [b for a, b in kernels if a >= t0])
    return kernels, t0, t1


def busy_right_with_helper_logic(trace):  # written differently: a sweep over start/end points
    kernels, t0, t1 = _window(trace)
    points = sorted([(max(a, t0), 1) for a, b in kernels if min(b, t1) > max(a, t0)]
                    + [(min(b, t1), -1) for a, b in kernels if min(b, t1) > max(a, t0)])
    busy, depth, last = 0.0, 0, None
    for t, d in points:
        if depth > 0:
            busy += t - last
        depth += d
        last = t
    return busy / (t1 - t0)


def busy_sum_of_durations(trace):
    kernels, t0, t1 = _window(trace)
    return sum(min(b, t1) - max(a, t0) for a, b in kernels if min(b, t1) > max(a, t0)) / (t1 - t0)


def busy_over_kernel_time(trace):
    kernels, t0, t1 = _window(trace)
    total = sum(b - a for a, b in kernels)
    return total / total


def busy_no_clipping(trace):
    kernels, t0, t1 = _window(trace)
    return tr.union_us(kernels) / (t1 - t0)


def busy_steps_only(trace):
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "kernel"]
    t0, t1 = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    return tr.union_us(kernels, (t0, t1)) / (t1 - t0)


def busy_percent(trace):
    return 100 * busy_right_with_helper_logic(trace)


def loader_right_two_workers(dataset, batch_size, device):
    return torch.utils.data.DataLoader(dataset, batch_size, shuffle=True, num_workers=2,
                                       pin_memory=device == "cuda")


def loader_pinned_only(dataset, batch_size, device):
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, pin_memory=True)


def loader_iterator(dataset, batch_size, device):
    return iter(torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=2,
                                            pin_memory=device == "cuda"))


def loader_wrong_batch(dataset, batch_size, device):
    return torch.utils.data.DataLoader(dataset, batch_size=32, num_workers=2, pin_memory=device == "cuda")


def loop_right_stacked(model, opt, batches, log_every):  # written differently: one read-back at the very end
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).view(-1, log_every).mean(1).tolist()


def loop_item_every_step(model, opt, batches, log_every):
    out, running = [], 0.0
    for i, (x, y) in enumerate(batches, start=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        running += loss.item()
        if i % log_every == 0:
            out.append(running / log_every)
            running = 0.0
    return out


def loop_nan_check(model, opt, batches, log_every):
    out, running = [], torch.zeros(())
    for i, (x, y) in enumerate(batches, start=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if torch.isnan(loss):  # a sync hidden in an if
            raise FloatingPointError
        opt.zero_grad()
        loss.backward()
        opt.step()
        running = running + loss.detach()
        if i % log_every == 0:
            out.append(running.item() / log_every)
            running = torch.zeros(())
    return out


def loop_last_loss(model, opt, batches, log_every):
    out = []
    for i, (x, y) in enumerate(batches, start=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i % log_every == 0:
            out.append(loss.item())
    return out


def loop_never_reset(model, opt, batches, log_every):
    out, running = [], torch.zeros(())
    for i, (x, y) in enumerate(batches, start=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        running += loss.detach()
        if i % log_every == 0:
            out.append(running.item() / log_every)
    return out


def loop_no_zero_grad(model, opt, batches, log_every):
    out, running = [], torch.zeros(())
    for i, (x, y) in enumerate(batches, start=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        running += loss.detach()
        if i % log_every == 0:
            out.append(running.item() / log_every)
            running.zero_()
    return out


CASES = [
    (lab06.q1, [lab06.reference_profile_steps, profile_right_other_order],
     [profile_no_schedule, profile_wait_zero, profile_no_export, profile_four_steps]),
    (lab06.q2, [lab06.reference_gpu_busy_fraction, busy_right_with_helper_logic, tr.busy_fraction],
     [busy_sum_of_durations, busy_over_kernel_time, busy_no_clipping, busy_steps_only, busy_percent]),
    (lab06.q4, [lab06.reference_make_loader, loader_right_two_workers],
     [loader_pinned_only, loader_iterator, loader_wrong_batch]),
    (lab06.q5, [lab06.reference_train_loop, loop_right_stacked],
     [loop_item_every_step, loop_nan_check, loop_last_loss, loop_never_reset, loop_no_zero_grad]),
    (lab06.q3, [as_written(lab06.DIAGNOSIS_CASES),
                {"D": "launch-bound", "C": "Data loading", "B": "BF16", "A": "host sync"}],
     [{"A": "launch", "B": "precision", "C": "data", "D": "sync"}, {"A": "sync", "B": "precision", "C": "data"},
      {"A": "sync", "B": "data", "C": "precision", "D": "launch"}, "data"]),
    (lab06.q6, [{"gemm": "compute", "elementwise": "memory"}, {"elementwise": "Memory-bound", "gemm": "compute bound"}],
     [{"gemm": "memory", "elementwise": "compute"}, {"gemm": "compute", "elementwise": "compute"},
      {"gemm": "compute"}, "compute"]),
]

test_right, test_wrong, test_blank = standard_tests(CASES)
test_hints, test_solutions = hint_and_solution_tests(exercises_of(lab06))


def test_wrong_answers_get_their_own_message():
    assert "schedule" in check(lab06.q1, profile_no_schedule).message
    assert "wait=1, warmup=1, active=3" in check(lab06.q1, profile_wait_zero).message
    assert "export_chrome_trace" in check(lab06.q1, profile_no_export).message
    assert "called 4 times" in check(lab06.q1, profile_four_steps).message
    assert "union" in check(lab06.q2, busy_sum_of_durations).message
    assert "wall time" in check(lab06.q2, busy_over_kernel_time).message
    assert "clip" in check(lab06.q2, busy_no_clipping).message
    assert "last kernel" in check(lab06.q2, busy_steps_only).message
    assert "percentage" in check(lab06.q2, busy_percent).message
    assert "num_workers is 0" in check(lab06.q4, loader_pinned_only).message
    assert "DataLoader itself" in check(lab06.q4, loader_iterator).message
    assert "read-backs" in check(lab06.q5, loop_item_every_step).message
    assert "__bool__" in check(lab06.q5, loop_nan_check).message
    assert "last step's loss" in check(lab06.q5, loop_last_loss).message
    assert "swapped" in check(lab06.q6, {"gemm": "memory", "elementwise": "compute"}).message


def test_the_loader_check_measures_the_wait():
    out = check(lab06.q4, lab06.reference_make_loader)
    assert out.status is Status.CORRECT and "ms in the main process" in out.message


def test_the_loader_check_measures_a_miss_again(monkeypatch):
    """A busy machine starved the solution's workers once in CI (36.1 ms against the main process's 37.4): a miss is
    measured again, and only a second miss is wrong. Waits per batch: the main-process loader's, then the answer's."""
    def waits(*runs):
        it = iter([w] * 5 for w in runs)
        monkeypatch.setattr(lab06, "_batch_waits", lambda loader: next(it))

    waits(0.037, 0.036, 0.037, 0.001)
    assert check(lab06.q4, lab06.reference_make_loader).status is Status.CORRECT
    waits(0.037, 0.036, 0.037, 0.030)
    out = check(lab06.q4, lab06.reference_make_loader)
    assert out.status is Status.INCORRECT and "still waited 30.0 ms" in out.message, out.message


def test_a_loader_with_persistent_workers_is_measured_twice():
    """The second measurement of a miss iterates the answer's loader again: with persistent workers that reused the
    iterator the first one had shut, and raised "Queue ... is closed" (a CI run on a busy machine)."""
    ds = lab06.PngDigits(size=16, storage_ms=lab06.LOADER_STORAGE_MS)
    loader = lab06.reference_make_loader(ds, lab06.LOADER_BATCH, "cpu")
    assert loader.persistent_workers and loader.num_workers >= 1
    assert all(len(lab06._batch_waits(loader, batches=3)) == 1 for _ in range(2))


# --- trace helpers ---------------------------------------------------------------------------------------


def _ev(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_busy_fraction_by_hand():
    trace = {"traceEvents": [
        _ev("user_annotation", "ProfilerStep#2", 0, 100), _ev("user_annotation", "ProfilerStep#3", 100, 100),
        _ev("kernel", "a", -50, 60, 7),  # 10 µs inside the window
        _ev("kernel", "b", 20, 40, 7), _ev("kernel", "c", 30, 40, 9),  # union 20..70 = 50
        _ev("kernel", "d", 190, 30, 7),  # ends at 220: the window grows to 220, 30 µs busy
    ]}
    assert tr.step_window(tr.events(trace)) == (0, 220)
    assert tr.busy_fraction(trace) == pytest.approx((10 + 50 + 30) / 220)
    assert lab06.reference_gpu_busy_fraction(trace) == pytest.approx((10 + 50 + 30) / 220)


def test_reference_and_helper_agree_on_random_traces():
    rng = random.Random(1)
    for _ in range(20):
        t = lab06.random_trace(rng)
        assert lab06.reference_gpu_busy_fraction(t) == pytest.approx(tr.busy_fraction(t), rel=1e-9)


def test_trace_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="export_chrome_trace"):
        tr.load_trace(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        tr.load_trace(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="prof.step"):
        tr.step_window(tr.events({"traceEvents": [_ev("kernel", "k", 0, 1)]}))


def test_a_real_cpu_trace_summary_and_timeline(tmp_path):
    with programs.build("data", "planted", "cpu", quick=True) as prog:
        lab06.reference_profile_steps(prog.step, tmp_path / "t.json")
    trace = tr.load_trace(tmp_path / "t.json")
    s = tr.summarize(trace)
    assert s["steps"] == 3 and s["gpu_busy"] is None and s["step_ms"] > 0
    assert s["data_wait"] > 0.05  # the main-process loader shows as DataLoader next() time
    assert s["syncs_per_step"] == 0  # a CPU has no device to wait for: .item() leaves no trace there
    top = tr.top_ops(tr.events(trace), "cpu_op", 5)
    assert len(top) == 5 and top["total_us"].is_monotonic_decreasing
    import matplotlib

    matplotlib.use("Agg")
    ax = tr.plot_timeline(trace)
    assert "ProfilerStep#3" in ax.get_title()
    small = tr.trim_trace(trace)
    assert all(e["cat"] in ("user_annotation", "kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
               for e in small["traceEvents"])


# --- programs, memory, errors, tools ----------------------------------------------------------------------


def test_every_program_runs_and_closes_its_workers():
    for name in programs.PROGRAMS:
        for variant in programs.VARIANTS[name]:
            if variant in ("compile", "reduce-overhead", "max-autotune"):
                continue  # compiling takes tens of seconds on 2 cores; the lab runs them on a GPU
            with programs.build(name, variant, "cpu", quick=True) as prog:
                assert programs.time_steps(prog.step, steps=2, warmup=1) > 0
    import multiprocessing

    assert not multiprocessing.active_children()


def test_build_rejects_unknown_names():
    with pytest.raises(ValueError, match="one of data, sync"):
        programs.build("dataa", "planted", "cpu")
    with pytest.raises(ValueError, match="one of planted, fixed"):
        programs.build("data", "fast", "cpu")


def test_checkpointing_saves_memory_and_accumulation_matches():
    rows = {r["mode"]: r for r in memory.checkpoint_table(64, 4, 256, "cpu", reps=1)}
    assert rows["full"]["peak_mib"] < rows["selective"]["peak_mib"] < rows["none"]["peak_mib"]
    acc = memory.accumulation_table(64, 2, 64, 4, "cpu", reps=1)
    assert acc[1]["peak_mib"] < acc[0]["peak_mib"]
    assert acc[0]["max_rel_grad_diff"] < 1e-4


def test_oom_is_a_real_allocation_error():
    err = memory.oom_error("cpu")
    assert "allocate" in err["message"] and err["type"] == "RuntimeError"


def test_bad_index_on_cpu_points_at_the_right_line():
    r = errors.run_bad_index("cpu", launch_blocking=False)
    assert r["reported_line"] == errors.BAD_LINE and "IndexError" in r["error"]


def test_profilers_missing_say_why():
    if nsight.shutil.which("ncu") is None:
        run = nsight.run_ncu()
        assert not run.ran and "ncu" in run.why_not and "--clock-control" in run.command
    if nsight.shutil.which("nsys") is None:
        run = nsight.run_nsys()
        assert not run.ran and "nsys" in run.why_not


def test_ncu_csv_is_parsed():
    text = ('==PROF== Connected\n"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","1","python","h","nvjet_gemm","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","GPU Speed Of Light '
            'Throughput","Compute (SM) Throughput","%","88.51"\n'
            '"0","1","python","h","nvjet_gemm","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","GPU Speed Of Light '
            'Throughput","Duration","nsecond","1,402,112"\n')
    rows = nsight.parse_ncu_csv(text)
    assert rows == [{"id": 0, "kernel": "nvjet_gemm", "Compute (SM) Throughput [%]": 88.51,
                     "Duration [nsecond]": 1402112.0}]


@pytest.mark.skipif(os.environ.get("NVLAB_TEST_GPU") != "1" or not torch.cuda.is_available(), reason="GPU only")
def test_bad_index_on_gpu_surfaces_late_without_launch_blocking():
    late = errors.run_bad_index("cuda", launch_blocking=False)
    right = errors.run_bad_index("cuda", launch_blocking=True)
    assert right["reported_line"] == errors.BAD_LINE
    assert late["reported_line"] != errors.BAD_LINE


def test_ncu_rows_are_labelled_by_kernel_name_and_durations_scaled():
    rows = [{"kernel": "void at::native::vectorized_elementwise_kernel<4>", "Duration [usecond]": 200.0},
            {"kernel": "splitKreduce_kernel", "Duration [usecond]": 3.0},
            {"kernel": "nvjet_tst_256x128", "Duration [msecond]": 1.5}]
    rows[2]["Duration [usecond]"] = 1500.0
    nsight.label_kernels(rows, 1024, 2**20)
    assert rows[0]["op"].startswith("add") and rows[2]["op"].startswith("GEMM") and "op" not in rows[1]
    assert nsight.duration_s({"Duration [nsecond]": 2e6}) == pytest.approx(2e-3)
    assert nsight.duration_s({"x": 1}) is None


def test_each_wrong_busy_fraction_is_named_on_every_random_trace():
    """The slip is named on any trace the grader may draw: a clipped sum of durations near 1.0 once read as
    "divided by the kernels' own time" (a tolerance looser than the grading's)."""
    variants = [(busy_sum_of_durations, "union"), (busy_over_kernel_time, "wall time"), (busy_no_clipping, "clip"),
                (busy_steps_only, "last kernel"), (busy_percent, "percentage")]
    for seed in range(400):
        trace = lab06.random_trace(random.Random(seed))
        want = lab06.reference_gpu_busy_fraction(trace)
        guesses = lab06.slip_guesses(trace, want)  # once per trace: the grader's own computation, 5 answers
        for fn, word in variants:
            got = float(fn(copy.deepcopy(trace)))
            if not math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6):
                assert word in (lab06._slips(trace, got, want, guesses) or ""), (seed, fn.__name__, got, want)
