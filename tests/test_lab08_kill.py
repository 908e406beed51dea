"""Lab 08 killed mid-lab: a Jupyter kernel starts what the lab starts (the MLflow server, champion and challenger
Triton servers behind nginx, the feedback and drift exporters, Prometheus, the labelled traffic and the open-loop
load) and is SIGKILLed while the load runs. No MLflow, nginx, Triton or Prometheus process may outlive it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
from test_service import _Collector, _gone, _prometheus_here, _require_all

from lab_utils import procs
from lab_utils.mlops import tracking
from lab_utils.ops import notebooks
from lab_utils.procs import env_flag
from lab_utils.serving import nginx as nginx_mod

SETUP = """
    import json
    from lab_utils import procs
    from lab_utils.mlops import deploy, drift, tracking
    from lab_utils.mlops.exporters import FeedbackExporter
    from lab_utils.monitoring import prometheus
    data = tracking.digits_data()
    server = tracking.TrackingServer().start()
    run = tracking.log_training_run(server, epochs=1, run_name="kill-test")
    tracking.register_run(server, run.run_id, alias="champion")
    onnx = tracking.download_onnx(server, alias="champion", dst=procs.owned_tempdir("kill08"))
    svc = deploy.CanaryService(onnx).start()
    feedback = FeedbackExporter().start()
    monitor = drift.DriftMonitor(drift.DriftReference.from_images(data["x_train"]), window=50)
    exporter = drift.DriftExporter(monitor).start()
    prom = prometheus.PrometheusServer({**svc.scrape_jobs(), "feedback": [feedback.address]}).start()
    labelled = deploy.LabelledTraffic(svc, feedback, data["x_test"], data["y_test"], rate_rps=10,
                                      monitor=monitor).start()
    load = deploy.BackgroundLoad(svc.target("grpc"), 20, segment_s=30).start()
    svc.set_weight(10)
    pids = server.pids() + [p for t in svc.servers for p in procs.group_members(t.pid)]
    pids += procs.group_members(svc.lb.pid) + [prom.pid]
    print("STATE", json.dumps({"pids": pids, "nginx": str(svc.lb.prefix)}))
"""


def test_killed_kernel_leaves_no_mlflow_nginx_triton_or_prometheus():
    _require_all()
    _prometheus_here()
    if tracking.mlflow_missing():
        if env_flag("CI"):
            pytest.fail(f"CI installs the lab extra, but {tracking.mlflow_missing()}")
        pytest.skip(tracking.mlflow_missing())
    jupyter_client = pytest.importorskip("jupyter_client")
    run_id = f"pytest-lab08-kill-{uuid.uuid4().hex[:8]}"
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env=dict(os.environ, **{notebooks.RUN_ID_ENV: run_id}))
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        out = _Collector()
        reply = kc.execute_interactive(textwrap.dedent(SETUP), timeout=300, output_hook=out)
        assert reply["content"]["status"] == "ok", out.text
        state = json.loads(out.text.split("STATE", 1)[1].strip().splitlines()[0])
        pids = state["pids"]
        # MLflow (CLI + uvicorn), 2 Triton servers with their stubs, nginx's master and a worker, Prometheus
        assert len(pids) >= 2 + 2 * 4 + 2 + 1 and all(procs.pid_alive(p) for p in pids), pids
        kc.stop_channels()
        kernel_pid = km.provisioner.process.pid
        os.kill(kernel_pid, signal.SIGKILL)
        left = [p for p in pids if procs.pid_alive(p)] if not _gone(pids, 30.0) else []
        assert not left, f"still running after the kernel was killed: {left}"
        assert not nginx_mod.leftover_nginx(state["nginx"])
        assert _gone([int(line.split()[0]) for line in notebooks.leftover_processes(run_id)], 10.0), \
            notebooks.leftover_processes(run_id)
        # the folders named by the dead kernel's PID (MLflow's store, the repositories, Prometheus's data): doctor
        # removes what no exit handler could
        doctor = subprocess.run([sys.executable, "-m", "lab_utils", "doctor"], capture_output=True, text=True,
                                timeout=180)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert not list(Path(tempfile.gettempdir()).glob(f"nvlab-*-{kernel_pid}-*"))
    finally:
        if km.is_alive():
            km.shutdown_kernel(now=True)
