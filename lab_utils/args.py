"""Argument checks shared by the lab modules (one place, one wording)."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_int(value: Any, arg: str, where: str, minimum: int = 1) -> int:
    """``value`` as an int, or a ValueError naming ``where(arg=...)`` and the bound."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{where}({arg}={value!r}): must be an integer >= {minimum}")
    return int(value)
