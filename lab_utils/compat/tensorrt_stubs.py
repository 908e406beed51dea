"""Works around: tensorrt-stubs 10.13 (the PyPI type stubs lab 03 type-checks TensorRT code against where TensorRT
cannot run) is not valid Python to mypy and leaves out two runtime conversions. Goes when: a tensorrt-stubs release
that mypy reads as shipped (``trt_check`` then puts the installed package on ``MYPYPATH`` as it is).

``repair_stub_line`` repairs one line; ``write_repaired(files, folder)`` writes a repaired copy of the package's
``.pyi`` files. ``lab_utils.inference.trt_check.repaired_stubs`` finds the installed stubs and keeps the copy in
the course cache, one folder per stubs version and ``REVISION``.

Design notes: docs/internals.md#lab_utilscompattensorrt_stubspy"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterable
from importlib.metadata import PackagePath
from pathlib import Path

REVISION = "r2"  # of the repair: in the cached copy's folder name, so a changed repair is written anew


def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + ([cur] if cur.strip() else [])


_DIMS_PARAM = re.compile(r"(:\s*)Dims(\s*(?:=|$))")


def repair_stub_line(line: str) -> str:
    """Two generator slips make tensorrt-stubs 10.13 unparsable: parameters named ``in`` and a parameter without a
    default after defaulted ones. Rename the first, give the second ``= ...``. And a parameter typed ``Dims``
    also takes a tuple or list of ints, as the runtime does (``profile.set_shape(name, (1, 3, 8, 8), ...)``)."""
    line = re.sub(r"([(,]\s*)in(\s*:)", r"\1in_\2", line)
    if not (m := re.match(r"^(\s*def \w+\()(.*)(\)\s*->.*:\s*)$", line)):
        return line
    params, defaulted = _split_params(m.group(2)), False
    for i, p in enumerate(params):
        name = p.split(":")[0].split("=")[0].strip()
        if name.startswith("*"):
            defaulted = False
        elif "=" in p:
            defaulted = True
        elif defaulted:
            params[i] = p + " = ..."
        params[i] = _DIMS_PARAM.sub(r"\1Dims | typing.Sequence[int]\2", params[i])
    return m.group(1) + ",".join(params) + m.group(3)


def _repair_stub_text(text: str) -> str:
    text = "\n".join(repair_stub_line(ln) for ln in text.splitlines()) + "\n"
    text = re.sub(r"(?m)^import tensorrt_libs as tensorrt_libs\n", "", text)
    text = re.sub(r"(?m)^bool:", "bool_:", text)
    # Dims is a sequence at runtime (len, indexing, iteration: tuple(dims) works); the stubs leave out __iter__.
    return re.sub(r"(?m)^(class Dims:\n(?:    \"\"\"(?:.|\n)*?\"\"\"\n)?)",
                  r"\1    def __iter__(self) -> typing.Iterator[int]:\n        ...\n", text, count=1)


def write_repaired(stubs: Iterable[PackagePath], final: Path, *, replace: bool = False) -> Path:
    """``final``: the ``.pyi`` files ``stubs`` (the installed distribution's) repaired for mypy, at their paths.

    Syntax repaired, the module-level ``bool`` DataType (which shadows the builtin in every annotation)
    renamed, the import of the runtime-only ``tensorrt_libs`` dropped, and two runtime conversions the
    stubs leave out allowed (a tuple for ``Dims``, iterating a ``Dims``). The API surface is otherwise
    unchanged. Written beside ``final`` and renamed into place; ``replace``: an existing ``final`` is replaced."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".stubs-", dir=final.parent))
    try:
        for f in stubs:
            out = staging / str(f)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(_repair_stub_text(Path(str(f.locate())).read_text()))
        if replace and final.exists():
            shutil.rmtree(final)
        try:
            staging.rename(final)  # atomic: a second process writing the same folder loses the race harmlessly
        except OSError:
            if not (final / "tensorrt" / "__init__.pyi").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
