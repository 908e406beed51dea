"""The lab panels (lab_utils.widgets) driven from Python: each callback runs by setting a control's value or
clicking its button, against the real thing the lab uses (torch matmuls, a Triton server, Prometheus scraping it,
the quiz bank). Also the rule that makes them headless, and the progress hook."""

from __future__ import annotations

import math

import pytest
from _triton import require_server, tiny_repo

from lab_utils import widgets
from lab_utils.course import specs
from lab_utils.exercises import quiz
from lab_utils.exercises.framework import Status
from lab_utils.gpu import bench
from lab_utils.timing import Ticks
from lab_utils.widgets import core

# --- the rule -------------------------------------------------------------------------------------------------


def test_headless_outside_a_kernel_and_under_the_course_runners(monkeypatch):
    monkeypatch.delenv(core.HEADLESS_ENV, raising=False)
    monkeypatch.delenv("NVLAB_RUN_ID", raising=False)
    assert not widgets.interactive()  # pytest is no kernel
    monkeypatch.setattr(core, "_in_kernel", lambda: True)  # as inside JupyterLab's kernel
    assert widgets.interactive()
    monkeypatch.setenv("NVLAB_RUN_ID", "nbval-x")  # nvlab run / nbval
    assert not widgets.interactive()
    monkeypatch.delenv("NVLAB_RUN_ID")
    monkeypatch.setenv(core.HEADLESS_ENV, "1")
    assert not widgets.interactive()


def test_progress_headless_prints_one_line_and_the_sweep_takes_it(capsys):
    assert list(widgets.progress(range(3), total=3, desc="three")) == [0, 1, 2]
    assert capsys.readouterr().out.strip().startswith("three: 3 steps in ")
    df = bench.matmul_sweep(sizes=[32], dtypes=["fp32", "tf32"], device="cpu", reps=2, progress=widgets.progress)
    assert list(df["status"]) == ["ok", "skipped"]
    assert "matmul sweep: 2 steps" in capsys.readouterr().out
    bench.matmul_sweep(sizes=[32], dtypes=["fp32"], device="cpu", reps=2)  # no hook: nothing printed
    assert capsys.readouterr().out == ""


def test_progress_ends_its_line_when_the_loop_stops_early_and_refuses_bad_input(capsys):
    for i in widgets.progress(range(10), total=10, desc="early"):
        if i == 3:
            break
    assert capsys.readouterr().out.strip().startswith("early: 3 steps in ")  # counted as tqdm counts
    with pytest.raises(ValueError, match="total=-1"):
        widgets.progress(range(3), total=-1)
    with pytest.raises(TypeError, match="loop over"):
        widgets.progress(5)
    with pytest.raises(TypeError, match="desc"):
        widgets.progress(range(3), desc=3)


def test_progress_hooks_of_the_load_phases_the_drill_and_torch_paths(capsys):
    import torch

    from lab_utils.inference import torch_paths
    from lab_utils.monitoring import drills

    phases = [drills.Phase("a", 1, 0.01), drills.Phase("b", 2, 0.01)]
    df = drills.run_phases(phases, lambda c, s: {"requests": c}, progress=widgets.progress)
    assert list(df["requests"]) == [1, 2] and "load phases: 2 steps" in capsys.readouterr().out
    drills.run_phases(phases, lambda c, s: {"requests": c})  # no hook: nothing printed
    assert capsys.readouterr().out == ""

    # the drill's steps are events, not a loop: each recorded step advances the bar; it ends with the load
    ticks = Ticks(widgets.progress, total=3, desc="drill")
    res = drills.DrillResult(on_step=ticks.step)
    for what in ("load started", "server killed", "live again"):
        res.step(what)
    ticks.close()
    ticks.close()  # twice is harmless
    assert "drill: 3 steps in " in capsys.readouterr().out and len(res.steps) == 3
    Ticks(None, total=3, desc="off").step()  # no hook: nothing
    assert capsys.readouterr().out == ""

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    runners = list(torch_paths.torch_runners(model, torch.zeros(2, 4), steps=("eager",), progress=widgets.progress))
    assert [r.name for r in runners] == ["eager"]
    assert "torch paths, batch 2: 1 step in " in capsys.readouterr().out


def test_progress_bar_headless_prints_a_line_now_and_then_and_one_at_the_end(capsys, monkeypatch):
    from types import SimpleNamespace

    clock = iter(float(t) for t in range(100))  # one second per reading of the clock
    monkeypatch.setattr(core.time, "perf_counter", lambda: next(clock))
    with widgets.progress_bar(total=4, desc="SLO run", every_s=2) as bar:
        for _ in range(3):
            bar.update(SimpleNamespace(p95_ms=3.0))  # what on_window passes: one step
        bar.update(1)
        assert bar.n == 4 and not bar.closed
    assert bar.closed
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[:2] == ["SLO run: 2/4 after 2 s", "SLO run: 4/4 after 4 s"]  # at most one line every 2 s
    assert lines[-1] == "SLO run: 4 steps in 5.0 s" and len(lines) == 3
    bar.close()
    bar.update()  # closed: nothing
    assert capsys.readouterr().out == "" and bar.n == 4


def test_progress_bar_refuses_bad_input():
    with pytest.raises(ValueError, match="total=-1"):
        widgets.progress_bar(total=-1)
    with pytest.raises(ValueError, match="total=True"):
        widgets.progress_bar(total=True)
    with pytest.raises(TypeError, match="desc"):
        widgets.progress_bar(desc=3)
    with pytest.raises(ValueError, match="every_s"):
        widgets.progress_bar(every_s=0)
    bar = widgets.progress_bar(desc="x")
    with pytest.raises(ValueError, match="update"):
        bar.update(-2)
    bar.close()


def test_progress_bar_interactive_is_a_tqdm_bar(monkeypatch, capsys):
    monkeypatch.delenv(core.HEADLESS_ENV, raising=False)
    monkeypatch.delenv("NVLAB_RUN_ID", raising=False)
    monkeypatch.setattr(core, "_in_kernel", lambda: True)
    with widgets.progress_bar(total=3, desc="windows") as bar:
        bar.update(object())
        bar.update(2)
        assert bar._tqdm is not None and bar._tqdm.n == 3 and bar._tqdm.total == 3
    assert bar.closed and capsys.readouterr().out == ""  # the bar, no printed lines
    assert list(widgets.progress(range(2), total=2, desc="i")) == [0, 1]  # the loop hook too
    assert capsys.readouterr().out == ""


def test_find_capacity_advances_its_progress_hook_per_rate_tried(monkeypatch, capsys):
    from types import SimpleNamespace

    from lab_utils.serving import capacity

    async def send():
        pass

    # a server that holds 37 req/s: the runs and the SLO rule faked, the search itself is the real one
    monkeypatch.setattr(capacity, "run_open_loop", lambda target, rate, *a, **k: SimpleNamespace(
        rate=rate, achieved_rps=rate, p50_ms=1.0, p95_ms=2.0, p99_ms=3.0, errors=0, stable=True))
    monkeypatch.setattr(capacity, "meets_slo", lambda r, *a: (r.rate <= 37, "faked"))
    monkeypatch.setattr(capacity, "drain", lambda *a, **k: True)
    kw = {"lo_rps": 10.0, "hi_rps": 70.0, "tolerance": 0.05}
    plain = capacity.find_capacity(send, 100.0, **kw)
    assert capsys.readouterr().out == ""  # no hook: nothing shown
    shown = capacity.find_capacity(send, 100.0, progress=widgets.progress, **kw)
    assert shown.steps == plain.steps and shown.capacity_rps == plain.capacity_rps and 30 <= plain.capacity_rps <= 37
    assert f"capacity search: {len(plain.steps)} steps in " in capsys.readouterr().out
    capped = capacity.find_capacity(send, 100.0, progress=widgets.progress, max_steps=4, **kw)
    assert len(capped.steps) == 4 and "capacity search: 4 steps in " in capsys.readouterr().out
    capacity.find_capacity(send, 100.0, progress=widgets.progress, lo_rps=40.0, hi_rps=70.0)  # lo fails: 1 run
    assert "capacity search: 1 step in " in capsys.readouterr().out
    capacity.find_capacity(send, 100.0, progress=widgets.progress, lo_rps=1.0, hi_rps=20.0)  # hi passes: 2 runs
    assert "capacity search: 2 steps in " in capsys.readouterr().out


def test_hot_update_advances_its_progress_hook_per_step(monkeypatch, capsys, tmp_path):
    from types import SimpleNamespace

    from lab_utils.serving import ensemble as ens
    from lab_utils.serving import load, service

    (tmp_path / "clf" / "2").mkdir(parents=True)
    (tmp_path / "clf" / "2" / "model.onnx").write_bytes(b"")
    served = {"v": ["1"]}
    monkeypatch.setattr(ens, "version_states", lambda *a, **k: {v: "READY" for v in served["v"]})
    monkeypatch.setattr(ens, "set_served_versions", lambda path, vs, name=None: served.update(v=[str(v) for v in vs]))
    monkeypatch.setattr(service.triton_client, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(service, "version_counts", lambda *a, **k: {"1": 1.0})
    monkeypatch.setattr(load, "run_open_loop", lambda *a, **k: "the load's result")
    svc = SimpleNamespace(repo=SimpleNamespace(path=tmp_path, classifier="clf"), alive=lambda: True, lb=None,
                          servers=[SimpleNamespace(grpc_url="g:1")], target=lambda protocol: None)
    up = service.hot_update(svc, 2, warmup_s=0.01, pause_s=0.01, sample_s=0.01, progress=widgets.progress)
    assert up.result == "the load's result" and len(up.steps) == 2
    assert "hot update: 2 steps in " in capsys.readouterr().out
    service.hot_update(svc, 2, warmup_s=0.01, pause_s=0.01, sample_s=0.01)  # no hook: nothing printed
    assert capsys.readouterr().out == ""


def test_digits_comparison_counts_rank_0s_epochs(capfd):
    from lab_utils.distributed import ddp

    df = ddp.digits_comparison((1,), epochs=2, backend="gloo", progress=widgets.progress)
    assert list(df["epochs"]) == [2]
    assert "digits training: epochs: 2 steps in " in capfd.readouterr().out


# --- lab 01: the roofline explorer ------------------------------------------------------------------------------


def test_roofline_explorer_measures_each_choice_beside_the_h200_points(capsys):
    panel = widgets.roofline_explorer("cpu", [32, 64], dtypes=["fp32", "bf16", "fp8"], reps=2)
    out = capsys.readouterr().out
    ref = specs.h200_reference_tflops()  # the committed H200 run's points, whatever run that is
    assert out.startswith("fp32 n=32 on ") and f"H200 reference {ref['fp32']:.1f} TFLOP/s" in out  # headless
    panel.dtype.value = "bf16"  # as the dropdown in the page does
    assert panel.last["dtype"] == "bf16" and panel.last["status"] == "ok"
    assert "bf16 n=32" in panel.status.value and f"{ref['bf16']:.1f}" in panel.status.value
    panel.size.value = 64
    assert list(panel.points["n"]) == [32, 32, 64]
    assert math.isclose(panel.points["intensity_flop_per_byte"].iloc[-1], 2 * 64**3 / (3 * 64 * 64 * 2))
    panel.dtype.value = "fp8"  # the CPU cannot: said, no point added
    assert "not measured here" in panel.status.value and len(panel.points) == 3
    ax = panel.figure().axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "H200 reference bf16" in labels and "here bf16" in labels and "here fp32" in labels


def test_roofline_explorer_points_are_never_under_its_legend():
    # A CPU's points sit low on the H200's roofline, where the legend ("best" place) covered them.
    panel = widgets.roofline_explorer("cpu", [32, 256], dtypes=["fp32"], reps=2)
    panel.size.value = 256
    fig = panel.figure()
    fig.canvas.draw()
    ax = fig.axes[0]
    box = ax.get_legend().get_window_extent()
    assert not box.overlaps(ax.get_window_extent()), (box, ax.get_window_extent())  # beside the axes, whatever the data
    for collection in ax.collections:  # every scatter point, in the figure's pixels
        for x, y in ax.transData.transform(collection.get_offsets()):
            assert not box.contains(x, y), (collection.get_label(), x, y, box)


def test_roofline_explorer_refuses_bad_choices_and_shows_a_failed_measurement(monkeypatch):
    for kwargs, said in (({"sizes": []}, "sizes"), ({"sizes": [0]}, "sizes"), ({"dtypes": ["fp4"]}, "dtypes"),
                         ({"dtype": "bf16", "dtypes": ["fp32"]}, "dtype='bf16'"), ({"n": 48}, "n=48"),
                         ({"reps": 0}, "reps")):
        with pytest.raises(ValueError, match=said):
            widgets.roofline_explorer("cpu", **{"sizes": [32], **kwargs})
    panel = widgets.roofline_explorer("cpu", [32], dtypes=["fp32", "bf16"], reps=1)

    def broken(**_kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(bench, "matmul_sweep", broken)
    panel.dtype.value = "bf16"  # the callback's error is shown in the panel, not lost in the kernel's log
    assert "RuntimeError: out of memory" in panel.status.value


def test_live_view_refuses_a_bad_window_or_interval():
    with pytest.raises(ValueError, match="every_s"), widgets.live_view(object(), "5s", every_s=0):
        pass
    with pytest.raises(ValueError, match="window"), widgets.live_view(object(), "5 seconds"):
        pass


# --- lab 09: the quiz, question by question ---------------------------------------------------------------------


def _fill(panel, value):
    """Put ``value`` (in check's form) into the panel's controls, as a student would."""
    q = panel.question
    if q.form == "single":
        panel._inputs["value"].value = value
    elif q.form == "multi":
        for k, box in panel._inputs.items():
            box.value = k in value
    elif q.form == "match":
        for k, box in panel._inputs.items():
            box.value = value[k]
    else:
        panel._inputs["value"].value = ", ".join(value) if q.form == "order" else str(value)


def test_quiz_panel_grades_every_form_right_blank_and_wrong():
    bank = quiz.load_bank()
    forms = {}
    for q in bank.questions:
        forms.setdefault(q.form, q)
    runner = quiz.QuizRunner(bank)
    runner.questions = list(forms.values())  # one question of each form
    panel = widgets.quiz_panel(runner)  # opens (headless: prints) the first question
    for i, q in enumerate(forms.values()):
        if i:
            panel.next_button.click()
        assert panel.question is q and q.id in panel.prompt.value
        panel.submit.click()
        assert panel.outcome.status is Status.NOT_ATTEMPTED
        _fill(panel, q.key())
        panel.submit.click()
        assert panel.outcome.correct, (q.id, panel.feedback.value)
        assert "Why:" in panel.feedback.value
        wrong = {"single": "zz", "multi": ["zz"], "order": ["zz"], "numeric": "-1e9"}.get(q.form)
        if q.form == "match":
            a, b = list(q.key())[:2]
            wrong = {**q.key(), a: q.key()[b], b: q.key()[a]}
        if q.form in ("single", "multi"):  # a key not offered cannot be picked in the page: another real key
            keys = q._keys()
            wrong = next(k for k in keys if k != q.key()) if q.form == "single" else keys[:1] if \
                keys[:1] != q.key() else keys[:2]
        _fill(panel, wrong)
        panel.submit.click()
        assert panel.outcome.status is Status.INCORRECT, (q.id, wrong)
    panel.next_button.click()
    assert panel.question is None and panel.submit.disabled and "End of the quiz" in panel.prompt.value
    assert set(runner.outcomes) == {q.id for q in forms.values()}


def test_quiz_panel_in_chinese_speaks_chinese():
    # language="zh" translated the questions, but the buttons and the status line stayed English.
    bank = quiz.load_bank()
    runner = quiz.QuizRunner(bank, language="zh")
    runner.questions = [next(q for q in bank.questions if q.form == "single")]
    panel = widgets.quiz_panel(runner)
    assert (panel.submit.description, panel.next_button.description) == ("提交", "下一题")
    assert panel._inputs["value"].description == "答案"
    panel.submit.click()
    assert "未作答" in panel.feedback.value and "not attempted" not in panel.feedback.value
    _fill(panel, panel.question.key())
    panel.submit.click()
    assert "正确" in panel.feedback.value and "解析:" in panel.feedback.value and "correct" not in panel.feedback.value
    panel.next_button.click()
    assert "测验结束" in panel.prompt.value and "End of the quiz" not in panel.prompt.value


# --- lab 04: the knob panel, against a real Triton --------------------------------------------------------------


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    from lab_utils.serving.server import TritonServer

    require_server()
    repo = tiny_repo(tmp_path_factory.mktemp("knobs"))
    with TritonServer(repo, model_control="explicit") as server:
        yield server, repo


def test_knob_panel_apply_redeploys_and_measure_appends_a_row(triton, capsys):
    from lab_utils.serving import client as triton_client
    from lab_utils.serving import repository as triton_repo
    from lab_utils.serving import steps as triton_lab

    server, repo = triton
    base = triton_repo.mlp_config("tiny", in_features=4, out_features=3, kind="KIND_CPU", max_batch_size=8)
    settings = triton_lab.LoadSettings(window_s=0.3, warmup_s=0.1, max_windows=3)
    make_inputs = triton_lab.inputs_maker(4)
    panel = widgets.knob_panel(server, repo, base, make_inputs, settings, concurrency=2, batching=False)
    assert "knob panel" in capsys.readouterr().out  # headless: the initial knobs measured once
    assert [r["step"] for r in panel.rows] == ["no batching, 1 instance"]
    assert "dynamic_batching" not in panel.config()

    panel.batching.value, panel.preferred.value, panel.delay_us.value = True, "2, 4", 300
    panel.instances.value = 2
    panel.apply_button.click()
    assert panel.applied["dynamic_batching"] == {"preferred_batch_size": [2, 4], "max_queue_delay_microseconds": 300}
    assert panel.applied["instance_group"] == [{"kind": "KIND_CPU", "count": 2}]
    assert "deployed" in panel.status.value
    written = triton_repo.parse_config((repo / "tiny" / "config.pbtxt").read_text())  # what the server loaded
    assert list(written.dynamic_batching.preferred_batch_size) == [2, 4] and written.instance_group[0].count == 2
    assert triton_client.model_ready(server.grpc_url, "tiny")

    panel.concurrency.value = 4
    panel.measure_button.click()
    assert len(panel.rows) == 2 and panel.rows[-1]["concurrency"] == 4 and panel.rows[-1]["requests"] > 0
    table = panel.table()
    assert list(table["step"]) == ["no batching, 1 instance", "batching preferred [2, 4] delay 300 µs, 2 instances"]
    assert len(panel.figure().axes[0].lines) == 2  # one point per measurement

    panel.preferred.value = "4, x"  # refused: said in the panel, nothing deployed or measured
    panel.measure_button.click()
    assert "ValueError" in panel.status.value and "4, x" in panel.status.value and len(panel.rows) == 2


# --- lab 05: the live view, Prometheus scraping a real Triton ---------------------------------------------------


def test_live_view_refreshes_while_the_load_runs_and_stops_with_it(triton, capsys):
    from lab_utils.course.probe import find_prometheus
    from lab_utils.monitoring import prometheus
    from lab_utils.serving import load as triton_load
    from lab_utils.serving import steps as triton_lab

    if find_prometheus("prometheus") is None:
        if prometheus.required():
            pytest.fail(f"{prometheus.REQUIRE_ENV}=1 but the prometheus binary is not installed")
        pytest.skip("the prometheus binary is not installed (apt-get install prometheus)")
    server, repo = triton
    with prometheus.PrometheusServer(prometheus.scrape_jobs(server), scrape_interval_s=0.5) as metrics:
        metrics.wait_for("sum(up) == 1", timeout_s=20)
        with widgets.live_view(metrics, window="2s", every_s=0.5) as view:
            triton_load.run_load(server.grpc_url, "tiny", triton_lab.inputs_maker(4), 2, duration_s=3, warmup_s=0,
                                 processes=1)
        n = len(view.rows)
        assert n >= 4 and view._thread is None  # sampled while the load ran; stopped when the block ended
        assert view.samples["qps"].max() > 0 and view.samples["p95_ms"].max() > 0
        assert "QPS" in view.html.value and "stopped" in view.html.value
        out = capsys.readouterr().out
        assert f"live view (refreshes in JupyterLab): {n} readings" in out
    with widgets.live_view(None) as none:
        assert none is None


def _recording_hook(calls):
    """A fake ``progress=`` hook: records each loop's total and desc, and how many steps the loop came back for."""

    def hook(iterable, total=None, desc=""):
        rec = {"total": total, "desc": desc, "steps": 0}
        calls.append(rec)
        for item in iterable:
            yield item
            rec["steps"] += 1

    return hook


def test_ddp_scaling_and_overlap_advance_their_progress_hooks_per_run():
    from lab_utils.distributed import ddp

    tiny = {"steps": 1, "warmup_steps": 1, "batch_size": 2, "image_size": 8, "width": 4, "depth": 10,
            "num_classes": 4, "cpu_threads": 1}
    calls = []
    df = ddp.scaling((1, 2), backend="gloo", progress=_recording_hook(calls), **tiny)
    assert list(df["world_size"]) == [1, 2]
    assert calls == [{"total": 2, "desc": "DDP scaling: world sizes", "steps": 2}]  # one step per world size
    calls.clear()
    df = ddp.overlap_experiment(2, variants=[{"bucket_cap_mb": 1}, {"ddp": False}], repeats=1, backend="gloo",
                                progress=_recording_hook(calls), **tiny)
    assert len(df) == 3  # the default variant added
    assert calls == [{"total": 3, "desc": "DDP bucket variants: runs", "steps": 3}]  # one step per variant timed


def test_knob_panel_on_a_stopped_server_says_what_to_run_and_works_after_a_restart(triton, capsys):
    from lab_utils.serving import repository as triton_repo
    from lab_utils.serving import server as triton_server
    from lab_utils.serving import steps as triton_lab

    server, repo = triton
    base = triton_repo.mlp_config("tiny", in_features=4, out_features=3, kind="KIND_CPU", max_batch_size=8)
    settings = triton_lab.LoadSettings(window_s=0.3, warmup_s=0.1, max_windows=3)
    make_inputs = triton_lab.inputs_maker(4)
    panel = widgets.knob_panel(server, repo, base, make_inputs, settings, concurrency=2, batching=False)
    capsys.readouterr()
    server.stop()  # as the lab's last cell does
    panel.measure_button.click()
    assert "server.restart()" in panel.status.value and "Error" not in panel.status.value, panel.status.value
    with pytest.raises(triton_server.ServerStopped) as err:  # a lab cell's deploy: one line, not a stack
        triton_lab.deploy(server, repo, base)
    assert err.value._render_traceback_() == [f"ServerStopped: {err.value}"] and "server.restart()" in str(err.value)
    widgets.knob_panel(server, repo, base, make_inputs, settings)  # the panel's cell run again: headless says why
    assert "server.restart()" in capsys.readouterr().out
    server.restart()
    panel.measure_button.click()
    assert len(panel.rows) == 2 and "infer/s" in panel.status.value, panel.status.value
