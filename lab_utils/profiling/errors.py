"""An asynchronous CUDA error located: the same bad index run with and without ``CUDA_LAUNCH_BLOCKING=1``.

A device-side assert leaves the CUDA context unusable, so each run happens in its own subprocess. The script's
lines are numbered so that the traceback's line can be shown beside the line that really failed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

from lab_utils.procs import temporary_folder

__all__ = ["BAD_INDEX_SCRIPT", "BAD_LINE", "run_bad_index", "reported_line"]

# Line 5 launches the faulty kernel (index 42 of a 10-element tensor); lines 6-8 are unrelated work.
BAD_INDEX_SCRIPT = """\
import torch
device = "{device}"
x = torch.arange(10, device=device)
idx = torch.tensor([3, 42], device=device)  # 42 is out of range
y = x[idx]  # the faulty kernel: reads x[42]
a = torch.randn(512, 512, device=device)
b = a @ a  # unrelated work, queued behind it
print("sum", float(b.sum()))  # the first read-back: the host waits here
"""
BAD_LINE = 5


def reported_line(traceback_text: str, script: str = "bad_index.py") -> int | None:
    """The last line of ``script`` named in a traceback (where the error surfaced), or None."""
    lines = re.findall(rf'File "[^"]*{re.escape(script)}", line (\d+)', traceback_text)
    return int(lines[-1]) if lines else None


def run_bad_index(device: str, launch_blocking: bool, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run ``BAD_INDEX_SCRIPT`` on ``device`` in a subprocess; return the line the error points at, the line
    that really failed (``BAD_LINE``), the exception's last line and the traceback."""
    env = dict(os.environ)
    env.pop("CUDA_LAUNCH_BLOCKING", None)
    if launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    with temporary_folder("bad-index") as d:
        path = d / "bad_index.py"
        path.write_text(BAD_INDEX_SCRIPT.format(device=device))
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=d)
    err = proc.stderr.replace(str(d) + os.sep, "")
    tb = err[err.rfind("Traceback (most recent call last):"):] if "Traceback" in err else err
    lines = tb.strip().splitlines()
    # The exception's own line ("torch.AcceleratorError: CUDA error: ..."), not the hints printed after it.
    last = next((ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", ln)),
                next((ln for ln in reversed(lines) if ln.strip() and not ln.startswith(" ")), ""))
    line = reported_line(tb)
    return {"device": device, "CUDA_LAUNCH_BLOCKING": "1" if launch_blocking else "unset",
            "returncode": proc.returncode, "reported_line": line, "faulty_line": BAD_LINE, "at_fault": line == BAD_LINE,
            "error": last[:200], "traceback": _short_traceback(tb)}


def _short_traceback(tb: str, keep: int = 14) -> str:
    """The traceback without torch's long C++ frames: the Python frames and the error's first lines."""
    skip = ("frame #", "Exception raised from", "C++ CapturedTraceback")
    out = [ln for ln in tb.splitlines() if not ln.strip().startswith(skip)]
    return "\n".join(out[:keep])
