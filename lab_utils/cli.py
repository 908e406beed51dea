"""``nvlab``: check a machine, launch the course, execute labs, build labs, compare with the reference run."""

from __future__ import annotations

import argparse
import ast
import json
import os
import secrets
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from lab_utils.course.catalog import repo_root


def _literal(text: str) -> Any:
    """A -p value as papermill would take it: a Python literal when it parses, else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def cmd_doctor(args: argparse.Namespace) -> int:
    from lab_utils.course.probe import probe
    from lab_utils.course.session import print_report
    from lab_utils.procs import sweep_stale_tempdirs
    from lab_utils.serving.server import remove_stale_shm

    # what killed kernels and servers left behind (no exit handler ran): their owners are gone, so it goes
    removed = [str(p) for p in sweep_stale_tempdirs()] + [f"/dev/shm/{n}" for n in remove_stale_shm()]
    report = probe()
    if args.json:
        print(report.to_json())
    else:
        print_report(report)
    if removed:
        print(f"nvlab doctor: removed {len(removed)} leftover(s) of course processes that were killed: "
              + ", ".join(removed), file=sys.stderr if args.json else sys.stdout)
    if not report.can_run:
        print(f"nvlab doctor: the course cannot run here: missing {', '.join(report.missing)}; "
              "install with: pip install -e '.[lab]'", file=sys.stderr)
        return 1
    if args.require_gpu and not report.gpu_usable:
        why = "; ".join(report.reasons)
        print(f"nvlab doctor: --require-gpu, but no GPU is usable by torch: {why}", file=sys.stderr)
        return 2
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    folder = Path(args.dir) if args.dir else repo_root() / "labs"
    if not folder.is_dir():
        print(f"nvlab lab: {folder} is not a folder; pass --dir to the labs folder", file=sys.stderr)
        return 2
    jupyter = shutil.which("jupyter")
    if not jupyter:
        print("nvlab lab: JupyterLab is not installed: pip install -e '.[lab]'", file=sys.stderr)
        return 2
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    if args.ip not in ("127.0.0.1", "localhost", "::1"):
        print(f"nvlab lab: listening on {args.ip}: anyone who can reach this machine can try the token")
    argv = [jupyter, "lab", f"--ServerApp.root_dir={folder}", f"--ServerApp.ip={args.ip}",
            f"--ServerApp.port={args.port}", "--ServerApp.open_browser=False"]
    if os.geteuid() == 0:  # containers and CI often run as root; Jupyter refuses that unless told
        argv.append("--allow-root")
    env = dict(os.environ, JUPYTER_TOKEN=token)  # token auth stays on: an empty token is never passed
    print(f"JupyterLab on http://{args.ip}:{args.port}/lab?token={token}", flush=True)
    os.execvpe(jupyter, argv, env)
    return 0  # not reached


def cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lab_utils.ops.notebooks import execute, leftover_processes, select, update_expected

    console = Console(stderr=False)
    try:
        paths = select(args.labs, args.all, args.solutions)
    except ValueError as err:
        print(f"nvlab run: {err}", file=sys.stderr)
        return 2
    if not paths:
        print("nvlab run: no notebooks to run", file=sys.stderr)
        return 2
    if args.update_expected and not args.solutions:
        print("nvlab run: --update-expected writes into solutions/: add --solutions", file=sys.stderr)
        return 2
    params = {name: _literal(value) for name, value in (args.parameter or [])}
    out = Path(args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    run_id = uuid.uuid4().hex
    failed = 0
    total = time.perf_counter()
    for i, p in enumerate(paths, 1):
        console.print(f"[{i}/{len(paths)}] {p.parent.name}/{p.name} ...")
        res = execute(p, out, params, run_id, timeout_s=args.timeout)
        left = leftover_processes(run_id)
        if res.ok and not left:
            console.print(f"    ok in {res.seconds:.1f} s -> {res.output}")
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
    from lab_utils.ops.notebooks import NotebookError, build_labs

    try:
        changed = build_labs(check=args.check)
    except NotebookError as err:
        print(f"nvlab build-labs: {err}", file=sys.stderr)
        return 2
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

    from lab_utils.course.results import compare, reference_dirs

    ref = args.reference or ", ".join(str(p) for p in reference_dirs()) or "no reference run"
    try:
        df = compare(args.run_dir, args.reference)
    except FileNotFoundError as err:
        print(f"nvlab report: {err}", file=sys.stderr)
        return 2
    if df.empty:
        print(f"nvlab report: no results_*.json in {args.run_dir}", file=sys.stderr)
        return 2
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
    from lab_utils.monitoring.exporter import serve

    return serve(port=args.port, host=args.host)


def cmd_wheelhouse(args: argparse.Namespace) -> int:
    from lab_utils.ops.wheelhouse import WheelhouseError, build

    try:
        build(args.dir, python=args.python, platforms=args.platform, extras=args.extras.split(","),
              exclude_preinstalled=args.exclude_preinstalled)
    except WheelhouseError as err:
        print(f"nvlab wheelhouse: {err}", file=sys.stderr)
        return 2
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvlab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="what this machine has and which tier each lab runs in")
    d.add_argument("--json", action="store_true", help="machine-readable report")
    d.add_argument("--require-gpu", action="store_true", help="exit non-zero unless torch can use a GPU")
    d.set_defaults(fn=cmd_doctor)
    lab = sub.add_parser("lab", help="launch JupyterLab on labs/ (token auth, loopback)")
    lab.add_argument("--ip", default="127.0.0.1", help="address to listen on (default loopback only)")
    lab.add_argument("--port", type=int, default=8888)
    lab.add_argument("--dir", help="notebook folder (default: labs/ of the course)")
    lab.set_defaults(fn=cmd_lab)
    r = sub.add_parser("run", help="execute lab notebooks with papermill")
    r.add_argument("labs", nargs="*", help="lab numbers, e.g. 00 01")
    r.add_argument("--all", action="store_true", help="every lab")
    r.add_argument("--solutions", action="store_true", help="run solutions/ instead of labs/")
    r.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="papermill parameter (a Python literal or a string)")
    r.add_argument("--out", help="output folder (default runs/<time>)")
    r.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds")
    r.add_argument("--update-expected", action="store_true",
                   help="with --solutions: store the outputs of '# NBVAL_CHECK_OUTPUT' cells for nbval")
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
    ge.add_argument("--port", type=int, default=9400, help="port to listen on (default 9400, as dcgm-exporter)")
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
