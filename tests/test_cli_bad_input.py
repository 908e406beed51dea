"""Bad input fails safely: every ``nvlab`` subcommand refuses bad arguments before it starts anything, with exit
code 2 and one line on stderr that names the problem and the fix, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lab_utils.course import probe
from lab_utils.course.catalog import repo_root
from nvlab import cli
from nvlab.ops import notebooks

LAB00 = repo_root() / "labs" / "00_environment.ipynb"


def _subcommands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser by its words ("run", "classroom up"): nested subcommands included."""
    action = next(a for a in (parser or cli.parser())._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, sub in action.choices.items():
        nested = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
        out.update({f"{name} {k}": v for k, v in _subcommands(sub).items()} if nested else {name: sub})
    return out


def _generic_cases() -> list[tuple[str, list[str], str]]:
    """Bad arguments derived from each subcommand's own options: a new subcommand or option is covered too."""
    cases = []
    for name, sub in _subcommands().items():
        needed = [a for a in sub._actions if not a.option_strings and a.nargs not in ("*", "?")]
        # its positional arguments given (a folder that exists), so only the option is wrong
        words = name.split()
        # and its required options (`classroom up --roster`), so that the unknown option is what is refused
        required = [x for a in sub._actions if a.option_strings and a.required
                    for x in (a.option_strings[-1], "{good}")]
        cases.append((f"{name}-unknown-option", [*words, *["{good}"] * len(needed), *required, "--no-such-option"],
                      "--no-such-option"))
        if needed:
            cases.append((f"{name}-missing-argument", words, "required"))
        for a in sub._actions:
            if not a.option_strings or a.nargs == 0:
                continue
            opt = a.option_strings[-1]
            if isinstance(a.nargs, int) and a.nargs > 1:
                cases.append((f"{name}{opt}-too-few", [*words, opt, "x"], opt))
            if a.type is not None:
                try:
                    a.type("not-a-number")
                except (argparse.ArgumentTypeError, ValueError, TypeError):
                    cases.append((f"{name}{opt}-not-a-number", [*words, opt, "not-a-number"], "not-a-number"))
            if a.choices:
                cases.append((f"{name}{opt}-bad-choice", [*words, opt, "no-such-choice"], "no-such-choice"))
    return cases


# (id, argv, text the message must hold); {file}, {trunc}, {shape}, {good}, {busy}, {pid} are filled in per test
SPECIFIC = [
    ("lab-port-0", ["lab", "--port", "0"], "1 to 65535"),
    ("lab-port-99999", ["lab", "--port", "99999"], "1 to 65535"),
    ("lab-port-busy", ["lab", "--port", "{busy}"], "port {busy} is already in use by pid {pid}"),
    ("lab-dir-missing", ["lab", "--dir", "{file}/nope"], "--dir"),
    ("lab-ip-not-here", ["lab", "--ip", "192.0.2.1", "--port", "{busy}"], "192.0.2.1"),
    ("gpu-exporter-port-0", ["gpu-exporter", "--port", "0"], "1 to 65535"),
    ("gpu-exporter-port-99999", ["gpu-exporter", "--port", "99999"], "1 to 65535"),
    ("gpu-exporter-port-busy", ["gpu-exporter", "--host", "127.0.0.1", "--port", "{busy}"],
     "port {busy} is already in use by pid {pid}"),
    ("gpu-exporter-host-not-here", ["gpu-exporter", "--host", "192.0.2.1"], "192.0.2.1"),
    ("run-unknown-lab", ["run", "17"], "unknown lab '17'"),
    ("run-nothing", ["run"], "--all"),
    ("run-bool-maybe", ["run", "00", "-p", "quick", "maybe"], "true, yes, on, 1, false, no, off, 0"),
    ("run-unknown-parameter", ["run", "00", "-p", "quik", "true"], "valid names: quick"),
    ("run-none-default-word", ["run", "01", "-p", "reps", "x"], "reps takes a number or a list of numbers"),
    ("run-none-default-list-of-words", ["run", "09", "-p", "batches", "[a]"], "batches takes a number or a list"),
    ("run-unknown-parameter-all", ["run", "--all", "-p", "quik", "true"], "quick"),
    ("run-timeout-0", ["run", "00", "--timeout", "0"], "greater than 0"),
    ("run-timeout-negative", ["run", "00", "--timeout=-5"], "greater than 0"),
    ("run-out-under-file", ["run", "00", "--out", "{file}/out"], "{file}/out"),
    ("run-out-is-file", ["run", "00", "--out", "{file}"], "{file}"),
    ("run-update-expected", ["run", "00", "--update-expected"], "--solutions"),
    ("report-missing", ["report", "{file}/nope"], "not a folder of results"),
    ("report-truncated", ["report", "{trunc}"], "{trunc}/results_01.json: not valid JSON"),
    ("report-wrong-shape", ["report", "{shape}"], "{shape}/results_01.json: a list of measurements expected"),
    ("report-reference-missing", ["report", "{good}", "--reference", "{file}/nope"], "{file}/nope"),
    ("build-labs-extra", ["build-labs", "extra"], "extra"),
    ("wheelhouse-under-file", ["wheelhouse", "{file}/wheels"], "{file}/wheels"),
    ("wheelhouse-python", ["wheelhouse", "{file}/wheels", "--python", "abc"], "MAJOR.MINOR"),
    ("wheelhouse-platform", ["wheelhouse", "{file}/wheels", "--platform", "win_amd64"], "not supported"),
    ("wheelhouse-extras", ["wheelhouse", "{file}/wheels", "--extras", "nosuch"], "nosuch"),
    ("progress-unknown-lab", ["progress", "--lab", "42"], "unknown lab '42'"),
    ("progress-off-and-on", ["progress", "--off", "--on"], "--off and --on together"),
]


@pytest.fixture
def places(tmp_path, monkeypatch, capsys):
    """Paths for the table: a regular file, broken and good results folders, a port something listens on."""
    (tmp_path / "file").write_text("a regular file: nothing can be created under it\n")
    row = {"lab": "01", "name": "m", "value": 1.0, "unit": "s", "tier": "cpu", "device": "x", "versions": {}}
    for name, text in {"trunc": json.dumps([row])[:25], "shape": json.dumps({"m": 1.0}),
                       "good": json.dumps([row])}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results_01.json").write_text(text)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield {"file": str(tmp_path / "file"), "trunc": str(tmp_path / "trunc"), "shape": str(tmp_path / "shape"),
               "good": str(tmp_path / "good"), "busy": str(s.getsockname()[1]), "pid": str(os.getpid()),
               "tmp": tmp_path, "monkeypatch": monkeypatch, "capsys": capsys}


def _nvlab(argv: list[str], cwd: Path, timeout: float = 30) -> subprocess.CompletedProcess:
    """``nvlab ARGV`` as a user runs it: a new Python process (the two subprocess cases below)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NVLAB_REFERENCE_DIR", "JUPYTER_TOKEN")}
    return subprocess.run([sys.executable, "-m", "nvlab", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _check_refusal(argv: list[str], code: int | None, out: str, err: str, must_hold: str) -> str:
    assert "Traceback" not in out + err, out + err
    assert code == 2, f"nvlab {' '.join(argv)}: exit {code}\n{out}{err}"
    err = err.strip()
    assert err and "\n" not in err, f"not one line on stderr:\n{err}"
    assert must_hold in err, err
    return err


def _refused(argv: list[str], places: dict, must_hold: str) -> str:
    """``cli.main(argv)`` in this process (a new interpreter per case cost a second each): exit 2, one line."""
    argv = [a.format(**places) for a in argv]
    mp, capsys = places["monkeypatch"], places["capsys"]
    for name in ("NVLAB_REFERENCE_DIR", "JUPYTER_TOKEN"):
        mp.delenv(name, raising=False)
    mp.chdir(places["tmp"])
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse and the subcommands' refusals
        code = stop.code
    out, err = capsys.readouterr()
    return _check_refusal(argv, code, out, err, must_hold.format(**places))


@pytest.mark.parametrize("argv,must_hold", [
    (["run", "17"], "unknown lab '17'"), (["lab", "--port", "{busy}"], "port {busy} is already in use by pid {pid}")],
    ids=["run-unknown-lab", "lab-port-busy"])
def test_a_refusal_in_a_new_process_is_one_line_and_exit_2(argv, must_hold, places):
    """The in-process cases above hold for the real command line too (entry point, no traceback, exit 2)."""
    argv = [a.format(**places) for a in argv]
    r = _nvlab(argv, places["tmp"])
    _check_refusal(argv, r.returncode, r.stdout, r.stderr, must_hold.format(**places))


@pytest.mark.parametrize("argv,must_hold", [pytest.param(a, m, id=i) for i, a, m in _generic_cases()])
def test_every_subcommand_refuses_bad_arguments_in_one_line(argv, must_hold, places):
    _refused(argv, places, must_hold)


@pytest.mark.parametrize("argv,must_hold", [pytest.param(a, m, id=i) for i, a, m in SPECIFIC])
def test_bad_input_is_refused_naming_the_problem(argv, must_hold, places):
    _refused(argv, places, must_hold)


def test_every_subcommand_is_in_the_tables():
    names = set(_subcommands())
    generic = {n for n in names if any(argv[:len(n.split())] == n.split() for _, argv, _ in _generic_cases())}
    assert generic == names, "every subcommand gets generic bad-argument cases"
    assert {argv[0] for _, argv, _ in SPECIFIC} <= {n.split()[0] for n in names}


def test_writable_folder_creates_or_names_it(tmp_path):
    assert cli.writable_problem(tmp_path / "a" / "b", "--out") is None and (tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("")
    assert str(tmp_path / "f" / "x") in cli.writable_problem(tmp_path / "f" / "x", "--out")


@pytest.mark.parametrize("text,value", [("false", False), ("no", False), ("0", False), ("False", False),
                                        ("true", True), ("yes", True), ("1", True), ("TRUE", True)])
def test_bool_parameter_is_read_as_a_bool(text, value):
    assert notebooks.parameters_for([LAB00], [("quick", text)]) == {LAB00: {"quick": value}}


def test_parameters_take_the_declared_type(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell('n = 3\nrate = 0.5\nmode = "fast"\nsizes = None\nflag: bool = True')
    cell.metadata["tags"] = ["parameters"]
    nb.cells.append(cell)
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    got = notebooks.parameters_for([path], [("n", "7"), ("rate", "2"), ("mode", "1"), ("sizes", "[1, 2]"),
                                            ("flag", "no")])[path]
    assert got == {"n": 7, "rate": 2.0, "mode": "1", "sizes": [1, 2], "flag": False}
    assert isinstance(got["rate"], float)
    with pytest.raises(ValueError, match="whole number"):
        notebooks.parameters_for([path], [("n", "1.5")])
    with pytest.raises(ValueError, match="is a number"):
        notebooks.parameters_for([path], [("rate", "fast")])
    with pytest.raises(ValueError, match="valid names: flag, mode, n, rate, sizes"):
        notebooks.parameters_for([path], [("m", "1")])


def test_report_names_the_broken_file_and_the_missing_reference(places):
    err = _refused(["report", "{good}", "--reference", "{shape}"], places, "{shape}/results_01.json")
    assert "list of measurements" in err
    row = {"lab": "01", "name": "m", "value": "fast", "unit": "s", "tier": "cpu", "device": "x"}
    Path(places["shape"], "results_01.json").write_text(json.dumps([row]))
    assert "value 'fast' is not a number" in _refused(["report", "{shape}"], places, "{shape}/results_01.json")
    del row["value"]
    Path(places["shape"], "results_01.json").write_text(json.dumps([row]))
    assert "lacks value" in _refused(["report", "{shape}"], places, "{shape}/results_01.json")
    empty = places["tmp"] / "empty"
    empty.mkdir()
    _refused(["report", "{good}", "--reference", str(empty)], places, "holds no results_*.json")


def test_find_jupyter_lab_beside_the_interpreter_without_path(monkeypatch):
    beside = Path(sys.executable).parent / "jupyter-lab"
    if not beside.exists():
        pytest.skip("JupyterLab is not installed beside this interpreter")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert probe.find_jupyter_lab() == str(beside)


def test_lab_any_port_prints_the_port_jupyter_took(places, tmp_path):
    """With --port taken and --any-port, the URL printed is the one Jupyter serves, found without the venv on
    PATH (as `.venv/bin/nvlab lab` in a fresh shell)."""
    busy = int(places["busy"])
    env = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_TOKEN", "VIRTUAL_ENV")}
    env.update(PATH="/usr/bin:/bin", JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    proc = subprocess.Popen([sys.executable, "-m", "nvlab", "lab", "--port", str(busy), "--any-port"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("JupyterLab on http://127.0.0.1:"), first
        base, token = first.split(" on ", 1)[1].strip().split("/lab?token=")
        assert not base.endswith(f":{busy}")
        deadline = time.monotonic() + 60
        while True:  # the URL is written once Jupyter listens: it answers at once, or soon on a loaded machine
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    assert r.status == 200
                break
            except OSError:
                assert time.monotonic() < deadline, "the printed URL did not answer within 60 s"
                time.sleep(0.3)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_lab_url_uses_the_reported_port_and_loopback_for_a_wildcard():
    info = {"port": 8891, "base_url": "/", "token": "abc", "url": "http://container-name:8891/"}
    assert cli._lab_url(info, "0.0.0.0", "other") == "http://127.0.0.1:8891/lab?token=abc"
    assert cli._lab_url({"port": 9000, "base_url": "/x/"}, "::1", "t") == "http://[::1]:9000/x/lab?token=t"
