"""How a class's servers start all at once: ``nvlab classroom up --local`` with N students (system users made for
the run, removed after), every server started at the same moment through the hub's REST API, and for each the time
from the request to the hub reporting it ready; then the hub's, the proxy's and one idle server's memory.

    sudo .venv/bin/python scripts/classroom_bench.py --students 20 --out docs/classroom_benchmark.json

Needs root (one system user per student), the classroom extra and configurable-http-proxy, as the hub does. The
machine's load at the start is recorded beside the numbers: other work on the machine slows every start."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab_utils.procs import free_port, tail  # noqa: E402
from nvlab.classroom import manage  # noqa: E402 (the checkout's, not an installed copy)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, linear between order statistics (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, default=20)
    p.add_argument("--out", help="JSON file for the results (default: print only)")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("classroom_bench: run as root (one system user per student)", file=sys.stderr)
        return 2
    prefix = f"nvlb{os.urandom(2).hex()}"
    trainer = f"{prefix}-trainer"
    students = [f"{prefix}-s{i:02d}" for i in range(1, args.students + 1)]
    folder = Path(tempfile.mkdtemp(prefix=f"nvlab-classroom-bench-{os.getpid()}-", dir="/tmp"))
    os.chmod(folder, 0o755)
    state = folder / "state"
    load = os.getloadavg()
    try:
        roster = folder / "roster.csv"
        roster.write_text("username,role\n" + f"{trainer},trainer\n" + "".join(f"{s},\n" for s in students))
        opts = manage.Options(roster=roster, local=True, gpus="none", ip="127.0.0.1", port=free_port(), state=state,
                              passwords_out=folder / "passwords.csv", python=manage.students_python(folder / "py"))
        t0 = time.monotonic()
        started = manage.start(opts, manage.prepare(opts))
        up_s = time.monotonic() - t0
        hub_idle = rss_mib([started["pid"]])
        ready: dict[str, float] = {}
        errors: dict[str, str] = {}
        go = threading.Barrier(len(students))

        def spawn(user: str) -> None:
            go.wait()
            t = time.monotonic()
            try:
                manage.api(state, "POST", f"/users/{user}/server", timeout_s=600)
                # once a second: 20 pollers must not be the hub's load
                while not ((s := manage.api(state, "GET", f"/users/{user}")["servers"].get("")) and s["ready"]):
                    if not s:  # the start failed (the hub's log says why) and the hub removed the server
                        raise RuntimeError("the server's start failed: see the hub's log")
                    if time.monotonic() - t > 600:
                        raise TimeoutError("not ready in 600 s")
                    time.sleep(1)
                ready[user] = time.monotonic() - t
            except Exception as err:  # noqa: BLE001 (recorded: the run says which starts failed and why)
                errors[user] = f"{type(err).__name__}: {err}"

        threads = [threading.Thread(target=spawn, args=(u,)) for u in students]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        time.sleep(5)  # the servers settle (their start-up work done): idle memory
        proxy = int((state / "proxy.pid").read_text())
        per_server = []
        for u in students[:5]:
            uid = pwd.getpwnam(u).pw_uid
            per_server.append(rss_mib([q.pid for q in psutil.process_iter(["uids"]) if q.info["uids"].real == uid]))
        log = (state / "hub.log").read_text(errors="replace").splitlines()
        for user in errors:  # the hub's own words on why (a server's port taken in the meantime, say)
            why = [ln.split("] ", 1)[-1] for ln in log if user in ln and ("never showed up" in ln or "Giving up" in ln)]
            errors[user] += f" ({why[-1]})" if why else ""
        port_taken = [ln.split("] ", 1)[-1] for ln in log if "could not be started because port" in ln]
        times = list(ready.values())
        import jupyterhub

        result = {
            "what": f"{args.students} students' servers started at once, `nvlab classroom up --local`",
            "date": time.strftime("%Y-%m-%d"), "jupyterhub": jupyterhub.__version__,
            "machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                        "python": platform.python_version(),
                        "load_average_1_5_15_at_start": [round(x, 2) for x in load]},
            "hub_start_s": round(up_s, 1),
            "ready_s": {"p50": round(percentile(times, 0.5), 1), "p95": round(percentile(times, 0.95), 1),
                        "max": round(max(times), 1), "min": round(min(times), 1)} if times else None,
            "servers_ready": len(times), "servers_failed": errors, "servers_whose_port_was_taken": port_taken,
            "memory_mib": {"hub_before": round(hub_idle), "hub_with_all_servers": round(rss_mib([started["pid"]])),
                           "proxy": round(rss_mib([proxy])),
                           "one_idle_server_median": round(statistics.median(per_server)) if per_server else None},
        }
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return 0 if not errors else 1
    except BaseException:
        print(f"classroom_bench: the hub's log: {state / 'hub.log'} (removed now)\n" + tail(state / "hub.log", 40),
              file=sys.stderr)
        raise
    finally:
        with contextlib.suppress(Exception):
            manage.stop(state)
        for u in [trainer, *students]:
            with contextlib.suppress(KeyError):
                pwd.getpwnam(u)
                subprocess.run(["userdel", "-r", "-f", u], capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
