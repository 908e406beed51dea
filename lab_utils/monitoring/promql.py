"""A small PromQL evaluator over samples held in memory: the in-process scraper's query engine, and the
deterministic checker of the lab's PromQL exercises (against recorded samples).

It covers what the lab, its rules and its dashboard use, with Prometheus 2.x semantics: selectors with
``= != =~ !~`` matchers, range selectors and ``offset``; ``rate``, ``irate``, ``increase``, ``delta``
(extrapolated as Prometheus does) and the ``*_over_time`` family; ``sum avg min max count`` with
``by``/``without``; arithmetic, comparison (with ``bool``) and set operators with ``on``/``ignoring`` and
``group_left``/``group_right``; ``abs clamp_min clamp_max round ceil floor sqrt exp ln scalar vector time
absent``. Anything else raises :class:`PromQLError` naming the expression and where it stopped, so a
student's unsupported query says so instead of giving a wrong number.

Results use the shape of Prometheus' HTTP API (``{"resultType": ..., "result": [...]}``), so the same
code turns either into a data frame.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

LOOKBACK_S = 300.0  # Prometheus' default --query.lookback-delta (5m)
STALE = float("nan")  # stored with a flag: a stale marker ends a series (target down, series gone)

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, __name__ included


class PromQLError(ValueError):
    """The expression cannot be parsed or evaluated here; the message names the expression."""


# --- storage --------------------------------------------------------------------------------------


@dataclass
class Series:
    labels: Labels
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    stale: list[bool] = field(default_factory=list)


class SampleStore:
    """Time series in memory: ``add(labels, t, value)``; staleness markers as Prometheus writes them."""

    def __init__(self) -> None:
        self.series: dict[Labels, Series] = {}

    @staticmethod
    def key(labels: Mapping[str, str]) -> Labels:
        return tuple(sorted((str(k), str(v)) for k, v in labels.items()))

    def add(self, labels: Mapping[str, str] | Labels, t: float, value: float, *, stale: bool = False) -> None:
        key = labels if isinstance(labels, tuple) else self.key(labels)
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = Series(key)
        if s.times and t < s.times[-1]:
            raise ValueError(f"samples must arrive in time order: {dict(key)} at {t} after {s.times[-1]}")
        s.times.append(float(t))
        s.values.append(float(value))
        s.stale.append(stale)

    def mark_stale(self, key: Labels, t: float) -> None:
        """End a series at ``t`` (its target failed or it vanished from the scrape)."""
        s = self.series.get(key)
        if s is not None and s.times and not s.stale[-1]:
            self.add(key, t, STALE, stale=True)

    def last_time(self) -> float | None:
        ends = [s.times[-1] for s in self.series.values() if s.times]
        return max(ends) if ends else None


# --- lexer ----------------------------------------------------------------------------------------

_DUR = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
_DUR_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}
_TOKEN = re.compile(
    r"""\s*(?:
    (?P<num>(?:0[xX][0-9a-fA-F]+)|(?:\d+\.?\d*(?:[eE][+-]?\d+)?)|(?:\.\d+(?:[eE][+-]?\d+)?)|(?i:inf|nan)(?![\w:]))
   |(?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
   |(?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){}\[\],:])
   |(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)
    )""",
    re.X,
)


def parse_duration(text: str) -> float:
    """"5m" -> 300.0 seconds; "1m30s" and "500ms" too."""
    pos, total = 0, 0.0
    for m in _DUR.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DUR_S[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise PromQLError(f"bad duration {text!r}: use e.g. 30s, 5m, 1h")
    return total


@dataclass
class _Tok:
    kind: str  # num, str, op, id, dur, end
    text: str
    pos: int


def _lex(expr: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pos = 0
    while pos < len(expr):
        if expr[pos].isspace():
            pos += 1
            continue
        if expr[pos] == "#":  # comment to end of line
            nl = expr.find("\n", pos)
            pos = len(expr) if nl < 0 else nl
            continue
        # a duration inside [...] or after offset: digits followed by a unit
        if toks and (toks[-1].text in ("[", ":") or toks[-1].text == "offset"):
            m = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d|w|y))+").match(expr, pos)
            if m:
                toks.append(_Tok("dur", m.group(0), pos))
                pos = m.end()
                continue
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise PromQLError(f"unexpected character {expr[pos]!r} at position {pos} in {expr!r}")
        kind = m.lastgroup or "op"
        text = m.group(kind)
        toks.append(_Tok(kind, text, m.start(kind)))
        pos = m.end()
    toks.append(_Tok("end", "", len(expr)))
    return toks


# --- AST ------------------------------------------------------------------------------------------


@dataclass
class Num:
    value: float


@dataclass
class Str:
    value: str


@dataclass
class Selector:
    name: str | None
    matchers: list[tuple[str, str, str]]  # (label, op, value)
    range_s: float | None = None
    offset_s: float = 0.0


@dataclass
class Call:
    fn: str
    args: list[Any]


@dataclass
class Agg:
    op: str
    expr: Any
    by: list[str] | None = None
    without: list[str] | None = None
    param: Any = None


@dataclass
class Binary:
    op: str
    lhs: Any
    rhs: Any
    bool_: bool = False
    on: list[str] | None = None
    ignoring: list[str] | None = None
    group: str | None = None  # "left" / "right"
    include: list[str] = field(default_factory=list)


@dataclass
class Neg:
    expr: Any


_AGGS = {"sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "group"}
_RANGE_FNS = {"rate", "irate", "increase", "delta", "idelta", "avg_over_time", "min_over_time", "max_over_time",
              "sum_over_time", "count_over_time", "last_over_time", "stddev_over_time", "quantile_over_time"}
_FNS = _RANGE_FNS | {"abs", "ceil", "floor", "round", "sqrt", "exp", "ln", "log2", "log10", "clamp_min",
                     "clamp_max", "clamp", "scalar", "vector", "time", "absent", "timestamp", "sgn"}
# precedence, lowest first; ^ is right-associative
_PREC = [("or",), ("and", "unless"), ("==", "!=", ">", "<", ">=", "<="), ("+", "-"), ("*", "/", "%", "atan2"),
         ("^",)]
_COMPARE = {"==", "!=", ">", "<", ">=", "<="}
_SET = {"and", "or", "unless"}


class _Parser:
    def __init__(self, expr: str):
        self.expr = expr
        self.toks = _lex(expr)
        self.i = 0

    def err(self, what: str) -> PromQLError:
        tok = self.toks[self.i]
        where = f"at position {tok.pos}" + (f" ({tok.text!r})" if tok.text else " (end of expression)")
        return PromQLError(f"{what} {where} in {self.expr!r}")

    def peek(self, k: int = 0) -> _Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def take(self, text: str | None = None, kind: str | None = None) -> _Tok:
        tok = self.peek()
        if (text is not None and tok.text.lower() != text) or (kind is not None and tok.kind != kind):
            raise self.err(f"expected {text or kind}")
        self.i += 1
        return tok

    def accept(self, text: str) -> bool:
        if self.peek().text.lower() == text and self.peek().kind in ("op", "id"):
            self.i += 1
            return True
        return False

    def parse(self) -> Any:
        node = self.binary(0)
        if self.peek().kind != "end":
            raise self.err("unexpected token")
        return node

    def binary(self, level: int) -> Any:
        if level == len(_PREC):
            return self.unary()
        lhs = self.binary(level + 1)
        while self.peek().text.lower() in _PREC[level] and self.peek().kind in ("op", "id"):
            op = self.take().text.lower()
            node = Binary(op, lhs, None)
            if self.accept("bool"):
                if op not in _COMPARE:
                    raise self.err("bool is only allowed after a comparison")
                node.bool_ = True
            for kw in ("on", "ignoring"):
                if self.accept(kw):
                    setattr(node, kw, self.label_list())
            for side in ("group_left", "group_right"):
                if self.accept(side):
                    node.group = side.split("_")[1]
                    node.include = self.label_list() if self.peek().text == "(" else []
            # ^ binds right: parse the right side at the same level
            node.rhs = self.binary(level if op == "^" else level + 1)
            lhs = node
            if op == "^":
                break
        return lhs

    def unary(self) -> Any:
        if self.peek().text in ("-", "+") and self.peek().kind == "op":
            sign = self.take().text
            inner = self.unary()
            return Neg(inner) if sign == "-" else inner
        return self.postfix(self.primary())

    def postfix(self, node: Any) -> Any:
        while True:
            if self.peek().text == "[":
                if not isinstance(node, Selector) or node.range_s is not None:
                    raise self.err("a range [..] applies to a plain selector here (subqueries are not supported)")
                self.take("[")
                dur = self.take(kind="dur").text
                if self.peek().text == ":":
                    raise self.err("subqueries are not supported by the in-process evaluator")
                self.take("]")
                node.range_s = parse_duration(dur)
            elif self.peek().text.lower() == "offset" and self.peek().kind == "id":
                if not isinstance(node, Selector):
                    raise self.err("offset applies to a selector")
                self.take()
                node.offset_s = parse_duration(self.take(kind="dur").text)
            else:
                return node

    def label_list(self) -> list[str]:
        self.take("(")
        names: list[str] = []
        while self.peek().text != ")":
            names.append(self.take(kind="id").text)
            if not self.accept(","):
                break
        self.take(")")
        return names

    def primary(self) -> Any:
        tok = self.peek()
        if tok.kind == "num":
            self.i += 1
            return Num(float(int(tok.text, 16)) if tok.text.lower().startswith("0x") else float(tok.text))
        if tok.kind == "str":
            self.i += 1
            return Str(_unquote(tok.text))
        if tok.text == "(":
            self.take("(")
            inner = self.binary(0)
            self.take(")")
            return inner
        if tok.text == "{":
            return self.selector(None)
        if tok.kind == "id":
            name = tok.text
            low = name.lower()
            nxt = self.peek(1).text.lower()
            if low in _AGGS and nxt in ("(", "by", "without"):
                return self.aggregation(low)
            if nxt == "(":
                if low not in _FNS:
                    raise self.err(f"function {name}() is not supported here (supported: {', '.join(sorted(_FNS))})")
                self.i += 1
                self.take("(")
                args: list[Any] = []
                while self.peek().text != ")":
                    args.append(self.binary(0))
                    if not self.accept(","):
                        break
                self.take(")")
                return Call(low, args)
            self.i += 1
            return self.selector(name)
        raise self.err("expected a number, a selector, a function or '('")

    def selector(self, name: str | None) -> Selector:
        matchers: list[tuple[str, str, str]] = []
        if self.peek().text == "{":
            self.take("{")
            while self.peek().text != "}":
                label = self.take(kind="id").text
                op = self.take().text
                if op not in ("=", "!=", "=~", "!~"):
                    raise self.err(f"bad label matcher operator {op!r}")
                matchers.append((label, op, _unquote(self.take(kind="str").text)))
                if not self.accept(","):
                    break
            self.take("}")
        if name is None:
            name = next((v for k, op, v in matchers if k == "__name__" and op == "="), None)
            if not matchers:
                raise self.err("a selector needs a metric name or a label matcher")
        return Selector(name, matchers)

    def aggregation(self, op: str) -> Agg:
        self.i += 1
        node = Agg(op, None)
        if self.peek().text.lower() in ("by", "without"):
            setattr(node, self.take().text.lower(), self.label_list())
        self.take("(")
        first = self.binary(0)
        if self.accept(","):
            node.param, node.expr = first, self.binary(0)
        else:
            node.expr = first
        self.take(")")
        if self.peek().text.lower() in ("by", "without") and node.by is None and node.without is None:
            setattr(node, self.take().text.lower(), self.label_list())
        if op in ("topk", "bottomk", "quantile") and node.param is None:
            raise self.err(f"{op} needs a parameter")
        return node


def _unquote(text: str) -> str:
    body = text[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


def parse(expr: str) -> Any:
    """The syntax tree of ``expr``; :class:`PromQLError` names the position of a problem."""
    if not isinstance(expr, str) or not expr.strip():
        raise PromQLError(f"empty PromQL expression: {expr!r}")
    return _Parser(expr).parse()


# --- evaluation -----------------------------------------------------------------------------------

# Instant vector: list of (labels dict, value). Range vector: list of (labels dict, times, values).


@dataclass
class _Vec:
    items: list[tuple[dict[str, str], float]]


@dataclass
class _Range:
    items: list[tuple[dict[str, str], list[float], list[float]]]


def _match(labels: Labels, matchers: list[tuple[str, str, str]], name: str | None) -> bool:
    d = dict(labels)
    if name is not None and d.get("__name__") != name:
        return False
    for label, op, value in matchers:
        got = d.get(label, "")
        if op == "=" and got != value:
            return False
        if op == "!=" and got == value:
            return False
        if op == "=~" and not re.fullmatch(value, got):
            return False
        if op == "!~" and re.fullmatch(value, got):
            return False
    return True


def _drop_name(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k != "__name__"}


def _sig(labels: dict[str, str], on: list[str] | None, ignoring: list[str] | None) -> tuple[tuple[str, str], ...]:
    if on is not None:
        return tuple(sorted((k, v) for k, v in labels.items() if k in on))
    skip = set(ignoring or ()) | {"__name__"}
    return tuple(sorted((k, v) for k, v in labels.items() if k not in skip))


def _arith(op: str, a: float, b: float) -> float:
    try:
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            if b == 0:
                return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1, b)
            return a / b
        if op == "%":
            return math.fmod(a, b) if b != 0 else math.nan
        if op == "^":
            return a**b
        if op == "atan2":
            return math.atan2(a, b)
    except (OverflowError, ValueError):
        return math.nan
    raise PromQLError(f"unknown operator {op}")


def _compare(op: str, a: float, b: float) -> bool:
    return {"==": a == b, "!=": a != b, ">": a > b, "<": a < b, ">=": a >= b, "<=": a <= b}[op]


class Evaluator:
    """Evaluates parsed PromQL at a time against a :class:`SampleStore`."""

    def __init__(self, store: SampleStore, expr: str, lookback_s: float = LOOKBACK_S):
        self.store, self.expr, self.lookback_s = store, expr, lookback_s

    def fail(self, what: str) -> PromQLError:
        return PromQLError(f"{what} in {self.expr!r}")

    def eval(self, node: Any, t: float) -> Any:
        if isinstance(node, Num):
            return node.value
        if isinstance(node, Str):
            return node.value
        if isinstance(node, Selector):
            return self.select_range(node, t) if node.range_s is not None else self.select(node, t)
        if isinstance(node, Neg):
            v = self.eval(node.expr, t)
            if isinstance(v, float):
                return -v
            if isinstance(v, _Vec):
                return _Vec([(_drop_name(lab), -x) for lab, x in v.items])
            raise self.fail("unary minus needs a number or an instant vector")
        if isinstance(node, Call):
            return self.call(node, t)
        if isinstance(node, Agg):
            return self.aggregate(node, t)
        if isinstance(node, Binary):
            return self.binary(node, t)
        raise self.fail(f"cannot evaluate {type(node).__name__}")

    def select(self, sel: Selector, t: float) -> _Vec:
        at = t - sel.offset_s
        out = []
        for key, s in self.store.series.items():
            if not _match(key, sel.matchers, sel.name):
                continue
            i = bisect.bisect_right(s.times, at) - 1
            if i < 0 or s.stale[i] or s.times[i] <= at - self.lookback_s:
                continue
            out.append((dict(key), s.values[i]))
        return _Vec(out)

    def select_range(self, sel: Selector, t: float) -> _Range:
        end = t - sel.offset_s
        start = end - float(sel.range_s or 0)
        out = []
        for key, s in self.store.series.items():
            if not _match(key, sel.matchers, sel.name):
                continue
            lo, hi = bisect.bisect_left(s.times, start), bisect.bisect_right(s.times, end)
            ts = [s.times[i] for i in range(lo, hi) if not s.stale[i]]
            vs = [s.values[i] for i in range(lo, hi) if not s.stale[i]]
            if ts:
                out.append((dict(key), ts, vs))
        return _Range(out)

    # functions
    def call(self, node: Call, t: float) -> Any:
        fn, args = node.fn, node.args
        if fn == "time":
            return float(t)
        if fn in _RANGE_FNS:
            want = 2 if fn == "quantile_over_time" else 1
            if len(args) != want:
                raise self.fail(f"{fn}() takes {want} argument(s)")
            rng = self.eval(args[-1], t)
            if not isinstance(rng, _Range):
                raise self.fail(f"{fn}() needs a range vector such as metric[1m]")
            sel = args[-1]
            q = self.eval(args[0], t) if want == 2 else None
            out = []
            for labels, ts, vs in rng.items:
                v = self._range_fn(fn, ts, vs, t - sel.offset_s - sel.range_s, t - sel.offset_s, sel.range_s, q)
                if v is not None:
                    keep = fn in ("last_over_time",)
                    out.append((labels if keep else _drop_name(labels), v))
            return _Vec(out)
        if fn == "vector":
            v = self.eval(args[0], t)
            if not isinstance(v, float):
                raise self.fail("vector() needs a number")
            return _Vec([({}, v)])
        if fn == "scalar":
            v = self.eval(args[0], t)
            if not isinstance(v, _Vec):
                raise self.fail("scalar() needs an instant vector")
            return v.items[0][1] if len(v.items) == 1 else math.nan
        if fn == "absent":
            v = self.eval(args[0], t)
            if not isinstance(v, _Vec):
                raise self.fail("absent() needs an instant vector")
            if v.items:
                return _Vec([])
            sel = args[0]
            labels = {k: val for k, op, val in getattr(sel, "matchers", []) if op == "=" and k != "__name__"}
            return _Vec([(labels, 1.0)])
        if fn == "timestamp":
            raise self.fail("timestamp() is not supported by the in-process evaluator")
        if not args:
            raise self.fail(f"{fn}() needs an argument")
        vec = self.eval(args[0], t)
        if not isinstance(vec, _Vec):
            raise self.fail(f"{fn}() needs an instant vector")
        extra = [self.eval(a, t) for a in args[1:]]
        if any(not isinstance(x, float) for x in extra):
            raise self.fail(f"{fn}()'s extra arguments must be numbers")

        def f(x: float) -> float:
            if fn == "abs":
                return abs(x)
            if fn == "ceil":
                return float(math.ceil(x)) if math.isfinite(x) else x
            if fn == "floor":
                return float(math.floor(x)) if math.isfinite(x) else x
            if fn == "round":
                inverse = 1.0 / (extra[0] if extra else 1.0)  # as Prometheus computes it, bit for bit
                return math.floor(x * inverse + 0.5) / inverse if math.isfinite(x) else x
            if fn == "sqrt":
                return math.sqrt(x) if x >= 0 else math.nan
            if fn == "exp":
                return math.exp(x)
            if fn in ("ln", "log2", "log10"):
                if x <= 0:
                    return -math.inf if x == 0 else math.nan
                return {"ln": math.log, "log2": math.log2, "log10": math.log10}[fn](x)
            if fn == "sgn":
                return float((x > 0) - (x < 0))
            if fn == "clamp_min":
                return max(x, extra[0])
            if fn == "clamp_max":
                return min(x, extra[0])
            if fn == "clamp":
                return min(max(x, extra[0]), extra[1])
            raise self.fail(f"{fn}() is not supported")

        return _Vec([(_drop_name(lab), f(x)) for lab, x in vec.items])

    @staticmethod
    def _range_fn(fn: str, ts: list[float], vs: list[float], start: float, end: float, range_s: float,
                  q: Any) -> float | None:
        if fn in ("rate", "increase", "delta"):
            return _extrapolated(ts, vs, start, end, counter=fn != "delta", is_rate=fn == "rate")
        if fn in ("irate", "idelta"):
            if len(vs) < 2:
                return None
            d = vs[-1] - vs[-2]
            if fn == "irate":
                if vs[-1] < vs[-2]:
                    d = vs[-1]  # counter reset
                dt = ts[-1] - ts[-2]
                return d / dt if dt > 0 else None
            return d
        if fn == "avg_over_time":
            return sum(vs) / len(vs)
        if fn == "min_over_time":
            return min(vs)
        if fn == "max_over_time":
            return max(vs)
        if fn == "sum_over_time":
            return sum(vs)
        if fn == "count_over_time":
            return float(len(vs))
        if fn == "last_over_time":
            return vs[-1]
        if fn == "stddev_over_time":
            m = sum(vs) / len(vs)
            return math.sqrt(sum((v - m) ** 2 for v in vs) / len(vs))
        if fn == "quantile_over_time":
            return _quantile(float(q), vs)
        return None

    def aggregate(self, node: Agg, t: float) -> _Vec:
        vec = self.eval(node.expr, t)
        if not isinstance(vec, _Vec):
            raise self.fail(f"{node.op}() needs an instant vector (use a *_over_time function for a range)")
        param = self.eval(node.param, t) if node.param is not None else None
        groups: dict[tuple[tuple[str, str], ...], list[tuple[dict[str, str], float]]] = {}
        for labels, v in vec.items:
            if node.by is not None:
                g = {k: val for k, val in labels.items() if k in node.by}
            elif node.without is not None:
                g = {k: val for k, val in labels.items() if k not in node.without and k != "__name__"}
            else:
                g = {}
            groups.setdefault(tuple(sorted(g.items())), []).append((labels, v))
        out: list[tuple[dict[str, str], float]] = []
        for gkey, members in groups.items():
            vals = [v for _, v in members]
            if node.op in ("topk", "bottomk"):
                k = int(param or 0)
                ordered = sorted(members, key=lambda m: m[1], reverse=node.op == "topk")
                out.extend((lab, v) for lab, v in ordered[:k])
                continue
            if node.op == "sum":
                r = sum(vals)
            elif node.op == "avg":
                r = sum(vals) / len(vals)
            elif node.op == "min":
                r = min((v for v in vals if not math.isnan(v)), default=math.nan)
            elif node.op == "max":
                r = max((v for v in vals if not math.isnan(v)), default=math.nan)
            elif node.op == "count":
                r = float(len(vals))
            elif node.op == "group":
                r = 1.0
            elif node.op in ("stddev", "stdvar"):
                m = sum(vals) / len(vals)
                var = sum((v - m) ** 2 for v in vals) / len(vals)
                r = math.sqrt(var) if node.op == "stddev" else var
            elif node.op == "quantile":
                r = _quantile(float(param), vals)  # type: ignore[arg-type]
            else:
                raise self.fail(f"aggregation {node.op} is not supported")
            out.append((dict(gkey), r))
        return _Vec(out)

    def binary(self, node: Binary, t: float) -> Any:
        lhs, rhs = self.eval(node.lhs, t), self.eval(node.rhs, t)
        op = node.op
        if isinstance(lhs, _Range) or isinstance(rhs, _Range):
            raise self.fail(f"operator {op} needs instant vectors or numbers, not a range vector (wrap it in rate())")
        if isinstance(lhs, str) or isinstance(rhs, str):
            raise self.fail(f"operator {op} cannot take a string")
        if op in _SET:
            if not (isinstance(lhs, _Vec) and isinstance(rhs, _Vec)):
                raise self.fail(f"set operator {op} needs instant vectors on both sides")
            rsigs = {_sig(lab, node.on, node.ignoring) for lab, _ in rhs.items}
            if op == "and":
                return _Vec([(lab, v) for lab, v in lhs.items if _sig(lab, node.on, node.ignoring) in rsigs])
            if op == "unless":
                return _Vec([(lab, v) for lab, v in lhs.items if _sig(lab, node.on, node.ignoring) not in rsigs])
            lsigs = {_sig(lab, node.on, node.ignoring) for lab, _ in lhs.items}
            return _Vec(lhs.items + [(lab, v) for lab, v in rhs.items
                                     if _sig(lab, node.on, node.ignoring) not in lsigs])
        is_cmp = op in _COMPARE
        if isinstance(lhs, float) and isinstance(rhs, float):
            if is_cmp:
                if not node.bool_:
                    raise self.fail("a comparison between two numbers needs bool")
                return float(_compare(op, lhs, rhs))
            return _arith(op, lhs, rhs)
        if isinstance(lhs, _Vec) and isinstance(rhs, float) or isinstance(lhs, float) and isinstance(rhs, _Vec):
            vec, scalar_left = (lhs, False) if isinstance(lhs, _Vec) else (rhs, True)
            out = []
            for lab, v in vec.items:  # type: ignore[union-attr]
                a, b = (lhs, v) if scalar_left else (v, rhs)
                if is_cmp:
                    ok = _compare(op, a, b)  # type: ignore[arg-type]
                    if node.bool_:
                        out.append((_drop_name(lab), float(ok)))
                    elif ok:
                        out.append((lab, v))
                else:
                    out.append((_drop_name(lab), _arith(op, a, b)))  # type: ignore[arg-type]
            return _Vec(out)
        # vector op vector
        assert isinstance(lhs, _Vec) and isinstance(rhs, _Vec)
        one, many = (rhs, lhs) if node.group != "right" else (lhs, rhs)
        index: dict[Any, tuple[dict[str, str], float]] = {}
        for lab, v in one.items:
            s = _sig(lab, node.on, node.ignoring)
            if s in index:
                side = "right" if node.group != "right" else "left"
                raise self.fail(f"many-to-many matching: several series on the {side} side share labels {dict(s)}; "
                                "aggregate them (e.g. sum by (...)) or match with on(...)")
            index[s] = (lab, v)
        seen: set[Any] = set()
        out = []
        for lab, v in many.items:
            s = _sig(lab, node.on, node.ignoring)
            if s not in index:
                continue
            if node.group is None:
                if s in seen:
                    raise self.fail(f"many-to-many matching: several series on the left side share labels {dict(s)}; "
                                    "use group_left or aggregate first")
                seen.add(s)
            olab, ov = index[s]
            a, b = (v, ov) if node.group != "right" else (ov, v)
            if node.group is None:
                base = lab if is_cmp and not node.bool_ else _drop_name(lab)
                if node.on is not None and not (is_cmp and not node.bool_):
                    base = {k: val for k, val in base.items() if k in node.on}
                elif node.ignoring is not None and not (is_cmp and not node.bool_):
                    base = {k: val for k, val in base.items() if k not in node.ignoring}
            else:
                base = dict(lab) if is_cmp and not node.bool_ else _drop_name(lab)
                for k in node.include:
                    if k in olab:
                        base[k] = olab[k]
            if is_cmp:
                ok = _compare(op, a, b)
                if node.bool_:
                    out.append((base, float(ok)))
                elif ok:
                    out.append((base, v if node.group != "right" else ov))
            else:
                out.append((base, _arith(op, a, b)))
        return _Vec(out)


def _quantile(q: float, vals: list[float]) -> float:
    if not vals:
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    s = sorted(vals)
    rank = q * (len(s) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def _extrapolated(ts: list[float], vs: list[float], start: float, end: float, *, counter: bool,
                  is_rate: bool) -> float | None:
    """Prometheus' extrapolatedRate (promql/functions.go, 2.x): the first-to-last increase with counter
    resets added back, extrapolated to the window's edges when the samples come close enough to them."""
    if len(vs) < 2:
        return None
    result = vs[-1] - vs[0]
    if counter:
        prev = vs[0]
        for v in vs[1:]:
            if v < prev:
                result += prev
            prev = v
    to_start, to_end = ts[0] - start, end - ts[-1]
    sampled = ts[-1] - ts[0]
    avg_step = sampled / (len(vs) - 1)
    if counter and result > 0 and vs[0] >= 0:
        to_zero = sampled * (vs[0] / result)
        to_start = min(to_start, to_zero)
    threshold = avg_step * 1.1
    interval = sampled
    interval += to_start if to_start < threshold else avg_step / 2
    interval += to_end if to_end < threshold else avg_step / 2
    result *= interval / sampled
    if is_rate:
        result /= end - start
    return result


# --- public entry points -------------------------------------------------------------------------


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v)) if abs(v) < 1e15 else repr(float(v))


def instant(store: SampleStore, expr: str, t: float) -> dict[str, Any]:
    """``expr`` at time ``t`` (unix seconds), shaped like Prometheus' ``/api/v1/query`` ``data``."""
    tree = parse(expr)
    out = Evaluator(store, expr).eval(tree, t)
    if isinstance(out, float):
        return {"resultType": "scalar", "result": [t, _fmt(out)]}
    if isinstance(out, str):
        return {"resultType": "string", "result": [t, out]}
    if isinstance(out, _Range):
        rows = [{"metric": lab, "values": [[x, _fmt(y)] for x, y in zip(ts, vs, strict=True)]}
                for lab, ts, vs in out.items]
        return {"resultType": "matrix", "result": rows}
    _check_unique(out, expr)
    return {"resultType": "vector", "result": [{"metric": lab, "value": [t, _fmt(v)]} for lab, v in out.items]}


def range_query(store: SampleStore, expr: str, start: float, end: float, step: float) -> dict[str, Any]:
    """``expr`` at ``start, start+step, ... <= end``, shaped like ``/api/v1/query_range`` ``data``."""
    if step <= 0:
        raise PromQLError(f"step must be > 0 seconds, got {step} for {expr!r}")
    tree = parse(expr)
    ev = Evaluator(store, expr)
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    n = int(math.floor((end - start) / step + 1e-9)) + 1
    for i in range(max(n, 0)):
        t = start + i * step
        out = ev.eval(tree, t)
        if isinstance(out, float):
            out = _Vec([({}, out)])
        if isinstance(out, _Range):
            raise PromQLError(f"a range query needs an instant vector or a number, not a range vector: {expr!r}")
        _check_unique(out, expr)
        for lab, v in out.items:
            key = tuple(sorted(lab.items()))
            series.setdefault(key, {"metric": lab, "values": []})["values"].append([t, _fmt(v)])
    return {"resultType": "matrix", "result": list(series.values())}


def _check_unique(vec: _Vec, expr: str) -> None:
    seen = set()
    for lab, _ in vec.items:
        key = tuple(sorted(lab.items()))
        if key in seen:
            raise PromQLError(f"vector cannot contain metrics with the same labelset {dict(key)} in {expr!r}")
        seen.add(key)


def store_from_samples(rows: Iterable[tuple[Mapping[str, str], float, float]]) -> SampleStore:
    """A store from ``(labels, t, value)`` rows (``__name__`` in labels), e.g. recorded lab samples."""
    store = SampleStore()
    for labels, t, v in sorted(rows, key=lambda r: r[1]):
        store.add(labels, t, v)
    return store
