"""Answers that are the course's own objects: a public constant of ``lab_utils``, what a ``hands_out`` helper
returned, or an equal copy built from either. Identity, never equality: a right answer written by hand equals the
course's, but it is never the same object.

Design notes: docs/internals.md#lab_utilsexercisesframeworkpy
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from lab_utils.exercises.delegation import dotted_name

_NAME_CHARS = re.compile(r"[A-Za-z0-9_]*")  # a str constant of only these is interned by the compiler: shared
_HANDED_OUT: dict[int, tuple[str, Any]] = {}  # id -> (the call, its result): the latest, kept alive (no id reuse)
_HANDED_OUT_KEEP = 64


def _identifiable(obj: Any) -> bool:
    """Whether being this very object says where a value came from: not a singleton, a cached small int, an interned
    string, a function or a class (those are the references' business: ``delegation``)."""
    if obj is None or isinstance(obj, (bool, enum.Enum, type, types.ModuleType)) or callable(obj):
        return False
    if isinstance(obj, int):
        return not -5 <= obj <= 256
    if isinstance(obj, (str, bytes)):
        return len(obj) > 1 and not (isinstance(obj, str) and _NAME_CHARS.fullmatch(obj))
    if isinstance(obj, (tuple, frozenset)):
        return len(obj) > 0
    return True


def hands_out(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a public helper whose result would pass as an answer (a value exercise's reference): each result is
    remembered (a string as a fresh copy, so that no student's literal is that object), and a check refuses it."""
    named = dotted_name(fn) or f"{fn.__module__}.{fn.__qualname__}"  # a split lab's helper by the path students use

    @functools.wraps(fn)
    def remembered(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if type(result) is str and len(result) > 1:
            result = result[:1] + result[1:]  # a new object: "real" is interned, and a student's "real" is that one
        if type(result) is str or _identifiable(result):
            _HANDED_OUT.pop(id(result), None)
            _HANDED_OUT[id(result)] = (f"what {named}(...) returned", result)
            while len(_HANDED_OUT) > _HANDED_OUT_KEEP:
                del _HANDED_OUT[next(iter(_HANDED_OUT))]
        return result

    remembered.__hands_out__ = True  # type: ignore[attr-defined]
    return remembered


def _inside(obj: Any, limit: int = 512) -> Iterator[Any]:
    """The objects a container holds, nested (dict values, items), at most ``limit``; containers only are opened."""
    todo, seen = [obj], 0
    while todo and seen < limit:
        cur = todo.pop()
        kids = list(itertools.islice(cur.values() if isinstance(cur, dict) else cur, limit)) \
            if isinstance(cur, (dict, list, tuple, set, frozenset)) else []
        for kid in kids:
            seen += 1
            yield kid
            todo.append(kid)


def _course_objects(first: str | None) -> dict[int, tuple[str, Any]]:
    """id -> (dotted name, object) of every identifiable public module-level object of ``lab_utils`` loaded so far;
    the module ``first`` wins a tie (lab 09's H200_RIDGE is lab 01's object)."""
    names = sorted((n for n in list(sys.modules) if n == "lab_utils" or n.startswith("lab_utils.")),
                   key=lambda n: n != first)
    found: dict[int, tuple[str, Any]] = {}
    for name in names:
        module = sys.modules.get(name)
        for attr, value in list(vars(module).items()) if module is not None else ():
            if not attr.startswith("_") and _identifiable(value):
                found.setdefault(id(value), (f"{name}.{attr}", value))
    return found


def course_object(value: Any, first: str | None = None) -> str | None:
    """How ``value`` is the course's own: "your answer is <a public object of lab_utils>", or what a ``hands_out``
    helper returned, or an equal copy built from one (it shares a list, a dict or a float with it); else None."""
    if not _identifiable(value) and not (type(value) is str and id(value) in _HANDED_OUT):
        return None
    if id(value) in _HANDED_OUT:
        return f"your answer is {_HANDED_OUT[id(value)][0]}"
    objects = _course_objects(first)
    if id(value) in objects:
        return f"your answer is {objects[id(value)][0]}"
    if not isinstance(value, (dict, list, tuple, set, frozenset)):
        return None
    shared = {id(x) for x in _inside(value) if _identifiable(x)}
    for name, obj in [*objects.values(), *_HANDED_OUT.values()]:
        if isinstance(obj, type(value)) and any(id(x) in shared for x in _inside(obj)):
            with contextlib.suppress(Exception):  # an odd __eq__ (arrays): not a copy we can tell
                if bool(value == obj):
                    return f"your answer is a copy of {name}"
    return None
