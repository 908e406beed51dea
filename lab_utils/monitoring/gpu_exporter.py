"""A small Prometheus exporter for the GPUs (through NVML, read-only) and the host, for machines where no DCGM exporter
runs. ``nvlab gpu-exporter --port 9400`` serves it; a lab runs it from a thread.

The exported gauges (dcgm-exporter's names, units and labels for the GPU; the rules and dashboard rely on them):
``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_MEM_COPY_UTIL`` (%), ``DCGM_FI_DEV_FB_USED``, ``DCGM_FI_DEV_FB_FREE``,
``DCGM_FI_DEV_FB_RESERVED``, ``DCGM_FI_DEV_FB_TOTAL`` (MiB), ``DCGM_FI_DEV_POWER_USAGE``,
``DCGM_FI_DEV_ENFORCED_POWER_LIMIT`` (W), ``DCGM_FI_DEV_GPU_TEMP`` (°C), ``DCGM_FI_DEV_SM_CLOCK``,
``DCGM_FI_DEV_MEM_CLOCK`` (MHz); ``nvlab_host_cpu_utilization_percent``, ``nvlab_host_cpu_count``,
``nvlab_host_memory_used_bytes``, ``nvlab_host_memory_total_bytes``, ``nvlab_host_load1``, ``nvlab_exporter_gpus``,
``nvlab_exporter_info``. Design notes: docs/internals.md#lab_utilsmonitoringgpu_exporterpy"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import psutil

from lab_utils.course.probe import nvml_text
from lab_utils.owned import OwnedServer
from lab_utils.procs import who_listens

GPU_LABELS = ("gpu", "UUID", "device", "modelName")

_HELP = {  # every gauge's HELP line, by name: GPU_METRICS and HOST_METRICS are its keys, in this order
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %): share of the sample period in which any kernel ran "
                            "(not how busy the SMs were).",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "Memory utilization (in %): share of the sample period the memory was read/written.",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB), driver-reserved memory excluded.",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_FB_RESERVED": "Framebuffer memory reserved by the driver and firmware (in MiB).",
    "DCGM_FI_DEV_FB_TOTAL": "Framebuffer memory total (in MiB).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": "Enforced power limit (in W).",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_SM_CLOCK": "SM clock frequency (in MHz).",
    "DCGM_FI_DEV_MEM_CLOCK": "Memory clock frequency (in MHz).",
    "nvlab_host_cpu_utilization_percent": "Host CPU busy (in %, all CPUs) since the previous scrape.",
    "nvlab_host_cpu_count": "Logical CPUs of the host.",
    "nvlab_host_memory_used_bytes": "Host memory used: MemTotal - MemAvailable (bytes).",
    "nvlab_host_memory_total_bytes": "Host memory total (bytes).",
    "nvlab_host_load1": "1-minute load average."}
GPU_METRICS = tuple(n for n in _HELP if n.startswith("DCGM_"))
HOST_METRICS = tuple(n for n in _HELP if n.startswith("nvlab_host_"))

_MIB = 2**20


# --- host readings (psutil; zeros are never invented: a reading that fails leaves the metric out) -----


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU seconds over all CPUs since boot."""
    try:
        t = psutil.cpu_times()
    except (OSError, psutil.Error):
        return None
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # guest time is inside user/nice
    return total - idle, total


class HostReader:
    """CPU utilization between calls (from CPU-time deltas), memory and load; read under the Collector's lock."""

    def __init__(self) -> None:
        self._last = _cpu_times()
        self._last_pct: float | None = None
        self._last_read = time.monotonic()

    def cpu_percent(self) -> float | None:
        now = _cpu_times()
        if now is None or self._last is None:
            return None
        busy, total = now[0] - self._last[0], now[1] - self._last[1]
        # two scrapes within a tick see no change: repeat the previous reading instead of 0 %
        if total <= 0 or time.monotonic() - self._last_read < 0.05:
            return self._last_pct
        self._last, self._last_read = now, time.monotonic()
        # busy is total - idle, both seconds since boot (about 1e6): their float rounding can put a fully busy
        # interval a few 1e-9 over 100 % (100.00000000227 seen on a saturated 2-core machine)
        self._last_pct = min(100.0, max(0.0, 100.0 * busy / total))
        return self._last_pct

    def read(self) -> dict[str, float]:
        values: dict[str, float] = {"nvlab_host_cpu_count": float(os.cpu_count() or 0)}
        if (pct := self.cpu_percent()) is not None:
            values["nvlab_host_cpu_utilization_percent"] = pct
        with contextlib.suppress(OSError, psutil.Error):
            mem = psutil.virtual_memory()
            values["nvlab_host_memory_total_bytes"] = float(mem.total)
            values["nvlab_host_memory_used_bytes"] = float(mem.total - mem.available)
        with contextlib.suppress(OSError):
            values["nvlab_host_load1"] = os.getloadavg()[0]
        return values


# --- NVML ------------------------------------------------------------------------------------------


class NvmlReader:
    """Per-GPU readings through NVML's query functions (``nvml`` is the ``pynvml`` module or a stand-in)."""

    def __init__(self, nvml: Any):
        self.nvml = nvml
        self.handles: list[Any] = []
        self.labels: list[dict[str, str]] = []
        self.driver_version, self._opened = "", False

    def open(self) -> None:
        nv = self.nvml
        nv.nvmlInit()
        self._opened = True
        try:
            self.driver_version = nvml_text(nv.nvmlSystemGetDriverVersion())
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                self.handles.append(h)
                self.labels.append({"gpu": str(i), "UUID": nvml_text(nv.nvmlDeviceGetUUID(h)), "device": f"nvidia{i}",
                                    "modelName": nvml_text(nv.nvmlDeviceGetName(h))})
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Release NVML once (nvmlInit/nvmlShutdown are reference counted)."""
        if self._opened:
            self._opened = False
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
        self.handles, self.labels = [], []

    def _opt(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, fn)(*args)
        except Exception:  # NVMLError (NOT_SUPPORTED, GPU_IS_LOST...): leave the field out of this scrape
            return None

    def read(self) -> list[dict[str, float]]:
        nv = self.nvml
        out = []
        for h in self.handles:
            v: dict[str, float] = {}
            if (util := self._opt("nvmlDeviceGetUtilizationRates", h)) is not None:
                v["DCGM_FI_DEV_GPU_UTIL"] = float(util.gpu)
                v["DCGM_FI_DEV_MEM_COPY_UTIL"] = float(util.memory)
            version = getattr(nv, "nvmlMemory_v2", None)
            mem = self._opt("nvmlDeviceGetMemoryInfo", h, version) if version else None
            if mem is not None:  # v2: "used" leaves out what the driver reserves, as DCGM and nvidia-smi do
                v["DCGM_FI_DEV_FB_RESERVED"] = mem.reserved / _MIB
            else:
                mem = self._opt("nvmlDeviceGetMemoryInfo", h)
            if mem is not None:
                v["DCGM_FI_DEV_FB_USED"] = mem.used / _MIB
                v["DCGM_FI_DEV_FB_FREE"] = mem.free / _MIB
                v["DCGM_FI_DEV_FB_TOTAL"] = mem.total / _MIB
            if (power := self._opt("nvmlDeviceGetPowerUsage", h)) is not None:
                v["DCGM_FI_DEV_POWER_USAGE"] = power / 1000.0  # mW -> W
            if (limit := self._opt("nvmlDeviceGetEnforcedPowerLimit", h)) is not None:
                v["DCGM_FI_DEV_ENFORCED_POWER_LIMIT"] = limit / 1000.0
            if (temp := self._opt("nvmlDeviceGetTemperature", h, getattr(nv, "NVML_TEMPERATURE_GPU", 0))) is not None:
                v["DCGM_FI_DEV_GPU_TEMP"] = float(temp)
            if (sm := self._opt("nvmlDeviceGetClockInfo", h, getattr(nv, "NVML_CLOCK_SM", 1))) is not None:
                v["DCGM_FI_DEV_SM_CLOCK"] = float(sm)
            if (memclk := self._opt("nvmlDeviceGetClockInfo", h, getattr(nv, "NVML_CLOCK_MEM", 2))) is not None:
                v["DCGM_FI_DEV_MEM_CLOCK"] = float(memclk)
            out.append(v)
        return out


def _open_nvml(nvml: Any = None) -> tuple[NvmlReader | None, str]:
    """An opened reader and "" — or None and why NVML is not used (no package, no driver, no GPU)."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py): host metrics only"
        nvml = pynvml
    reader = NvmlReader(nvml)
    try:
        reader.open()
    except Exception as err:
        return None, f"NVML is not available ({err}): host metrics only"
    if not reader.handles:
        reader.close()
        return None, "NVML found no GPU: host metrics only"
    return reader, ""


# --- the collector and the HTTP server --------------------------------------------------------------


class Collector:
    """A prometheus_client collector: GPU metrics through NVML when there is a GPU, host metrics always."""

    def __init__(self, nvml: Any = None, *, use_nvml: bool = True):
        self.host = HostReader()
        self.reader, self.why_no_gpu = _open_nvml(nvml) if use_nvml else (None, "NVML not requested")
        self._lock = threading.Lock()

    @property
    def source(self) -> str:
        return "nvml" if self.reader else "host"

    @property
    def gpu_count(self) -> int:
        return len(self.reader.handles) if self.reader else 0

    def close(self) -> None:
        with self._lock:
            if self.reader is not None:
                self.reader.close()
                self.reader = None

    def snapshot(self) -> dict[str, Any]:
        """One reading: ``{"host": {...}, "gpus": [{labels..., metric: value}]}``."""
        with self._lock:
            gpus = [] if self.reader is None else [
                {**labels, **values} for labels, values in zip(self.reader.labels, self.reader.read(), strict=True)]
            return {"host": self.host.read(), "gpus": gpus}

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        snap = self.snapshot()
        for name in GPU_METRICS:
            fam = GaugeMetricFamily(name, _HELP[name], labels=list(GPU_LABELS))
            for g in snap["gpus"]:
                if name in g:
                    fam.add_metric([g[k] for k in GPU_LABELS], g[name])
            if fam.samples:
                yield fam
        host = snap["host"]
        for name in HOST_METRICS:
            if name in host:
                yield GaugeMetricFamily(name, _HELP[name], value=host[name])
        yield GaugeMetricFamily("nvlab_exporter_gpus", "GPUs seen through NVML.", value=self.gpu_count)
        info = GaugeMetricFamily("nvlab_exporter_info", "Where the exporter's readings come from.",
                                 labels=["source", "driver_version"])
        info.add_metric([self.source, self.reader.driver_version if self.reader else ""], 1.0)
        yield info


class MetricsServer(OwnedServer):
    """A prometheus_client registry served over HTTP from a daemon thread; ``address`` is ``host:port`` for a
    scrape configuration."""

    error = OSError
    registered = False
    busy_fix = "pass another, or None for a free one"  # the end of a busy-port message

    def __init__(self, collectors: Iterable[Any] = (), *, port: int | None = None, host: str = "127.0.0.1",
                 fallback_port: bool = False):
        from prometheus_client import CollectorRegistry

        super().__init__(host=host, ports={"port": port})
        self.registry = CollectorRegistry(auto_describe=False)
        for c in collectors:
            self.registry.register(c)
        # fallback_port: a busy requested port means a free one instead of an error (a lab's helper exporter)
        self.fallback_port = fallback_port
        self.port: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """host:port for a scrape configuration (a server on every interface is scraped on the loopback one)."""
        if self.port is None:
            raise RuntimeError(f"{type(self).__name__} is not started: call start() (or use it in a with block)")
        return f"{'127.0.0.1' if self.host in ('0.0.0.0', '') else self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    # lifecycle: see OwnedServer; a thread, not a process ------------------------------------------------
    def _busy(self, name: str, port: int) -> Exception:
        return OSError(f"port {port} on {self.host} is busy, {who_listens(port)}: {self.busy_fix}")

    def _free_port(self) -> int:
        return 0  # the OS picks one as the server binds: no other process can take it first

    def _port_taken(self, err: Exception) -> bool:
        return False

    def _start_once(self) -> MetricsServer:
        from prometheus_client import start_http_server

        # port 0 picks a free one, read back from server_port
        self._server, self._thread = start_http_server(self.port or 0, addr=self.host, registry=self.registry)
        self.port = self._server.server_port
        self._register()
        return self

    def _cleanup(self) -> None:
        """Stop serving: shut the server down, close its socket, join its thread."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._server, self._thread = None, None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def text(self) -> str:
        """The exposition a scrape would get now."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class GpuExporter(MetricsServer):
    """The exporter served from a thread of this process: ``with GpuExporter() as exp: exp.url``.

    ``port=None`` takes a free port; a busy requested port is avoided (a free one is taken and ``notes``
    says so) unless ``strict_port`` (the command line, where the scrape configuration names the port).
    ``stop()`` shuts the HTTP server and its thread down and releases NVML; safe to call twice."""

    busy_note = "port {port} is busy: the exporter listens on a free port instead"
    busy_fix = "stop it or pass --port with a free port"

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", *, nvml: Any = None,
                 use_nvml: bool = True, strict_port: bool = False):
        super().__init__(port=port, host=host, fallback_port=not strict_port)
        self._nvml, self._use_nvml = nvml, use_nvml
        self.collector: Collector | None = None

    @property
    def source(self) -> str:
        return self.collector.source if self.collector else "stopped"

    def describe(self) -> str:
        if self.collector is None:
            return "GPU exporter (not started)"
        if self.collector.reader:
            names = sorted({lab["modelName"] for lab in self.collector.reader.labels})
            what = f"{self.collector.gpu_count} GPU(s) through NVML ({', '.join(names)}) and the host"
        else:
            what = self.collector.why_no_gpu
        return f"GPU exporter at {self.url}: {what}"

    def _start_once(self) -> GpuExporter:
        from prometheus_client import CollectorRegistry

        self.collector = Collector(self._nvml, use_nvml=self._use_nvml)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        try:
            super()._start_once()
        except OSError:
            self.collector.close()
            self.collector = None
            raise
        return self

    def _cleanup(self) -> None:
        """Stop serving, join the thread, release NVML."""
        super()._cleanup()
        if self.collector is not None:
            self.collector.close()
