"""Argument checks shared by the lab modules (one place, one wording)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def check_int(value: Any, arg: str, where: str, minimum: int = 1, maximum: int | None = None, what: str = "") -> int:
    """``value`` as an int, or a ValueError naming ``where(arg=...)``, the bounds and ``what`` it counts."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum or \
            (maximum is not None and value > maximum):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{where}({arg}={value!r}): must be an integer {bound}" + (f" ({what})" if what else ""))
    return int(value)


def check_ints(values: Any, arg: str, where: str) -> list[int]:
    """One integer >= 1 or a non-empty sequence of them, as a list; a ValueError naming ``where(arg=...)`` (the
    index too, ``arg[i]``, among several)."""
    values = [values] if isinstance(values, (int, np.integer)) else list(values)
    if not values:
        raise ValueError(f"{where}({arg}=[]): give at least one value")
    return [check_int(v, f"{arg}[{i}]" if len(values) > 1 else arg, where) for i, v in enumerate(values)]


def check_positive(value: Any, arg: str, where: str, zero_ok: bool = False, what: str = "number") -> float:
    """``value`` as a finite ``what`` > 0 (>= 0 with ``zero_ok``), or a ValueError naming ``where(arg=...)``."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and \
        math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        raise ValueError(f"{where}({arg}={value!r}): must be a finite {what} {'>=' if zero_ok else '>'} 0")
    return float(value)
