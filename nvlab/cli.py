"""``nvlab``: check a machine, launch the course, execute labs, build labs, compare with the reference run, show a
student's progress."""

from __future__ import annotations

import argparse
import errno
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from lab_utils.course.catalog import repo_root
from lab_utils.procs import sweep_stale_tempdirs, who_listens
from nvlab import writable_problem
from nvlab.classroom import DEFAULT_STATE


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2): the usage text is behind ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _int_in(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number in ``low..high`` (no upper bound when None), else one line saying so."""
    rule = f"{what}: give an integer from {low} to {high}" if high else f"give a whole number greater than {low - 1}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; {rule}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range; {rule}")
        return value

    return parse


_port = _int_in(1, 65535, "a port number")
_positive_int = _int_in(1, None, "a whole number")
_nonnegative_int = _int_in(0, None, "a whole number")


def _fail(command: str, why: Any, code: int = 2) -> int:
    """Say on stderr why ``nvlab command`` stops; its exit code."""
    print(f"nvlab {command}: {why}", file=sys.stderr)
    return code


def port_problem(host: str, port: int, fix: str) -> str | None:
    """Why a server cannot listen on ``host:port`` now (one line, with ``fix``), or None when it can."""
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        return f"{host!r} is not an address this machine can listen on ({err}): give an IP address such as 127.0.0.1"
    failures = []
    for family, kind, proto, _, addr in addrs:
        with socket.socket(family, kind, proto) as s:
            # as Jupyter and the exporter bind: a port whose connections sit in TIME_WAIT is free, a listener is not
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return f"port {port} is already in use {who_listens(port)}: stop that, or {fix}"
                failures.append(f"{addr[0]}: {err.strerror}")
    if failures and len(failures) == len(addrs):
        return f"cannot listen on {host} ({'; '.join(failures)}): give an address of this machine, e.g. 127.0.0.1"
    return None


def cmd_doctor(args: argparse.Namespace) -> int:
    from lab_utils.course.probe import probe  # lazy: subcommand only (cli stays fast to import)
    from lab_utils.course.session import print_report  # lazy: pulls pandas (cli stays fast to import)
    from lab_utils.serving.server import remove_stale_shm  # lazy: subcommand only (cli stays fast to import)
    from nvlab.ops.notebooks import end_orphans  # lazy: subcommand only (cli stays fast to import)

    # what killed kernels and servers left behind (no exit handler ran): their owners are gone, so it goes; the
    # processes first (a stub still running from a folder of a dead owner), then the folders
    ended = end_orphans()
    removed = [str(p) for p in sweep_stale_tempdirs()] + [f"/dev/shm/{n}" for n in remove_stale_shm()]
    report = probe()
    if args.json:
        print(report.to_json())
    else:
        print_report(report)
    if ended:
        print(f"nvlab doctor: ended {len(ended)} process(es) that killed course processes left running: "
              + ", ".join(ended), file=sys.stderr if args.json else sys.stdout)
    if removed:
        print(f"nvlab doctor: removed {len(removed)} leftover(s) of course processes that were killed: "
              + ", ".join(removed), file=sys.stderr if args.json else sys.stdout)
    if not report.can_run:
        print(f"nvlab doctor: the course cannot run here: missing {', '.join(report.missing)}; "
              "install with: pip install -e '.[lab]'", file=sys.stderr)
        return 1
    if args.require_gpu and not report.gpu_usable:
        why = "; ".join(report.reasons)
        return _fail("doctor", f"--require-gpu, but no GPU is usable by torch: {why}")
    return 0


LAB_SETTINGS_DIR = Path(__file__).parent / "data" / "jupyter" / "settings"


def _runtime_dir(jupyter_lab: str) -> Path:
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:  # JupyterLab of another environment: ask its own jupyter
        jupyter = str(Path(jupyter_lab).parent / "jupyter")
        return Path(subprocess.run([jupyter, "--runtime-dir"], capture_output=True, text=True, check=True,
                                   timeout=60).stdout.strip())
    return Path(jupyter_runtime_dir())


def _server_info(runtime: Path, pid: int) -> dict[str, Any] | None:
    """What the Jupyter server ``pid`` wrote about itself (url, port, token), once it listens."""
    for f in runtime.glob("jpserver-*.json"):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):  # being written
            continue
        if isinstance(info, dict) and info.get("pid") == pid:
            return info
    return None


def _lab_url(info: dict[str, Any], ip: str, token: str) -> str:
    # a wildcard address is reached on loopback (a container's published port too), not at the container's name
    host = "127.0.0.1" if ip in ("", "0.0.0.0", "::") else ip
    host = f"[{host}]" if ":" in host else host
    scheme = "https" if info.get("secure") else "http"
    base = "/" + str(info.get("base_url") or "/").strip("/")
    return f"{scheme}://{host}:{info['port']}{base.rstrip('/')}/lab?token={info.get('token') or token}"


# ipykernel logs this at every kernel start (each notebook opened, each restart): said once, with what it means here
_TCP_WARNING = "Kernel is running over TCP without encryption"
TCP_NOTE = ("nvlab lab: each kernel talks to JupyterLab over TCP on loopback (127.0.0.1, whatever --ip says), its "
            "messages signed but not encrypted: ipykernel's warning about it, said once here instead of at every "
            "kernel start")


def relay_log(stream: Any, out: Any) -> None:
    """Copy JupyterLab's log (``stream``, lines) to ``out``, ipykernel's TCP warning replaced by one note, once."""
    noted = False
    for line in stream:
        if _TCP_WARNING in line:
            if not noted:
                out.write(TCP_NOTE + "\n")
                noted = True
            continue
        out.write(line)
        out.flush()


def cmd_lab(args: argparse.Namespace) -> int:
    from lab_utils.course.probe import find_jupyter_lab  # lazy: subcommand only (cli stays fast to import)

    folder = Path(args.dir) if args.dir else repo_root() / "labs"
    if not folder.is_dir():
        return _fail("lab", f"{folder} is not a folder; pass --dir to the labs folder")
    if not (jupyter_lab := find_jupyter_lab()):
        return _fail("lab", f"JupyterLab is not installed for {sys.executable}: pip install -e '.[lab]'")
    if not args.any_port and (why := port_problem(args.ip, args.port, "pass --port with a free port, or "
                                                  "--any-port to let JupyterLab pick one")):
        return _fail("lab", why)
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    if args.ip not in ("127.0.0.1", "localhost", "::1"):
        print(f"nvlab lab: listening on {args.ip}: anyone who can reach this machine can try the token",
              file=sys.stderr)
    # without --any-port Jupyter must not wander to another port (a race after the check above)
    argv = [jupyter_lab, f"--ServerApp.root_dir={folder}", f"--ServerApp.ip={args.ip}",
            f"--ServerApp.port={args.port}", f"--ServerApp.port_retries={50 if args.any_port else 0}",
            "--ServerApp.open_browser=False",
            # the course's settings (overrides.json): no news or update pop-up over the lab on first start
            f"--LabApp.app_settings_dir={LAB_SETTINGS_DIR}"]
    if os.geteuid() == 0:  # containers and CI often run as root; Jupyter refuses that unless told
        argv.append("--allow-root")
    env = dict(os.environ, JUPYTER_TOKEN=token)  # token auth stays on: an empty token is never passed
    # notebooks' `!pip` and kernels find this environment's tools even when the venv is not activated
    env["PATH"] = os.pathsep.join([str(Path(jupyter_lab).parent), env.get("PATH", "")])
    runtime = _runtime_dir(jupyter_lab)
    print(f"nvlab lab: starting JupyterLab on {folder} (its log follows; the URL comes when it listens, "
          "10-60 s on a small machine) ...", file=sys.stderr, flush=True)
    child = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
    relay = threading.Thread(target=relay_log, args=(child.stderr, sys.stderr), daemon=True)
    relay.start()
    # Ctrl-C reaches Jupyter from the terminal (it asks to confirm); a SIGTERM to nvlab is passed on
    signal.signal(signal.SIGINT, lambda *_: None)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: child.send_signal(signum))
    deadline = time.monotonic() + 300
    while child.poll() is None:
        if info := _server_info(runtime, child.pid):  # the port Jupyter itself reports, not the one asked for
            print(f"JupyterLab on {_lab_url(info, args.ip, token)}", flush=True)
            break
        if time.monotonic() > deadline:
            print(f"nvlab lab: JupyterLab (pid {child.pid}) has not reported its address in {runtime} after "
                  "300 s; see its log above", file=sys.stderr, flush=True)
            break
        time.sleep(0.2)
    code = child.wait()
    relay.join(timeout=5)  # the log's last lines (why it exited) before our own
    if code and code > 0:
        print(f"nvlab lab: JupyterLab exited with code {code}; see its log above", file=sys.stderr)
    return 0 if code < 0 else code  # stopped by a signal: a normal end


def cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from nvlab.ops.notebooks import (  # lazy: subcommand only (cli stays fast to import)
        NotebookError,
        execute,
        leftover_processes,
        parameters_for,
        select,
        update_expected,
    )

    console = Console(stderr=False)
    try:
        paths = select(args.labs, args.all, args.solutions)
    except ValueError as err:
        return _fail("run", err)
    if not paths:
        return _fail("run", "no notebooks to run")
    if args.update_expected and not args.solutions:
        return _fail("run", "--update-expected writes into solutions/: add --solutions")
    if args.update_expected and args.skip_optional:
        return _fail("run", "--update-expected stores every checked cell's output: leave out --skip-optional")
    try:
        params = parameters_for(paths, args.parameter or [])
    except (ValueError, NotebookError) as err:
        return _fail("run", err)
    out = Path(args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    if why := writable_problem(out, "--out"):
        return _fail("run", why)
    run_id = uuid.uuid4().hex
    failed = 0
    total = time.perf_counter()
    for i, p in enumerate(paths, 1):
        console.print(f"[{i}/{len(paths)}] {p.parent.name}/{p.name} ...")
        res = execute(p, out, params[p], run_id, timeout_s=args.timeout, skip_optional=args.skip_optional)
        left = leftover_processes(run_id)
        if res.ok and not left:
            unrun = f" ({res.skipped} optional cells left unrun)" if res.skipped else ""
            console.print(f"    ok in {res.seconds:.1f} s{unrun} -> {res.output}")
            if args.update_expected:
                n = update_expected(p, res.output)
                console.print(f"    expected outputs of {n} checked cells written to {p}")
        else:
            failed += 1
            console.print(f"    [red]FAILED[/] after {res.seconds:.1f} s: {res.error}")
            if left:
                console.print(f"    [red]left running[/]: {'; '.join(left)}")
    console.print(f"{len(paths) - failed}/{len(paths)} notebooks ok in {time.perf_counter() - total:.1f} s; "
                  f"outputs in {out}")
    return 1 if failed else 0


def cmd_build_labs(args: argparse.Namespace) -> int:
    from nvlab.ops.notebooks import NotebookError, build_labs  # lazy: subcommand only (cli stays fast to import)

    try:
        changed = build_labs(check=args.check)
    except NotebookError as err:
        return _fail("build-labs", err)
    if args.check:
        if changed:
            print("labs/ differs from what solutions/ generates: " + ", ".join(changed)
                  + "\nrun `nvlab build-labs` and commit the result", file=sys.stderr)
            return 1
        print("labs/ is up to date with solutions/")
        return 0
    print("wrote " + (", ".join(changed) if changed else "nothing (labs/ already up to date)"))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lab_utils.course.results import compare, reference_dirs  # lazy: pulls pandas (cli stays fast to import)

    ref = args.reference or ", ".join(str(p) for p in reference_dirs()) or "no reference run"
    try:
        df = compare(args.run_dir, args.reference)
    except (FileNotFoundError, ValueError) as err:  # ResultsError is a ValueError
        return _fail("report", err)
    if df.empty:
        return _fail("report", f"no results_*.json in {args.run_dir}")
    if args.json:
        clean = df.astype(object).where(df.notna(), None)  # JSON null, not NaN, for a missing reference
        print(json.dumps(clean.to_dict(orient="records"), indent=1, default=str))
        return 0
    table = Table(title=f"{args.run_dir} against {ref}")
    for col in ("lab", "name", "value", "reference", "unit", "ratio", "tier"):
        table.add_column(col, justify="right" if col in ("value", "reference", "ratio") else "left")
    for r in df.itertuples():
        def f(v: Any) -> str:
            return "-" if v is None or v != v else f"{v:.4g}"

        table.add_row(r.lab, r.name, f(r.value), f(r.reference), r.unit, f(r.ratio), r.tier)
    Console(width=120).print(table)
    return 0


def cmd_gpu_exporter(args: argparse.Namespace) -> int:
    if why := port_problem(args.host, args.port, "pass --port with a free port (and scrape that one)"):
        return _fail("gpu-exporter", why)
    return serve_gpu_exporter(port=args.port, host=args.host)


GPU_EXPORTER_PORT = 9400  # dcgm-exporter's port: scrape configs need not change between the two


def serve_gpu_exporter(port: int, host: str) -> int:
    """``nvlab gpu-exporter``: serve GPU and host metrics until SIGTERM or SIGINT; returns an exit code."""
    from lab_utils.monitoring.gpu_exporter import GpuExporter  # lazy: subcommand only (cli stays fast to import)

    done = threading.Event()
    # handlers first: once the port answers, a supervisor may stop us at once, and a SIGTERM that arrived
    # before the handler would kill the process (exit -15) instead of stopping it cleanly
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        exporter = GpuExporter(port, host, strict_port=True)
        try:
            exporter.start()
        except OSError as err:
            print(f"nvlab gpu-exporter: {err}", flush=True)
            return 2
        print(exporter.describe().replace(exporter.url, f"http://{host}:{exporter.port}/metrics"), flush=True)
        try:
            done.wait()
        finally:
            exporter.stop()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def cmd_wheelhouse(args: argparse.Namespace) -> int:
    from nvlab.ops.wheelhouse import WheelhouseError, build  # lazy: subcommand only (cli stays fast to import)

    try:
        build(args.dir, python=args.python, platforms=args.platform, extras=args.extras.split(","),
              exclude_preinstalled=args.exclude_preinstalled)
    except WheelhouseError as err:
        return _fail("wheelhouse", err)
    return 0


def cmd_classroom(args: argparse.Namespace) -> int:
    from nvlab.classroom import manage  # lazy: subcommand only (cli stays fast to import)

    name = f"classroom {args.action}"
    try:
        if args.action == "down":
            killed = manage.stop(args.state)
            if killed:
                print(f"nvlab {name}: the hub left these behind, stopped now: " + "; ".join(killed), file=sys.stderr)
            print(f"nvlab {name}: the hub, its proxy and every student's server are stopped; the students' work is "
                  "kept (their homes, or their volumes in Docker)")
            return 0
        if args.action == "check-gpus":
            rows, problems = manage.check_gpus(args.state)
            for r in rows:
                print(f"{r['username']}: given {r['assigned']}; sees {r.get('count')} GPU(s) {r.get('uuids') or ''}"
                      + (f" ({r['error']})" if r.get("error") else ""))
            for p in problems:
                print(f"nvlab {name}: {p}", file=sys.stderr)
            return 1 if problems else 0
        opts = manage.Options(
            roster=args.roster, local=args.local, gpus=args.gpus, ip=args.ip, port=args.port, state=args.state,
            passwords_out=args.passwords_out, idle_timeout_s=args.idle_timeout, cull_every_s=args.cull_every,
            ssl_cert=args.ssl_cert, ssl_key=args.ssl_key, python=args.python or sys.executable,
            mem_limit=args.mem_limit, cpu_limit=args.cpu_limit, image=args.image, extra_config=args.extra_config)
        if args.local and (why := port_problem(args.ip, args.port, "pass --port with a free port")):
            return _fail(name, why + "; nothing was started")
        try:
            plan = manage.prepare(opts)
        except (manage.ClassroomError, manage.RosterError) as err:
            return _fail(name, f"{err}\nnvlab {name}: nothing was started")
        started = manage.start(opts, plan)
    except (manage.ClassroomError, manage.RosterError) as err:
        return _fail(name, err)
    print("\n".join(manage.summary_lines(plan, started, opts)))
    return 0


def cmd_progress(args: argparse.Namespace) -> int:
    from lab_utils.course import catalog, progress  # lazy: subcommand only (cli stays fast to import)

    if args.off and args.on:
        return _fail("progress", "--off and --on together: give one")
    if args.off or args.on:
        print(progress.disable(everywhere=True) if args.off else progress.enable(everywhere=True))
        return 0
    lab = None
    if args.lab is not None:
        try:
            lab = catalog.lab_by_number(args.lab).number
        except ValueError as err:
            return _fail("progress", err)
    print(progress.table(lab=lab))
    return 0


def cmd_stub_env(args: argparse.Namespace) -> int:
    from lab_utils.compat.numpy1_env import build_stub_env  # lazy: subcommand only (cli stays fast to import)

    print(json.dumps({"stub_env": str(build_stub_env())}))
    return 0


def cmd_quiz(args: argparse.Namespace) -> int:
    from nvlab.ops import quiz  # lazy: pulls pandas (cli stays fast to import)

    if args.action == "strategies":  # the one action with a seed and a language (the parser's defaults)
        return quiz.main(args.action, args.target, args.seed, args.language)
    return quiz.main(args.action, args.target)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nvlab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="what this machine has and which tier each lab runs in")
    d.add_argument("--json", action="store_true", help="machine-readable report")
    d.add_argument("--require-gpu", action="store_true", help="exit non-zero unless torch can use a GPU")
    d.set_defaults(fn=cmd_doctor)
    lab = sub.add_parser("lab", help="launch JupyterLab on labs/ (token auth, loopback)")
    lab.add_argument("--ip", default="127.0.0.1", help="address to listen on (default loopback only)")
    lab.add_argument("--port", type=_port, default=8888, help="port to listen on (default 8888); refused when taken")
    lab.add_argument("--any-port", action="store_true", help="when --port is taken, let JupyterLab pick a free one")
    lab.add_argument("--dir", help="notebook folder (default: labs/ of the course)")
    lab.set_defaults(fn=cmd_lab)
    r = sub.add_parser("run", help="execute lab notebooks with papermill")
    r.add_argument("labs", nargs="*", help="lab numbers, e.g. 00 01")
    r.add_argument("--all", action="store_true", help="every lab")
    r.add_argument("--solutions", action="store_true", help="run solutions/ instead of labs/")
    r.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="a parameter of the notebooks' parameters cell, read as its declared type "
                   "(true/false for a bool)")
    r.add_argument("--out", help="output folder (default runs/<time>)")
    r.add_argument("--timeout", type=_positive_int, default=1800, help="per-cell timeout in seconds")
    r.add_argument("--update-expected", action="store_true",
                   help="with --solutions: store the outputs of '# NBVAL_CHECK_OUTPUT' cells for nbval")
    r.add_argument("--skip-optional", action="store_true",
                   help="leave the optional sections' code cells (tagged 'optional') unrun: a student's core path")
    r.set_defaults(fn=cmd_run)
    b = sub.add_parser("build-labs", help="generate labs/ from solutions/")
    b.add_argument("--check", action="store_true", help="fail if labs/ differs; write nothing")
    b.set_defaults(fn=cmd_build_labs)
    rep = sub.add_parser("report", help="compare a run's results with the reference GPU run")
    rep.add_argument("run_dir")
    rep.add_argument("--reference", help="reference run folder (default: every folder in reference_runs/)")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(fn=cmd_report)
    ge = sub.add_parser("gpu-exporter", help="serve GPU (NVML) and host metrics for Prometheus until stopped")
    ge.add_argument("--port", type=_port, default=GPU_EXPORTER_PORT,
                    help=f"port to listen on (default {GPU_EXPORTER_PORT}, as dcgm-exporter)")
    ge.add_argument("--host", default="0.0.0.0", help="address to listen on (default all interfaces)")
    ge.set_defaults(fn=cmd_gpu_exporter)
    w = sub.add_parser("wheelhouse", help="download the course's wheels for an offline (--no-index) install")
    w.add_argument("dir", help="folder for the wheels, README.txt and requirements.txt")
    w.add_argument("--python", help="target Python MAJOR.MINOR (default: this one; with --exclude-preinstalled the "
                   "NGC image's)")
    w.add_argument("--platform", action="append", help="linux_x86_64 or linux_aarch64 (default: this machine's), or "
                   "a manylinux tag such as manylinux_2_39_x86_64")
    w.add_argument("--extras", default="lab,torch", help="the course's extras to include (default lab,torch; '' for "
                   "the core only; torch means the course's pinned torch)")
    w.add_argument("--exclude-preinstalled", action="store_true",
                   help="leave out what the pinned NGC PyTorch image already has (torch, TensorRT)")
    w.set_defaults(fn=cmd_wheelhouse)
    cr = sub.add_parser("classroom", help="one JupyterHub for a whole class: up, down, check-gpus")
    crs = cr.add_subparsers(dest="action", required=True)
    up = crs.add_parser("up", help="start the class's hub from a roster (Docker, or --local processes)")
    up.add_argument("--roster", type=Path, required=True, help="CSV with a header username[,email][,gpu][,role]")
    up.add_argument("--local", action="store_true", help="local processes (each student a system user when run as "
                    "root) instead of Docker containers")
    up.add_argument("--gpus", help="the GPU pool: all (default where GPUs exist), mig, none, or indices such as 0,1")
    up.add_argument("--ip", default="0.0.0.0", help="address the hub listens on (default all)")
    up.add_argument("--port", type=_port, default=8000, help="the hub's port (default 8000)")
    up.add_argument("--passwords-out", type=Path, help="file for username,password of each new account (mode 0600)")
    up.add_argument("--idle-timeout", type=_positive_int, default=3600, help="stop a server idle this many seconds "
                    "(default 3600)")
    up.add_argument("--cull-every", type=_positive_int, default=60, help="how often the culler looks, in seconds")
    up.add_argument("--ssl-cert", type=Path, help="the hub's TLS certificate (PEM); with --ssl-key")
    up.add_argument("--ssl-key", type=Path, help="its private key (PEM)")
    up.add_argument("--python", help="the Python each student's server runs (default this one); readable by them")
    up.add_argument("--mem-limit", help="each server's memory limit, e.g. 32G (enforced in Docker)")
    up.add_argument("--cpu-limit", type=float, help="each server's CPU limit in cores (enforced in Docker)")
    up.add_argument("--image", default="nvlab/classroom-singleuser:26.09", help="the students' image (Docker)")
    up.add_argument("--extra-config", type=Path, help="a jupyterhub_config.py loaded after the course's (e.g. "
                    "OAuthenticator)")
    down = crs.add_parser("down", help="stop the hub and every student's server; their work stays")
    cg = crs.add_parser("check-gpus", help="what each student's kernel sees of the GPUs (torch, as that student)")
    for a in (up, down, cg):
        a.add_argument("--state", type=Path, default=DEFAULT_STATE, help="the hub's state folder (default "
                       "~/.local/state/nvlab/classroom)")
    cr.set_defaults(fn=cmd_classroom)
    pr = sub.add_parser("progress", help="your exercise checks so far: labs done, exercises left, last wrong messages")
    pr.add_argument("--lab", help="one lab's exercises one by one (e.g. 01)")
    pr.add_argument("--off", action="store_true", help="stop recording checks, in every kernel, until --on")
    pr.add_argument("--on", action="store_true", help="record checks again")
    pr.set_defaults(fn=cmd_progress)
    se = sub.add_parser("stub-env", help="build the NumPy 1 environment the Triton wheel's python backend needs, "
                        "once; print its path as JSON")
    se.set_defaults(fn=cmd_stub_env)
    qz = sub.add_parser("quiz", help="lab 09's question bank: check it, score fixed guesses, write the glossary")
    qzs = qz.add_subparsers(dest="action", required=True)
    bank_help = "the bank's folder (default: NVLAB_QUIZ_DIR, else the course's)"
    qzs.add_parser("check", help="validate the bank").add_argument("target", nargs="?", help=bank_help)
    st = qzs.add_parser("strategies", help="how fixed ways of guessing score; exit 1 over the limit")
    st.add_argument("target", nargs="?", help=bank_help)
    st.add_argument("--seed", type=_nonnegative_int, default=0, help="the quiz's seed (default 0)")
    st.add_argument("--language", choices=("en", "zh"), default="en")
    qzs.add_parser("glossary", help="write docs/glossary.md from the bank").add_argument(
        "target", nargs="?", help="where to write it (default docs/glossary.md)")
    qz.set_defaults(fn=cmd_quiz)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra:  # reported by the subcommand, so the message points at its --help
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.fn(args))
