"""Works around: perf_analyzer's PyPI wheel is tagged manylinux_2_38, and Debian 12 (glibc 2.36) can neither install
nor run it. Goes when: every course machine has glibc >= 2.38 (Ubuntu 24.04, the NGC images) or perf_analyzer
ships a wheel for an older glibc.

``glibc_version()`` reads the C library's version; ``perf_analyzer_note`` says whether the wheel can help on this
machine and ``start_failure_note`` why a binary that names a missing ``GLIBC_`` cannot start. Both end up in
``lab_utils.serving.perf_analyzer.perf_analyzer_status``'s reasons.

Design notes: docs/internals.md#lab_utilscompatglibcpy"""

from __future__ import annotations

import platform

PERF_ANALYZER_GLIBC = (2, 38)  # the perf-analyzer wheel's platform tag: manylinux_2_38


def glibc_version() -> tuple[int, int] | None:
    """The C library's version, e.g. (2, 36); None where it is not glibc (musl, macOS)."""
    lib, version = platform.libc_ver()
    if lib != "glibc" or not version:
        return None
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def perf_analyzer_note(install: str | None = None) -> str:
    """Why ``install`` (the command that installs perf-analyzer's wheel) does or does not help on this machine;
    None: perf_analyzer is installed, and the note says whether this glibc lets it run."""
    have = glibc_version()
    need = ".".join(map(str, PERF_ANALYZER_GLIBC))
    if have is None:
        return f"its wheel is built for Linux with glibc >= {need}"
    head = "its wheel" if install is None else f"`{install}` cannot help here: its wheel"
    if have < PERF_ANALYZER_GLIBC:
        return (f"{head} needs glibc >= {need} (tag manylinux_2_38) and this machine has glibc {have[0]}.{have[1]} "
                "(Debian 12 has 2.36; Ubuntu 24.04 and the NGC images have 2.39)")
    return f"glibc {have[0]}.{have[1]} is new enough" + ("" if install is None else f": `{install}`")


def start_failure_note(output: str) -> str:
    """`` (why)`` to add to the reason of a perf_analyzer that failed to start, when its ``output`` names a missing
    ``GLIBC_`` version (``GLIBC_2.38' not found``); "" otherwise."""
    return f" ({perf_analyzer_note()})" if "GLIBC" in output else ""
