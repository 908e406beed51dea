"""What the browser and hub tests share: skipping (or failing, where CI requires the component) and finding the
processes a test run started by the marker variable they inherited."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab_utils.procs import env_flag


def missing(why: str, require_env: str) -> None:
    """Skip the test, or fail it where ``require_env=1`` says the component must be there (CI)."""
    if env_flag(require_env):
        pytest.fail(f"{require_env}=1 but {why}")
    pytest.skip(why)


def marked(marker: str, run: str) -> list[str]:
    """Live processes (zombies left out) that inherited ``marker=run`` from a test's run, as ``pid command``."""
    needle, out = f"{marker}={run}".encode(), []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (d / "environ").read_bytes().split(b"\0") and ") Z" not in (d / "stat").read_text():
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                out.append(f"{d.name} {cmd}")
        except OSError:
            continue
    return out
