"""The GPU exporter: host metrics everywhere, GPU metrics through NVML (a stand-in module here, with the real
pynvml's call signatures), names and units as dcgm-exporter's, clean stop, busy ports, the CLI."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from types import SimpleNamespace

import pytest

from lab_utils.monitoring import gpu_exporter
from lab_utils.monitoring.prometheus import parse_exposition
from lab_utils.procs import free_port, popen_owned, stop_group, wait_http_ok


class NVMLError(Exception):
    pass


class FakeNvml:
    """The pynvml functions the exporter calls, for two H200s; GPU 1 does not report its temperature."""

    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
    nvmlMemory_v2 = 0x2000028
    NVMLError = NVMLError

    def __init__(self, fail_init: bool = False):
        self.fail_init, self.inits, self.shutdowns, self.calls = fail_init, 0, 0, []

    def nvmlInit(self):
        if self.fail_init:
            raise NVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-000{h}"

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=87 + h, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        self.calls.append(("memory", version))
        mib = 2**20
        if version:
            return SimpleNamespace(total=143771 * mib, reserved=600 * mib, free=142000 * mib - 600 * mib,
                                   used=1171 * mib)
        return SimpleNamespace(total=143771 * mib, free=142000 * mib, used=1771 * mib)

    def nvmlDeviceGetPowerUsage(self, h):
        return 350_500  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        if h == 1:
            raise NVMLError("Not Supported")
        return 51

    def nvmlDeviceGetClockInfo(self, h, clock):
        return {self.NVML_CLOCK_SM: 1980, self.NVML_CLOCK_MEM: 3201}[clock]

    def __getattr__(self, name):  # a function the exporter must not call (e.g. anything that sets state)
        raise AttributeError(f"FakeNvml has no {name}: the exporter may only read")


def scrape(url: str) -> dict[tuple, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(lab["__name__"], tuple(sorted((k, v) for k, v in lab.items() if k != "__name__"))): v
            for lab, v in parse_exposition(text)}


def by_name(samples: dict, name: str) -> dict:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def test_gpu_metrics_names_units_and_labels():
    nvml = FakeNvml()
    with gpu_exporter.GpuExporter(nvml=nvml) as exp:
        assert exp.source == "nvml" and "2 GPU(s) through NVML (NVIDIA H200)" in exp.describe()
        samples = scrape(exp.url)
    labels0 = (("UUID", "GPU-0000"), ("device", "nvidia0"), ("gpu", "0"), ("modelName", "NVIDIA H200"))
    assert by_name(samples, "DCGM_FI_DEV_GPU_UTIL")[labels0] == 87
    assert by_name(samples, "DCGM_FI_DEV_FB_USED")[labels0] == 1171  # MiB, v2: driver-reserved left out
    assert by_name(samples, "DCGM_FI_DEV_FB_RESERVED")[labels0] == 600
    assert by_name(samples, "DCGM_FI_DEV_FB_TOTAL")[labels0] == 143771
    assert by_name(samples, "DCGM_FI_DEV_POWER_USAGE")[labels0] == 350.5  # W, from mW
    assert by_name(samples, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT")[labels0] == 700
    assert by_name(samples, "DCGM_FI_DEV_SM_CLOCK")[labels0] == 1980
    assert by_name(samples, "DCGM_FI_DEV_MEM_CLOCK")[labels0] == 3201
    assert len(by_name(samples, "DCGM_FI_DEV_GPU_TEMP")) == 1  # GPU 1: NOT_SUPPORTED is left out, not 0
    assert len(by_name(samples, "DCGM_FI_DEV_GPU_UTIL")) == 2
    assert by_name(samples, "nvlab_exporter_gpus")[()] == 2
    assert by_name(samples, "nvlab_exporter_info")[(("driver_version", "580.159.04"), ("source", "nvml"))] == 1
    assert {n for n, _ in samples} >= {*gpu_exporter.GPU_METRICS, "nvlab_exporter_gpus", "nvlab_exporter_info"}
    assert ("memory", FakeNvml.nvmlMemory_v2) in nvml.calls
    assert nvml.inits == 1 and nvml.shutdowns == 1  # NVML released at stop, once


def test_host_only_when_nvml_fails_and_names_documented():
    with gpu_exporter.GpuExporter(nvml=FakeNvml(fail_init=True)) as exp:
        assert exp.source == "host" and "Driver Not Loaded" in exp.describe()
        samples = scrape(exp.url)
    names = {n for n, _ in samples}
    assert not names & set(gpu_exporter.GPU_METRICS)
    assert {"nvlab_host_cpu_count", "nvlab_host_memory_used_bytes", "nvlab_host_memory_total_bytes",
            "nvlab_exporter_gpus", "nvlab_exporter_info"} <= names
    assert 0 < by_name(samples, "nvlab_host_memory_used_bytes")[()] < by_name(samples,
                                                                              "nvlab_host_memory_total_bytes")[()]
    # the names at the top of the module are the names exported (the compose stack and the rules rely on them)
    documented = set(re.findall(r"``((?:DCGM_FI_DEV|nvlab)_\w+)``", gpu_exporter.__doc__))
    assert documented == {*gpu_exporter.GPU_METRICS, *gpu_exporter.HOST_METRICS, "nvlab_exporter_gpus",
                          "nvlab_exporter_info"}


def test_cpu_percent_moves_with_load():
    reader = gpu_exporter.HostReader()
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin)
    t.start()
    try:
        threading.Event().wait(0.3)
        busy = reader.cpu_percent()
    finally:
        stop.set()
        t.join()
    assert busy is not None and 0 < busy <= 100


def test_cpu_percent_stays_within_0_and_100_where_float_rounding_crosses_them(monkeypatch):
    """busy = total - idle in seconds since boot: rounding put a fully busy interval at 100.00000000227 %."""
    readings = iter([(0.0, 0.0), (10.000000001, 10.0), (9.999999999 - 10.0, 20.0)])
    monkeypatch.setattr(gpu_exporter, "_cpu_times", lambda: next(readings))
    reader = gpu_exporter.HostReader()
    for want in (100.0, 0.0):
        reader._last_read -= 1.0  # a second since the last reading
        assert reader.cpu_percent() == want


def test_stop_ends_the_thread_and_frees_the_port_twice_safe():
    exp = gpu_exporter.GpuExporter(use_nvml=False).start()
    port, thread = exp.port, exp._thread
    exp.stop()
    exp.stop()
    assert not thread.is_alive() and not exp.alive()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # released
    assert not any(t.name.startswith("Thread") and t is thread for t in threading.enumerate())


def test_busy_port_is_avoided_or_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with gpu_exporter.GpuExporter(busy, use_nvml=False) as exp:
            assert exp.port != busy and "busy" in exp.notes[0]
        with pytest.raises(OSError, match=f"port {busy} .* is busy"):
            gpu_exporter.GpuExporter(busy, use_nvml=False, strict_port=True).start()


def test_cli_serves_until_sigterm():
    port = free_port()
    proc = popen_owned([sys.executable, "-m", "nvlab", "gpu-exporter", "--port", str(port), "--host",
                        "127.0.0.1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_http_ok(f"http://127.0.0.1:{port}/metrics", proc, 30)
        assert "nvlab_host_cpu_count" in {n for n, _ in scrape(f"http://127.0.0.1:{port}/metrics")}
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "GPU exporter at" in proc.stdout.read()
    finally:
        stop_group(proc)


def test_a_sigterm_the_moment_the_port_answers_still_stops_cleanly():
    # the exporter sends itself SIGTERM right after it starts listening: the handler must already be there
    # (CI once caught the gap: a supervisor's SIGTERM killed the process with -15 instead of stopping it)
    code = (
        "import os, signal, sys\n"
        "from lab_utils.monitoring import gpu_exporter as g\n"
        "start = g.GpuExporter.start\n"
        "def start_then_term(self):\n"
        "    out = start(self)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return out\n"
        "g.GpuExporter.start = start_then_term\n"
        "from nvlab import cli\n"
        f"sys.exit(cli.serve_gpu_exporter({free_port()}, '127.0.0.1'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])


def test_cli_refuses_a_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "nvlab", "gpu-exporter", "--port", str(port), "--host",
                              "127.0.0.1"], capture_output=True, text=True, timeout=60)
    # refused before anything starts, on one line naming the port and the process holding it (this test)
    assert out.returncode == 2 and f"port {port} is already in use by pid {os.getpid()}" in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0
