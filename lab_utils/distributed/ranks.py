"""Run a function written in a notebook cell (or a test) on N ranks: how by-hand cells and code exercises reach
the ranks.

``ship`` sends a notebook function to spawned ranks as source, with the names it uses, so a rank's traceback points
at the student's own line. ``run(fn, nprocs)`` runs ``fn(ctx, **kwargs)`` on every rank (``spawn.launch``), or with
``group=False`` ``fn(**kwargs)`` in the environment torchrun would give. ``stack_frames`` reads the stacks a
timeout collects (``spawn.WorkerTimeout.stacks``).

Design notes: docs/internals.md#lab_utilsdistributedrankspy"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dis
import inspect
import os
import pickle
import pkgutil
import re
import sysconfig
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab_utils.procs import temporary_folder

if TYPE_CHECKING:
    from lab_utils.distributed.spawn import WorkerContext

MAX_PICKLED_BYTES = 1 << 20  # a notebook value larger than this is refused: build it inside the function

_PACKAGE = Path(__file__).resolve().parents[1]  # lab_utils/
_LIBRARY_DIRS = sorted({os.path.realpath(d) for k in ("stdlib", "platstdlib", "purelib", "platlib")
                        if (d := sysconfig.get_paths().get(k))})


class ShipError(ValueError):
    """A function cannot be sent to the ranks; the message says why and what to change."""


def is_library_file(filename: str) -> bool:
    """True for a file of this package, of the standard library or of an installed package (not the student's).

    The one test of "whose code is this" for shipping functions here and for the exercises' tracebacks; this
    module imports no torch, so the torch-free lab 00 can use it too."""
    if not filename or filename.startswith("<"):
        return False
    real = os.path.realpath(filename)
    if real.startswith(str(_PACKAGE) + os.sep) or "site-packages" in real or "dist-packages" in real:
        return True
    return any(real.startswith(d + os.sep) for d in _LIBRARY_DIRS)


@dataclass(frozen=True)
class Shipped:
    """A function as the ranks receive it: by reference (``module`` and ``qualname``), or as source files.

    ``files``: one file per shipped function, its lines numbered as in its cell; ``deps``: the file that defines
    the names they use; ``aliases``: (name, function name) pairs for functions the notebook calls by another
    name. ``load()`` (in the rank) returns the function."""

    name: str
    module: str | None = None
    qualname: str = ""
    files: tuple[str, ...] = ()
    deps: str | None = None
    aliases: tuple[tuple[str, str], ...] = field(default=())

    def load(self) -> Callable[..., Any]:
        """The function, in this process (a rank): imported by name, or its files executed in a fresh namespace."""
        if self.module is not None:
            return _resolve(self.module, self.qualname)
        ns: dict[str, Any] = {"__name__": f"nvlab_shipped_{self.name}", "__builtins__": builtins,
                              "__file__": self.files[0]}
        for path in filter(None, (self.deps, *self.files)):  # the names they use first
            exec(compile(Path(path).read_text(), path, "exec"), ns)  # noqa: S102 (the student's own code)
        for alias, target in self.aliases:
            ns[alias] = ns[target]
        return ns[self.name]


def _resolve(module: str, qualname: str) -> Any:
    return pkgutil.resolve_name(f"{module}:{qualname}")


def _unpickle(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 (written by this package, from the notebook's own value)


def _global_names(code: types.CodeType) -> set[str]:
    """Names a code object (and the functions and comprehensions inside it) reads from its module's globals."""
    names = {i.argval for i in dis.get_instructions(code)
             if i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _def_time_names(source: str) -> set[str]:
    """Names a ``def`` evaluates when it runs: decorators, default values, annotations."""
    tree = ast.parse(source)
    if (node := next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)) is None:
        return set()
    a = node.args
    parts: list[ast.AST | None] = [*node.decorator_list, *a.defaults, *a.kw_defaults, node.returns]
    parts += [arg.annotation for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if arg]
    return {n.id for p in parts if p is not None for n in ast.walk(p) if isinstance(n, ast.Name)}


def _importable(value: Any) -> tuple[str, str] | None:
    """(module, qualname) when ``value`` can be imported by name in a fresh interpreter, else None."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__" or "<" in qualname:
        return None
    try:
        return (module, qualname) if _resolve(module, qualname) is value else None
    except (ImportError, AttributeError, ValueError):
        return None


def _check_function(fn: Any) -> types.FunctionType:
    if not isinstance(fn, types.FunctionType):
        raise ShipError(f"expected a function defined with `def`, got {type(fn).__name__}")
    if (name := fn.__name__) == "<lambda>":
        raise ShipError("a lambda cannot be sent to the ranks: define the function with `def` at the top of a cell")
    if "<locals>" in fn.__qualname__ or fn.__closure__:
        raise ShipError(f"`{name}` is defined inside another function: define it at the top level of a cell, "
                        "so the ranks can rebuild it from its source")
    return fn


def _source(fn: types.FunctionType) -> str:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise ShipError(f"the source of `{fn.__name__}` cannot be read (defined with exec?): define it in a "
                        "notebook cell or a .py file") from None


def ship(fn: Callable[..., Any], folder: str | os.PathLike[str]) -> Shipped:
    """Prepare ``fn`` for the ranks, writing its files under ``folder`` (which must outlive the launch)."""
    fn = _check_function(fn)
    if is_library_file(fn.__code__.co_filename) and (ref := _importable(fn)):
        return Shipped(fn.__name__, module=ref[0], qualname=ref[1])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    home = fn.__globals__
    functions: dict[str, types.FunctionType] = {}  # __name__ -> function shipped as source
    aliases: dict[str, str] = {}
    deps: dict[str, str] = {}  # name -> the statement that defines it in the rank
    todo = [fn]
    while todo:
        f = todo.pop()
        if functions.setdefault(f.__name__, f) is not f:
            raise ShipError(f"two different functions named `{f.__name__}` are used: rename one")
        source = _source(f)
        for name in sorted((_global_names(f.__code__) | _def_time_names(source)) - set(deps) - set(functions)):
            if name not in home:
                continue  # a builtin, or never defined (the rank raises NameError, as the cell would)
            value = home[name]
            if isinstance(value, types.ModuleType):
                deps[name] = f"import {value.__name__} as {name}"
            elif (isinstance(value, types.FunctionType) and value.__globals__ is home
                  and not is_library_file(value.__code__.co_filename)):
                _check_function(value)
                if value.__name__ != name:
                    aliases[name] = value.__name__
                if value.__name__ not in functions:
                    todo.append(value)
            elif ref := _importable(value):
                module, qualname = ref
                deps[name] = (f"from {module} import {qualname} as {name}" if "." not in qualname
                              else f"{name} = _nvlab_resolve({module!r}, {qualname!r})")
            else:
                deps[name] = f"{name} = _nvlab_unpickle({_pickled(value, name, fn.__name__)!r})"
    files = []
    for f in functions.values():
        path = folder / f"{f.__name__}.py"
        # Blank lines up to the def's line in its cell: line numbers in a rank's traceback are the cell's.
        path.write_text("\n" * (f.__code__.co_firstlineno - 1) + _source(f))
        files.append(str(path))
    deps_path = None
    if deps:
        deps_path = folder / f"_{fn.__name__}_names.py"
        head = "from lab_utils.distributed.ranks import _resolve as _nvlab_resolve, _unpickle as _nvlab_unpickle\n"
        deps_path.write_text(head + "\n".join(deps[k] for k in sorted(deps)) + "\n")
    # The entry function's file first: its name is the one shown in messages.
    files.sort(key=lambda p: Path(p).stem != fn.__name__)
    return Shipped(fn.__name__, files=tuple(files), deps=None if deps_path is None else str(deps_path),
                   aliases=tuple(sorted(aliases.items())))


def _pickled(value: Any, name: str, fn_name: str) -> bytes:
    what = f"`{fn_name}` uses the notebook's `{name}` ({type(value).__name__})"
    try:
        data = pickle.dumps(value)
    except Exception as err:
        raise ShipError(f"{what}, which cannot be sent to the ranks ({type(err).__name__}): create it inside the "
                        "function instead") from None
    if len(data) > MAX_PICKLED_BYTES:
        raise ShipError(f"{what}, {len(data) / 2**20:.1f} MiB: too large to send to the ranks; create it inside "
                        "the function instead")
    return data


@contextlib.contextmanager
def shipping(fn: Callable[..., Any]) -> Iterator[Shipped]:
    """``ship(fn)`` into a temporary folder that is removed when the block ends."""
    with temporary_folder("ranks") as folder:
        yield ship(fn, folder)


def call_shipped(ctx: WorkerContext, shipped: Shipped, kwargs: dict[str, Any], group: bool = True) -> Any:
    """Worker (in each rank): load the shipped function and call it, with ``ctx`` when the launcher made a group."""
    fn = shipped.load()
    ctx.status(f"in {shipped.name}()")
    return fn(ctx, **kwargs) if group else fn(**kwargs)


def run(fn: Callable[..., Any], nprocs: int, *, backend: str = "auto", kwargs: dict[str, Any] | None = None,
        timeout_s: float = 300.0, group: bool = True, env: dict[str, str] | None = None) -> list[Any]:
    """Run a notebook's ``fn`` on ``nprocs`` ranks; returns each rank's result, indexed by rank.

    ``group=True``: ``fn(ctx, **kwargs)`` in a process group the launcher made (``spawn.WorkerContext``: rank,
    world_size, device...). ``group=False``: ``fn(**kwargs)`` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT set, as under torchrun: ``fn`` calls ``init_process_group`` and ``destroy_process_group``.
    Errors as ``spawn.launch``: ``WorkerError`` with the rank's traceback (the notebook's own line numbers),
    ``WorkerTimeout``; ``ShipError`` when ``fn`` cannot be sent."""
    from lab_utils.distributed.spawn import launch  # lazy: pulls torch (only when ranks are started)

    with shipping(fn) as shipped:
        return launch(call_shipped, nprocs, backend=backend, timeout_s=timeout_s, env=env, group=group,
                      kwargs={"shipped": shipped, "kwargs": dict(kwargs or {}), "group": group})


# --- Reading a rank's stack (faulthandler's format: innermost call first) -------------------------

_FH_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    function: str


def stack_frames(text: str) -> list[Frame]:
    """The frames of a stack ``faulthandler`` wrote, innermost first, every thread's in turn (main last)."""
    return [Frame(m["file"], int(m["line"]), m["func"]) for m in map(_FH_LINE.match, text.splitlines()) if m]


def code_at(filename: str, lineno: int) -> str:
    """The stripped text of line ``lineno`` of ``filename`` ("" when unreadable)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        lines = Path(filename).read_text().splitlines()
        if 1 <= lineno <= len(lines):
            return lines[lineno - 1].strip()
    return ""
