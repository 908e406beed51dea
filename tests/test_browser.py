"""The course in a real browser: ``nvlab lab`` started as a student starts it (loopback, a token), driven by
Playwright through Debian's chromium. What papermill and nbval cannot see: the token page, JupyterLab opening the
labs, lab 00 run from the page (no error output, the tier table and an HTML table rendered, a blank exercise "not
attempted", one typed in "correct"), lab 01's roofline explorer answering its dtype control, a plot rendered as an
image, the one help line under an exercise (no hint in the page), no first-start pop-up, and layout basics at 1280 px. A
broken copy of a lab and a missing token are shown to be caught.

A notebook runs from the Run menu only once its kernel is connected and idle: before that the toolbar already
reads "idle" beside "No Kernel", and cells run then are silently dropped (why Run All once never started).
JupyterLab's own log is ``nvlab-lab.log`` in the test's ``jupyter`` temporary folder.

JupyterLab and chromium start once per module; both, and every kernel, are gone afterwards. Screenshots of each
step go to ``$NVLAB_SCREENSHOTS`` (default: ``browser-screenshots`` under pytest's base temporary folder). Without
playwright or chromium the tests skip, unless ``NVLAB_REQUIRE_BROWSER=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _require import marked, missing

from lab_utils.course import specs
from lab_utils.procs import free_port, popen_owned, stop_group

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "data" / "browser"
REQUIRE_ENV = "NVLAB_REQUIRE_BROWSER"
CHROMIUM = os.environ.get("NVLAB_CHROMIUM", "/usr/bin/chromium")
MARKER = "NVLAB_BROWSER_TEST"  # inherited by JupyterLab, its kernels and chromium: how leftovers are found
WIDTH, HEIGHT = 1280, 900
TOKEN = "browser-test-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("NVLAB_SCREENSHOTS") or tmp_path_factory.getbasetemp() / "browser-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """``nvlab lab`` on a copy of labs/ (running cells from the page must not touch the repository's files)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing("playwright is not installed (pip install -e '.[test]')", REQUIRE_ENV)
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        missing(f"no chromium at {CHROMIUM} (apt-get install chromium, or set NVLAB_CHROMIUM)", REQUIRE_ENV)
    home = tmp_path_factory.mktemp("jupyter")
    labs = home / "labs"
    shutil.copytree(ROOT / "labs", labs)
    shutil.copy(FIXTURES / "broken_lab.ipynb", labs)
    run = f"{os.getpid()}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k not in ("NVLAB_HEADLESS", "NVLAB_RUN_ID", "MPLBACKEND")}
    env.update({
        MARKER: run, "JUPYTER_TOKEN": TOKEN, "NVLAB_QUICK": "1", "NVLAB_RESULTS_DIR": str(home / "results"),
        # a first start: no user settings or workspace of an earlier session (they would hide a pop-up)
        "JUPYTERLAB_SETTINGS_DIR": str(home / "user-settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "ws"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        # the kernels' IPython profile: no startup files or history of the person running the tests
        "IPYTHONDIR": str(home / "ipython"),
    })
    # every cell in the page (not only those scrolled into view), so that the checks read all outputs
    tracker = home / "user-settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    port = free_port()
    log = (home / "nvlab-lab.log").open("w")
    proc = popen_owned([sys.executable, "-m", "nvlab", "lab", "--port", str(port), "--dir", str(labs)],
                       env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # ready when the API answers with the token
            try:
                urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2).read()
                break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"nvlab lab did not start:\n{(home / 'nvlab-lab.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield {"base": base, "labs": labs, "log": home / "nvlab-lab.log", "run": run}
    finally:
        stop_group(proc, grace_s=20)  # SIGTERM: JupyterLab shuts its kernels down, then exits
        log.close()
        deadline = time.monotonic() + 15
        while (left := marked(MARKER, run)) and time.monotonic() < deadline:
            time.sleep(0.3)
        for line in left:  # said below, and not left running for the next test either
            with contextlib.suppress(OSError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        assert not left, "left running after the browser and nvlab lab stopped:\n" + "\n".join(left)


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: chromium's sandbox refuses to run as root (CI); the pages are the course's own
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"],
                              env={**os.environ, MARKER: lab["run"]})  # found by the leftover check too
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def page(browser, lab):
    """One logged-in page for the tests that use the lab (the token is given once, as a student does)."""
    ctx = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
    pg = ctx.new_page()
    open_lab(pg, lab["base"], TOKEN)
    yield pg
    ctx.close()


class LabNotOpened(AssertionError):
    """JupyterLab did not show the labs folder."""


def open_lab(pg, base: str, token: str | None, timeout_s: float = 60) -> None:
    """Open JupyterLab as a student does (the URL ``nvlab lab`` prints); ``LabNotOpened`` when the lab's file browser
    with the labs does not appear."""
    pg.goto(f"{base}/lab" + (f"?token={token}" if token else ""))
    labs = pg.locator(".jp-DirListing-item", has_text="00_environment.ipynb")
    login = pg.locator("input[type=password]")  # Jupyter's "Password or token" form
    try:  # whichever comes first: the login form is a definite no, no need to wait the timeout out
        labs.or_(login).first.wait_for(timeout=timeout_s * 1000)
    except Exception as err:  # playwright's TimeoutError
        raise LabNotOpened(f"no file browser with the labs at {pg.url}: {str(err).splitlines()[0]}") from None
    if not labs.first.is_visible():
        raise LabNotOpened(f"the login page at {pg.url}, not the labs")


def _notebook(pg):
    return pg.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")


def open_notebook(pg, name: str, timeout_s: float = 120) -> None:
    """Open ``name`` from the file browser and wait until its kernel is connected and idle.

    The toolbar's execution indicator reads "idle" already while the panel says "No Kernel" (the session is still
    being created): cells run then are dropped without a word, so the kernel's name must show first."""
    pg.locator(".jp-DirListing-item", has_text=name).dblclick()
    panel = pg.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    panel.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=timeout_s * 1000)
    deadline = time.monotonic() + timeout_s
    while True:
        kernel = panel.locator(".jp-Toolbar-kernelName").first.inner_text().strip()
        status = panel.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status")
        if kernel and kernel != "No Kernel" and status == "idle":
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: no idle kernel after {timeout_s} s (kernel {kernel!r}, status {status!r})")
        time.sleep(0.25)


def run_all(pg, timeout_s: float = 120) -> dict:
    """Run > Run All Cells (the menu, as a student does) in the open notebook and wait until nothing is running; what
    the page then shows: ``errors`` (first line of each traceback), ``unrun`` (code cells never executed: an error
    stopped Run All)."""
    nb = _notebook(pg)
    pg.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    pg.locator(".lm-Menu-item:visible", has_text="Run All Cells").first.click()
    deadline = time.monotonic() + timeout_s
    started = False
    while True:  # done: nothing queued or running, and every cell ran or a traceback stopped the run
        prompts = nb.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
        texts = nb.locator(".jp-OutputArea-output").all_inner_texts()
        # a traceback's last "SomeError: message" line (its first names the error but not the message); a
        # SyntaxError shows no "Traceback", only where it is
        errors = [([ln for ln in t.splitlines() if re.match(r"\w+(Error|Exception): ", ln)] or [t[:200]])[-1]
                  for t in texts if "Traceback" in t or re.search(r"^\s*Cell In\[\d+\], line \d+", t, re.M)]
        idle = not any("*" in p for p in prompts)
        started = started or not idle or any(re.search(r"\[\d+\]", p) for p in prompts)
        if started and idle and (errors or all(re.search(r"\[\d+\]", p) for p in prompts)):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"Run All not finished after {timeout_s} s: {prompts}")
        time.sleep(0.5)
    unrun = sum(1 for p in prompts if not re.search(r"\[\d+\]", p))
    return {"errors": errors, "unrun": unrun, "prompts": prompts, "texts": texts}


def shot(pg, folder: Path, name: str) -> None:
    pg.screenshot(path=str(folder / f"{name}.png"), full_page=False)


# --- the token ---------------------------------------------------------------------------------------------------


def test_without_the_token_the_page_asks_for_it(browser, lab, shots):
    ctx = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
    pg = ctx.new_page()
    try:
        with pytest.raises(LabNotOpened):  # the check sees the failure: no lab without the token
            open_lab(pg, lab["base"], None, timeout_s=8)
        shot(pg, shots, "01-token-page")
        assert "/login" in pg.url
        assert pg.locator("input[type=password]").first.is_visible()  # "Password or token"
        assert "token" in pg.locator("body").inner_text().lower()
        with pytest.raises(urllib.error.HTTPError) as err:  # the API refuses too
            urllib.request.urlopen(f"{lab['base']}/api/contents", timeout=5)
        assert err.value.code == 403
        with pytest.raises(LabNotOpened):
            open_lab(pg, lab["base"], "not-" + TOKEN, timeout_s=8)
    finally:
        ctx.close()


def test_with_the_token_jupyterlab_opens_the_labs_without_a_pop_up(page, lab, shots):
    names = page.locator(".jp-DirListing-item .jp-DirListing-itemName").all_inner_texts()
    assert {"00_environment.ipynb", "01_cuda_timing.ipynb"} <= set(names)
    time.sleep(3)  # the news question appears a moment after start, when it is asked at all
    shot(page, shots, "02-lab-opened")
    toasts = page.locator(".jp-Notification-Toast, .Toastify__toast").all_inner_texts()
    assert not toasts, f"a pop-up covers the lab: {toasts}"
    settings = json.loads(urllib.request.urlopen(
        f"{lab['base']}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={TOKEN}",
        timeout=10).read())
    # the course's overrides.json is read: its values are the defaults the page gets
    assert settings["schema"]["properties"]["fetchNews"]["default"] == "false"


# --- lab 00 from the page ----------------------------------------------------------------------------------------


def test_lab00_runs_clean_and_its_exercises_answer(page, shots):
    open_notebook(page, "00_environment.ipynb")
    res = run_all(page)
    shot(page, shots, "03-lab00-run-all")
    assert not res["errors"] and not res["unrun"], res["errors"] or f"{res['unrun']} cells did not run"
    text = "\n".join(res["texts"])
    # the setup cell's tier table (rich's text table), this lab's row with its tier, shown whole
    assert "Lab tiers on this machine" in text and re.search(r"│ 00 +│ .+│ (FULL|PARTIAL|CPU) +│", text), text[:2000]
    nb = _notebook(page)
    assert nb.locator(".jp-OutputArea-output table").count() >= 1  # a DataFrame rendered as an HTML table
    assert "not attempted" in text  # the generated lab's exercises are blank

    # by position: a locator filtered on the cell's text would lose the cell once the answer is typed over it
    sources = nb.locator(".jp-CodeCell .jp-InputArea-editor").all_inner_texts()
    cell = nb.locator(".jp-CodeCell").nth(next(i for i, t in enumerate(sources) if "memory_gib = None" in t))
    cell.locator(".cm-content").click()
    page.keyboard.press("Control+a")
    page.keyboard.type("memory_gib = 143771 / 1024\nex.q4.check(memory_gib)")
    page.keyboard.press("Shift+Enter")
    out = cell.locator(".jp-OutputArea-output")
    out.filter(has_text="correct").first.wait_for(timeout=30_000)
    shot(page, shots, "04-lab00-exercise-correct")
    assert "[ok]" in out.first.inner_text() and "incorrect" not in out.first.inner_text()

    layout = nb.evaluate("""nb => {
        const md = [...nb.querySelectorAll('.jp-MarkdownOutput')];
        return {
          scroll: md.filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.innerText.slice(0, 60)),
          noAlt: [...nb.querySelectorAll('.jp-MarkdownOutput img')].filter(i => !i.alt.trim()).map(i => i.src),
          wide: [...nb.querySelectorAll('table')].filter(t => t.getBoundingClientRect().width > window.innerWidth)
                 .map(t => t.innerText.slice(0, 60)),
          markdown: md.length,
          tiers: [...nb.querySelectorAll('.jp-OutputArea-output')].filter(e => e.innerText.includes('Lab tiers on'))
                 .map(e => e.scrollWidth - e.clientWidth),
          // JupyterLab wraps a long output line instead of scrolling: laid out unwrapped, it must still fit
          tierWrap: [...nb.querySelectorAll('.jp-OutputArea-output pre')]
                 .filter(e => e.innerText.includes('Lab tiers on'))
                 .map(e => { e.style.whiteSpace = 'pre'; const over = e.scrollWidth - e.clientWidth;
                             e.style.whiteSpace = ''; return over; }),
        };
    }""")
    assert layout["markdown"] > 10
    assert not layout["scroll"], f"markdown wider than the page at {WIDTH} px: {layout['scroll']}"
    assert not layout["noAlt"], f"images without alt text: {layout['noAlt']}"
    assert not layout["wide"], f"tables wider than the page: {layout['wide']}"
    assert layout["tiers"] and max(layout["tiers"]) <= 1, f"the tier table scrolls sideways by {layout['tiers']} px"
    assert layout["tierWrap"] and max(layout["tierWrap"]) <= 1, \
        f"the tier table's lines wrap at {WIDTH} px: {layout['tierWrap']} px too wide"


def test_a_cell_that_raises_is_caught(page, shots):
    open_notebook(page, "broken_lab.ipynb")
    res = run_all(page)
    shot(page, shots, "05-broken-lab")
    assert any("deliberately broken" in e for e in res["errors"]), res["errors"]
    assert res["unrun"] == 1  # Run All stopped at the error


# --- lab 01's roofline explorer ----------------------------------------------------------------------------------


def test_lab01_roofline_explorer_answers_its_dtype_control(page, shots):
    from playwright.sync_api import expect

    open_notebook(page, "01_cuda_timing.ipynb")
    res = run_all(page)
    shot(page, shots, "06-lab01-run-all")
    assert not res["errors"] and not res["unrun"], res["errors"] or f"{res['unrun']} cells did not run"
    nb = _notebook(page)
    assert nb.locator(".jp-OutputArea-output img").count() >= 2  # the sweep and the roofline, as images
    cell = nb.locator(".jp-CodeCell", has_text="widgets.roofline_explorer")
    status = cell.locator(".widget-html-content").first
    # the summary, not the "measuring fp32 n=... ..." line shown while the matmul runs
    status.filter(has_text=re.compile(r"fp32 n=\d+( on |: not measured)")).wait_for(timeout=60_000)
    cell.scroll_into_view_if_needed()
    shot(page, shots, "07-lab01-explorer")
    before = status.inner_text()
    plot = cell.locator(".widget-output img")
    plot.first.wait_for(timeout=60_000)
    plot_before = plot.first.get_attribute("src")
    cell.locator(".widget-dropdown select").first.select_option("bf16")
    status.filter(has_text=re.compile(r"bf16 n=\d+( on |: not measured)")).wait_for(timeout=60_000)
    bf16_ref = specs.h200_reference_tflops()["bf16"]  # the committed H200 run's point
    assert status.inner_text() != before and f"H200 reference {bf16_ref:.1f}" in status.inner_text()
    # the roofline redrawn with the new point: one image still, another picture (it follows the status line)
    expect(plot).to_have_count(1)
    expect(plot.first).not_to_have_attribute("src", plot_before, timeout=60_000)
    shot(page, shots, "08-lab01-explorer-bf16")


# --- the help line under an exercise ------------------------------------------------------------------------------


def test_the_line_under_an_exercise_says_how_to_get_help_and_shows_no_hint(page, shots):
    """Under each check the generated lab says, in one line, how to get the next hint and when the solution comes;
    no hint is in the page (they come one call at a time)."""
    from playwright.sync_api import expect

    from lab_utils.exercises import lab01

    open_notebook(page, "01_cuda_timing.ipynb")
    nb = _notebook(page)
    line = nb.locator(".jp-MarkdownOutput", has_text="ex.q1.hint()").first
    line.scroll_into_view_if_needed(timeout=60_000)
    expect(line).to_be_visible()
    text = " ".join(line.inner_text().split())
    assert "gives the next of its" in text and "once you have checked an attempt" in text, text
    shot(page, shots, "09-lab01-help-line")
    assert nb.locator(".jp-MarkdownOutput details summary", has_text="Hint 1 of").count() == 0
    words = " ".join(lab01.q1.hints[0].replace("`", "").split())
    expect(nb.get_by_text(words[:60])).to_have_count(0)
