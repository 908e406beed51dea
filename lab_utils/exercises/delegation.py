"""The delegation guard: a code answer must do the work, not hand it to the course's own implementation of it.

Each exercise names its references beside itself (``Exercise(references=References(fix, *targets))``). Before a
check runs anything, the static walk (``delegation``) follows the answer's code, without running it, to any of them;
while the check runs, ``Guard`` turns their code into traps for calls from the student's code (a name built at run
time). Either way the answer is refused in one line naming the reference and the fix.

Design notes: docs/internals.md#lab_utilsexercisesframeworkpy
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import itertools
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab_utils.exercises.student import StudentLine, _is_students

LAB_PACKAGE = "lab_utils.exercises."  # where the labs' exercise modules live


class References:
    """The course's implementations of one exercise's answer, and what to do instead (``fix``, no final stop).

    A target is a dotted name (``"lab_utils.mlops.canary.decide"``: resolved from the modules already imported, so
    naming one imports nothing) or the function or class itself (kept as its dotted name). They are the lab's
    ``reference_*`` (later cells call them, so a blank never stops a lab) and library functions doing the same job.
    """

    def __init__(self, fix: str, *targets: str | Callable[..., Any]):
        self.fix = fix
        self.targets: tuple[str, ...] = tuple(t if isinstance(t, str) else dotted_name(t) or repr(t) for t in targets)

    def __repr__(self) -> str:
        return f"References({self.fix!r}, {', '.join(map(repr, self.targets))})"


class ReferenceCalled(BaseException):
    """Raised in the student's code when it calls a reference implementation while its check runs (a
    BaseException, so `except Exception` in the student's code cannot swallow it)."""


@dataclass
class Refs:
    """One exercise's references as a check sees them: names, and the objects of the modules loaded so far."""

    fixes: dict[str, str]  # dotted name -> the fix
    objects: dict[int, tuple[str, Any]] = field(default_factory=dict)  # id -> (dotted name, the object)
    codes: dict[int, str] = field(default_factory=dict)  # id of a function's __code__ -> dotted name


def _static_attr(obj: Any, name: str) -> Any:
    """``obj.name`` without running the object's code (no property, no ``__getattr__``); None when unknown."""
    if isinstance(obj, types.ModuleType):
        found = obj.__dict__.get(name)
        return found if found is not None else sys.modules.get(f"{obj.__name__}.{name}")
    try:
        found = inspect.getattr_static(obj, name)
    except Exception:  # AttributeError, or an object too odd to inspect: unknown either way
        return None
    return found.__func__ if isinstance(found, (staticmethod, classmethod)) else found


def _resolve(dotted: str) -> Any:
    """The object a dotted name names, from the modules already imported (nothing is imported); None if unknown."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        obj = sys.modules.get(".".join(parts[:i]))
        if obj is None:
            continue
        for name in parts[i:]:
            obj = _static_attr(obj, name)
            if obj is None:
                return None
        return obj
    return None


def lab_of(module: str) -> str:
    """The lab module that ``module`` belongs to: ``lab_utils.exercises.lab02`` for itself and for the modules of a
    lab split into a package (``lab_utils.exercises.lab02.training``); any other module is its own."""
    if not module.startswith(LAB_PACKAGE):
        return module
    return LAB_PACKAGE + module.removeprefix(LAB_PACKAGE).split(".")[0]


def dotted_name(obj: Any) -> str | None:
    """Where a module, function or class is defined, as a dotted name (``lab_utils.mlops.canary.decide``); a public
    function of a lab split into a package is named as the notebook reaches it, by the package's re-export
    (``lab_utils.exercises.lab02.reference_train_ddp``)."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if isinstance(obj, (types.FunctionType, type)):
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(module, str) and isinstance(qualname, str):
            public = not qualname.startswith("_") and "." not in qualname
            return f"{lab_of(module) if public else module}.{qualname}"
    return None


def references_of(lab: str, var: str, own: References | None, siblings: Iterable[References] = ()) -> Refs:
    """What an answer to ``var`` may not reach: its exercise's references (``own``), and each public ``reference_*``
    of the lab module ``lab`` that none of the lab's exercises names (``siblings``: all their references)."""
    fixes = dict.fromkeys(own.targets, own.fix) if own else {}
    module = sys.modules.get(lab) if lab.startswith(LAB_PACKAGE) else None
    if module is not None:  # a public reference_* that no exercise names: refused in every code exercise of its lab
        named = {t for r in siblings for t in r.targets}
        for name in getattr(module, "__all__", ()):
            if name.startswith("reference_") and f"{lab}.{name}" not in named:
                fixes[f"{lab}.{name}"] = f"write `{var}` yourself"
    refs = Refs(fixes)
    for name in fixes:
        obj = _resolve(name)
        if obj is None:
            continue
        # By identity too: a re-export (lab02.busbw_factor is bandwidth's, drift.psi drift_stats') is one object.
        refs.objects.setdefault(id(obj), (name, obj))
        if isinstance(obj, types.FunctionType):
            refs.codes[id(obj.__code__)] = name
    return refs


# --- the static walk: what the answer's code reaches, without running it

_STACK_OPS = ("SWAP", "POP_TOP", "COPY", "ROT_TWO")  # between an import's IMPORT_FROMs and STOREs


def _line_of(ins: dis.Instruction, last: int) -> int:
    pos = getattr(ins, "positions", None)
    if pos is not None and pos.lineno:
        return int(pos.lineno)
    start = ins.starts_line
    return start if isinstance(start, int) and not isinstance(start, bool) else last


def _name_chains(code: types.CodeType,
                 aliases: dict[str, str] | None = None) -> Iterator[tuple[str, str, tuple[str, ...], int, str]]:
    """(kind, root name, attributes, line, function) of every name a code object reads, followed by the attributes
    read off it (``ex.reference_x`` is ("global", "ex", ("reference_x",), ...)); nested code objects included.
    A name bound by an import inside the code is kind "import" with the module path as the root."""
    aliases = dict(aliases or {})
    consts: list[Any] = [None, None]  # the last two constants: an import's level and fromlist
    imp: dict[str, Any] | None = None
    chain: list[Any] | None = None
    line = code.co_firstlineno
    for ins in dis.get_instructions(code):
        line = _line_of(ins, line)
        op, arg = ins.opname, ins.argval
        if op in ("LOAD_CONST", "LOAD_SMALL_INT"):
            consts = [consts[1], arg]
        if op == "IMPORT_NAME":
            level, fromlist = consts
            from_form = isinstance(fromlist, tuple)
            base = arg if not level and isinstance(arg, str) and arg else None
            imp = {"base": base, "from": from_form, "cur": base if from_form or base is None else base.split(".")[0]}
            if base:
                yield "import", base, (), line, code.co_name
            chain = None
            continue
        if op == "IMPORT_FROM" and imp is not None and imp["base"]:
            imp["cur"] = f"{imp['base'] if imp['from'] else imp['cur']}.{arg}"
            if imp["from"]:
                yield "import", imp["cur"], (), line, code.co_name
            continue
        if op.startswith("STORE_") and imp is not None and imp["base"] and isinstance(arg, str):
            aliases[arg] = imp["cur"]
            if not imp["from"]:
                imp = None
            continue
        if op not in _STACK_OPS:
            imp = None
        if op in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF") or (
                op.startswith("LOAD_FAST") and isinstance(arg, str)):
            kind = "import" if arg in aliases else "global" if op in ("LOAD_GLOBAL", "LOAD_NAME") else \
                "deref" if "DEREF" in op else "fast"
            chain = [kind, aliases.get(arg, arg), []]
            yield kind, chain[1], (), line, code.co_name
        elif op in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None and isinstance(arg, str):
            chain[2].append(arg)
            yield chain[0], chain[1], tuple(chain[2]), line, code.co_name
        else:
            chain = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _name_chains(const, aliases)


def _worth_walking(obj: Any) -> bool:
    return callable(obj) or isinstance(obj, (list, tuple, set, frozenset, dict, staticmethod, classmethod))


def _some(items: Any) -> list[Any]:
    """The first items of a container worth walking: a table of functions is short, a data set is not one."""
    return [v for v in itertools.islice(items, 64) if _worth_walking(v)]


def _students_class(cls: type) -> bool:
    return any(isinstance(v, types.FunctionType) and _is_students(v.__code__.co_filename) for v in vars(cls).values())


def _where(line: int, function: str) -> str:
    return str(StudentLine("", line, function, ""))


class _Walk:
    """Everything an answer reaches without running it, until a reference implementation turns up."""

    def __init__(self, refs: Refs):
        self.refs = refs
        self.seen: set[int] = set()
        self.kept: list[Any] = []  # what was seen stays alive, so that no id is reused during the walk
        self.todo: list[tuple[Any, str | None, str | None]] = []  # (object or None, dotted path, where)

    def hit(self, obj: Any, path: str | None) -> str | None:
        refs = self.refs
        if path in refs.fixes:  # the name the student wrote, where it is a registered one
            return path
        if obj is not None:
            own = dotted_name(obj)
            if own in refs.fixes:
                return own
            if id(obj) in refs.objects:
                return refs.objects[id(obj)][0]
            if isinstance(obj, types.FunctionType) and id(obj.__code__) in refs.codes:
                return refs.codes[id(obj.__code__)]  # a copy of a reference (types.FunctionType(ref.__code__, ...))
        return None

    def find(self, value: Any) -> tuple[str, str | None, bool] | None:
        """(the reference's dotted name, where the student's code reaches it, whether it is the answer itself)."""
        name = self.hit(value, None)
        if name:
            return name, None, True
        self.todo.append((value, None, None))
        while self.todo:
            obj, path, where = self.todo.pop()
            name = self.hit(obj, path)
            if name:
                return name, where, False
            if obj is None or id(obj) in self.seen:
                continue
            self.seen.add(id(obj))
            self.kept.append(obj)
            kids = list(self.children(obj, where))  # walk_code queues onto self.todo itself
            self.todo.extend((child, None, at) for child, at in kids)
        return None

    def children(self, obj: Any, where: str | None) -> Iterator[tuple[Any, str | None]]:
        if isinstance(obj, functools.partial):
            yield from ((x, where) for x in (obj.func, *obj.args, *obj.keywords.values()) if _worth_walking(x))
        elif isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            yield obj.__func__, where
        elif isinstance(obj, types.FunctionType):
            wrapped = obj.__dict__.get("__wrapped__")
            if wrapped is not None:
                yield wrapped, where
            if _is_students(obj.__code__.co_filename):  # a library function is not walked into: it may use anything
                self.walk_code(obj)
        elif isinstance(obj, type):
            if _students_class(obj):
                yield from ((v, where) for v in vars(obj).values() if _worth_walking(v))
                yield from ((base, where) for base in obj.__bases__)
        elif isinstance(obj, dict):
            yield from ((v, where) for v in _some(obj.values()))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            yield from ((v, where) for v in _some(obj))
        elif callable(obj) and _students_class(type(obj)):  # a callable object of the student's own class
            yield type(obj), where
            state = getattr(obj, "__dict__", None)
            if isinstance(state, dict):
                yield from ((v, where) for v in _some(state.values()))

    def walk_code(self, fn: types.FunctionType) -> None:
        """Queue what a student's function reads: names and their attribute chains, defaults, closures."""
        glb = fn.__globals__
        builtins = glb.get("__builtins__", {})
        builtins = builtins if isinstance(builtins, dict) else vars(builtins)
        cells: dict[str, Any] = {}
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
            with contextlib.suppress(ValueError):  # an empty cell
                cells[name] = cell.cell_contents
        here = _where(fn.__code__.co_firstlineno, fn.__code__.co_name)
        defaults = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values(), *cells.values()]
        self.todo.extend((v, None, here) for v in defaults if _worth_walking(v))
        suffixes = list(self.refs.fixes)
        for kind, root, attrs, line, function in _name_chains(fn.__code__):
            at = _where(line, function)
            if kind == "import":
                obj, path = _resolve(root), root
            elif kind == "global" and root in glb:
                obj, path = glb[root], None
            elif kind == "deref" and root in cells:
                obj, path = cells[root], None
            elif kind == "global" and root not in builtins and attrs:
                # Unknown here (code that runs elsewhere, e.g. in Triton's python backend): match by the names only.
                text = ".".join((root, *attrs))
                match = next((s for s in suffixes if s.endswith("." + text)), None)
                if match:
                    self.todo.append((None, match, at))
                continue
            else:
                continue
            path = path or dotted_name(obj)
            for name in attrs:
                obj = _static_attr(obj, name) if obj is not None else None
                path = f"{path}.{name}" if path else None
            if obj is not None and _worth_walking(obj) or path in self.refs.fixes:
                self.todo.append((obj, path, at))


def delegation(value: Any, refs: Refs) -> str | None:
    """The one-line refusal of an answer that is, or reaches, one of ``refs``; None when it reaches none."""
    if not refs.fixes:
        return None
    found = _Walk(refs).find(value)
    if found is None:
        return None
    name, where, itself = found
    fix = refs.fixes[name]
    if itself:
        return f"your answer is {name}: {fix}"
    return f"your answer calls {name}" + (f" ({where})" if where else "") + f": {fix}"


# --- the dynamic guard: references become traps for the student's code while its check runs

_PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep  # lab_utils/


@functools.lru_cache(maxsize=4096)
def _in_package(filename: str) -> bool:
    return not filename.startswith("<") and os.path.realpath(filename).startswith(_PACKAGE_DIR)


def _students_caller(frame: types.FrameType | None) -> StudentLine | None:
    """The student's line that called a reference, or None when this package's code did (a check, or a helper).
    Frames of the standard library and installed packages are looked through (``map``, ``functools``)."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if _in_package(filename):
            return None
        if _is_students(filename):
            return StudentLine(filename, frame.f_lineno, frame.f_code.co_name, "")
        frame = frame.f_back
    return None


def _trap_body(*args: Any, **kwargs: Any) -> Any:
    # This code object becomes a reference's __code__ while a check runs, so it runs with that module's globals:
    # it reaches this module through the import system, not a name.
    return __import__("lab_utils.exercises.delegation", None, None, ["_sprung"])._sprung(args, kwargs)


# id(trap code) -> (the trap code, the reference, a function running the reference's own code); made once per
# reference and kept, so that a call already inside a trap when its check ends still finds its entry
_TRAPS: dict[int, tuple[types.CodeType, types.FunctionType, Callable[..., Any]]] = {}
_TRAP_OF: dict[int, types.CodeType] = {}  # id(a reference function) -> its trap code
_GUARDS: list[Guard] = []


def _sprung(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A trapped reference was called: refuse when the student's code called it, else run the real one."""
    trap = sys._getframe(1)
    _, _, original = _TRAPS[id(trap.f_code)]
    at = _students_caller(trap.f_back)
    if at is not None:
        owner = next((g for g in reversed(_GUARDS) if id(trap.f_code) in g.owned), None)
        if owner is not None:
            raise owner.refuse(owner.owned[id(trap.f_code)], at)
    return original(*args, **kwargs)


def _trap_for(fn: types.FunctionType) -> types.CodeType | None:
    """The trap code for a reference function (made once), or None where one cannot replace its code."""
    if fn.__closure__:  # the trap has no free variables, and a code object must match its function's closure
        return None
    if id(fn.__code__) in _TRAPS:  # already trapped by an enclosing check
        return None
    trap = _TRAP_OF.get(id(fn))
    if trap is None:
        original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        original.__kwdefaults__ = fn.__kwdefaults__
        original.__qualname__ = fn.__qualname__
        trap = _trap_body.__code__.replace(co_name=fn.__code__.co_name)
        _TRAP_OF[id(fn)] = trap
        _TRAPS[id(trap)] = (trap, fn, original)
    return trap


class Guard:
    """While one check grades: its references' code is a trap for calls from the student's code."""

    def __init__(self, refs: Refs):
        self.refs = refs
        self.refused: str | None = None
        self.owned: dict[int, str] = {}  # id of a trap code this guard put in place -> the reference's name
        self._undo: list[tuple[types.FunctionType, types.CodeType]] = []

    def __enter__(self) -> Guard:
        _GUARDS.append(self)
        for name, obj in self.refs.objects.values():  # a class is trapped at its __init__
            fn = obj if isinstance(obj, types.FunctionType) else vars(obj).get("__init__") \
                if isinstance(obj, type) else None
            trap = _trap_for(fn) if isinstance(fn, types.FunctionType) else None
            if trap is None:
                continue
            self._undo.append((fn, fn.__code__))
            self.owned[id(trap)] = name
            fn.__code__ = trap
        return self

    def __exit__(self, *exc: Any) -> None:
        for fn, code in reversed(self._undo):
            fn.__code__ = code
        _GUARDS.remove(self)

    def refuse(self, name: str, at: StudentLine) -> ReferenceCalled:
        fix = self.refs.fixes.get(name) or next(iter(self.refs.fixes.values()), "write it yourself")
        message = f"your answer calls {name} ({_where(at.lineno, at.function)}): {fix}"
        self.refused = self.refused or message
        return ReferenceCalled(message)
