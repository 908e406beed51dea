"""The question bank of lab 09's review: ``Question`` (one question, graded in either language through the exercise
framework) and ``load_bank``, which reads and validates the YAML bank (``lab_utils/data/quiz/``; ``NVLAB_QUIZ_DIR``
points at another). Importing it reads no file.

Design notes: docs/internals.md#lab_utilsexercisesquizpy
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from lab_utils import DATA_DIR
from lab_utils.exercises.framework import Exercise, Wrong, match_slip, normal_text, number
from lab_utils.exercises.quiz_text import LANGUAGES, _lang, _tr
from lab_utils.procs import EnvError

BANK_DIR = DATA_DIR / "quiz"
QUIZ_ENV = "NVLAB_QUIZ_DIR"  # another bank folder (a trainer's own; the tests' fixture)
FORMS = ("single", "multi", "numeric", "match", "order")


class BankError(ValueError):
    """The bank cannot be used; the message names the file and, where there is one, the question id."""


# --- questions -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    """One question of the bank; ``exercise(language)`` grades answers to it."""

    id: str
    section: int
    form: str
    prompt: Mapping[str, str]
    answer: Any
    explanation: Mapping[str, str]
    choices: Mapping[str, Any] | None = None
    rows: tuple[str, ...] = ()
    lab: Mapping[str, Any] | None = None
    terms: tuple[Mapping[str, str], ...] = ()
    row_text: tuple[Mapping[str, str], ...] = ()  # the rows' {en, zh} from rows.yaml, where the bank has it

    # -- text -----------------------------------------------------------------------------------------------

    def _keys(self, side: str | None = None) -> list[str]:
        if self.choices is None:
            return []
        return list((self.choices[side] if side else self.choices).keys())

    def _choice_text(self, key: str, language: str, side: str | None = None) -> str:
        block = self.choices[side] if side else self.choices  # type: ignore[index]
        return block[key][language]

    def text(self, language: str = "en", number_: int | None = None) -> str:
        """The question as the student sees it: prompt, choices, and how to answer."""
        lang = _lang(language)
        head = f"[{self.id}] " if number_ is None else f"Q{number_} [{self.id}] "
        lines = [head + self.prompt[lang]]
        if self.form in ("single", "multi", "order"):
            lines += [f"   {k}) {self._choice_text(k, lang)}" for k in self._keys()]
        elif self.form == "match":
            lines += [f"   {k}) {self._choice_text(k, lang, 'left')}" for k in self._keys("left")]
            lines += ["   --"]
            lines += [f"   {k}) {self._choice_text(k, lang, 'right')}" for k in self._keys("right")]
        elif self.form == "numeric":
            unit = self.answer["unit"][lang]
            if unit:
                lines += [f"   ({_tr('in', lang)}: {unit})"]
        lines.append(f"   -> {_tr(self.form, lang)}")
        return "\n".join(lines)

    def key(self) -> Any:
        """The right answer, in the form ``check`` accepts (a copy: changing it changes nothing here)."""
        if self.form in ("multi", "order"):
            return list(self.answer)
        if self.form in ("match", "numeric"):
            return dict(self.answer) if self.form == "match" else self.answer["value"]
        return self.answer

    def reordered(self, order: Sequence[str] | None = None, left: Sequence[str] | None = None,
                  right: Sequence[str] | None = None) -> Question:
        """This question with its choices shown in ``order`` (bank keys; ``left``/``right`` for a match).

        Keys that only name a place (``a, b, c …`` or ``1, 2, 3 …``) are given out again in the new order, and the
        answer follows its choice: a student answering by letter is graded against the letters shown."""
        if self.choices is None:
            return self
        if self.form == "match":
            lblock, lmap = _arrange(self.choices["left"], left)
            rblock, rmap = _arrange(self.choices["right"], right)
            return replace(self, choices={"left": lblock, "right": rblock},
                           answer={lmap[a]: rmap[b] for a, b in self.answer.items()})
        block, rename = _arrange(self.choices, order)
        if self.form == "single":
            answer: Any = rename[self.answer]
        elif self.form == "multi":  # in the order shown
            answer = [rename[k] for k in rename if k in self.answer]
        else:
            answer = [rename[k] for k in self.answer]
        return replace(self, choices=block, answer=answer)

    def answer_text(self, language: str = "en") -> str:
        """The right answer written out (keys and their text)."""
        lang = _lang(language)
        if self.form == "single":
            return f"{self.answer}) {self._choice_text(self.answer, lang)}"
        if self.form == "multi":
            return "; ".join(f"{k}) {self._choice_text(k, lang)}" for k in self.answer)
        if self.form == "order":
            return " → ".join(f"{k}) {self._choice_text(k, lang)}" for k in self.answer)
        if self.form == "match":
            return "; ".join(f"{self._choice_text(a, lang, 'left')} ↔ {self._choice_text(b, lang, 'right')}"
                             for a, b in self.answer.items())
        unit = self.answer["unit"][lang]
        return f"{self.answer['value']:g} {unit}".strip()

    def lab_text(self, language: str = "en") -> str:
        """Where the course measured this (``"lab 00: Exercise 1 (note)"``), or ``""``."""
        if not self.lab:
            return ""
        lang = _lang(language)
        where = (self.lab.get("where") or {}).get(lang, "")
        note = (self.lab.get("note") or {}).get(lang, "")
        text = f"{_tr('lab', lang)} {self.lab['lab']}" + (f": {where}" if where else "")
        return text + (f" ({note})" if note else "")

    # -- grading ----------------------------------------------------------------------------------------------

    def grade(self, value: Any, language: str = "en", explain: bool = True, name_keys: bool = True) -> None:
        """Return when ``value`` is right; raise ``Wrong`` saying why when not (then, with ``explain``, the
        explanation). Without ``name_keys`` a multiple choice says how many keys are missing or extra, not which."""
        lang = _lang(language)
        try:
            if self.form == "multi":  # which keys are missing would be the key itself
                _grade_multi(self, value, lang, name_keys=name_keys)
            else:
                _GRADERS[self.form](self, value, lang)
        except Wrong as why:
            raise Wrong(f"{why} {_tr('why', lang)}: {self.explanation[lang]}" if explain else str(why)) from None

    def exercise(self, language: str = "en", var: str = "answer", hint_call: str = "") -> Exercise:
        """This question as a framework ``Exercise``: ``.check(answer)`` prints and returns the ``Outcome``.

        A first wrong answer is told what is wrong and asked to try again (``hint_call``, e.g. ``runner.hint('id')``,
        named for a hint); from the second on, the answer and its explanation come with it: the key is not given
        away by one guess."""
        lang = _lang(language)
        hint_call = hint_call or "hint()"
        wrong = [0]  # wrong answers so far

        def grade(value: Any) -> None:
            try:
                self.grade(value, lang, explain=False, name_keys=wrong[0] > 0)
            except Wrong as why:
                wrong[0] += 1
                if wrong[0] < 2:
                    raise Wrong(f"{why} {_tr('retry', lang).format(hint=f'`{hint_call}`')}") from None
                raise Wrong(f"{why} {_tr('answer', lang)}: {self.answer_text(lang)}. {_tr('why', lang)}: "
                            f"{self.explanation[lang]}") from None

        hints = []
        if self.rows:
            rows = [t.get(lang) or r for r, t in zip(self.rows, self.row_text, strict=True)] if self.row_text \
                else list(self.rows)
            hints.append(f"{_tr('rows', lang)}: {'; '.join(rows)}. ({_tr(self.form, lang)})")
        if self.lab:
            hints.append(self.lab_text(lang))
        hints = hints or [_tr(self.form, lang)]
        return Exercise(
            name=f"09 quiz {self.id}",
            var=var,
            grade=grade,
            hints=hints,
            hint_call=hint_call,
            help_texts={key: _tr(key, lang) for key in ("no_more_hints", "solution_first")},
            solution_text=f"{_tr('answer', lang)}: {self.answer_text(lang)}\n{_tr('why', lang)}: "
                          f"{self.explanation[lang]}",
        )


def _places(keys: Sequence[str]) -> list[str] | None:
    """``keys`` in their place order when they only name a place (a permutation of ``a, b, c …`` or ``1, 2, 3 …``),
    else ``None`` (keys that are words keep their names when the choices move)."""
    n = len(keys)
    for labels in ([chr(ord("a") + i) for i in range(n)], [str(i + 1) for i in range(n)]):
        if sorted(keys) == sorted(labels):
            return labels
    return None


def _arrange(block: Mapping[str, Any], order: Sequence[str] | None) -> tuple[dict[str, Any], dict[str, str]]:
    """``block``'s choices in ``order`` (all of its keys; ``None``: as they are) and the new name of every key."""
    keys = list(order) if order is not None else list(block)
    if sorted(keys) != sorted(block):
        raise ValueError(f"order {keys} is not an order of the keys {list(block)}")
    labels = _places(keys)
    rename = dict(zip(keys, labels, strict=True)) if labels else {k: k for k in keys}
    return {rename[k]: block[k] for k in keys}, rename


def _norm_key(value: Any) -> str:
    if isinstance(value, bool):
        raise Wrong(f"{value!r} is not a key")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return normal_text(str(value))


def _lookup(q: Question, value: Any, lang: str, side: str | None = None) -> str:
    """The choice key that ``value`` names: the key (any case, spaces) or the choice's whole text in either
    language."""
    names: dict[str, str] = {}
    block = q.choices[side] if side else q.choices  # type: ignore[index]
    for k in block:  # keys first: a key always means itself, even where a choice's text reads like another key
        names.setdefault(_norm_key(k), k)
    for k, text in block.items():
        for lg in LANGUAGES:
            names.setdefault(normal_text(text[lg]), k)
    got = names.get(_norm_key(value))
    if got is None:
        keys = ", ".join(str(k) for k in block)
        raise Wrong(f"{value!r} {_tr('unknown', lang)} ({keys}).")
    return got


_SPLIT = re.compile(r"\s*(?:,|;|>|→|->|、|，|\s)\s*")


def _items(value: Any, keys: Sequence[str] = ()) -> list[Any]:
    """A list from ``["a", "c"]``, ``("a", "c")``, ``{"a", "c"}`` or the text ``"a, c"`` / ``"a c"`` / ``"b > a"``;
    with one-letter ``keys``, also ``"ac"``."""
    if isinstance(value, str):
        parts = [p for p in _SPLIT.split(value.strip()) if p]
        single = {k.lower() for k in keys if len(k) == 1}
        if len(parts) == 1 and len(parts[0]) > 1 and single and all(ch in single for ch in parts[0].lower()):
            return list(parts[0])  # "ac": every letter a one-letter key
        return parts
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _grade_single(q: Question, value: Any, lang: str) -> None:
    if isinstance(value, (list, tuple, set)):
        if len(value) != 1:
            raise Wrong(f"{_tr('pick_one', lang)} ({', '.join(q._keys())}).")
        value = next(iter(value))
    got = _lookup(q, value, lang)
    if got != q.answer:
        raise Wrong(f"{got}) {q._choice_text(got, lang)}: {_tr('not_right', lang)}.")


def _grade_multi(q: Question, value: Any, lang: str, name_keys: bool = True) -> None:
    got = {_lookup(q, v, lang) for v in _items(value, q._keys())}
    want = set(q.answer)
    if got == want:
        return
    if not name_keys:  # how many, not which
        counts = [(_tr("n_missing", lang), len(want - got)), (_tr("n_extra", lang), len(got - want))]
        raise Wrong("; ".join(text.format(n=n) for text, n in counts if n) + ".")
    parts = []
    if missing := [k for k in q.answer if k not in got]:
        parts.append(f"{_tr('missing', lang)}: {', '.join(missing)}")
    if extra := [k for k in q._keys() if k in got - want]:
        parts.append(f"{_tr('extra', lang)}: {', '.join(extra)}")
    raise Wrong("; ".join(parts) + ".")


_NUMBER = re.compile(r"^\s*([-+]?(?:\d[\d_]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(.*?)\s*$")


# Byte units as tools write them: GB = 1e9 bytes (datasheets, nccl-tests' busbw), GiB = 2**30 bytes (nvidia-smi's
# MiB is 2**20). Read case-insensitively: students write "gb" for GB.
BYTE_UNITS = {"b": 1, "byte": 1, "bytes": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def in_byte_unit(value: Any, unit: str) -> Any:
    """``value`` as a number of ``unit`` when it is a text that names a byte unit of its own (``"150.8 GB"`` is
    140.4 for ``unit="GiB"``): an answer that says its unit is read in it. Anything else comes back unchanged."""
    if not isinstance(value, str) or unit.lower() not in BYTE_UNITS:
        return value
    m = _NUMBER.match(value.replace(",", ""))
    if not m or m[2].lower() not in BYTE_UNITS:
        return value
    return float(m[1].replace("_", "")) * BYTE_UNITS[m[2].lower()] / BYTE_UNITS[unit.lower()]


def _grade_numeric(q: Question, value: Any, lang: str) -> None:
    want = float(q.answer["value"])
    tol = float(q.answer["rel_tol"])
    value = in_byte_unit(value, q.answer["unit"]["en"])
    if isinstance(value, str):
        m = _NUMBER.match(value.replace(",", ""))
        units = {normal_text(q.answer["unit"][lg]) for lg in LANGUAGES}
        if not m or (m[2] and normal_text(m[2]) not in units):
            raise Wrong(f"{value!r}: {_tr('numeric', lang)} ({q.answer['unit'][lang]}).")
        value = m[1].replace("_", "")
    got = number(value)
    if math.isclose(got, want, rel_tol=tol, abs_tol=0.0 if want else tol):
        return
    side = _tr("high", lang) if got > want else _tr("low", lang)
    slip = match_slip(got / want, {r: t[lang] for r, t in _NUMERIC_SLIPS.items()}, max(tol, 0.005)) if want else None
    raise Wrong(f"{_tr('within', lang)} {tol:.0%}, {side}{f' ({slip})' if slip else ''}.")


_GIB = 2**30 / 1e9
_NUMERIC_SLIPS = {
    2.0: {"en": "2x: a factor of 2 counted twice, or K and V where one was asked?",
          "zh": "2 倍：是否多算了一个因子 2？"},
    0.5: {"en": "half: a factor of 2 forgotten (K and V, read and write, or 2 FLOPs per multiply-add)?",
          "zh": "一半：是否漏了因子 2（K 和 V、读和写，或乘加算 2 次运算）？"},
    8.0: {"en": "8x: bits where bytes were asked?", "zh": "8 倍：是否把比特当成了字节？"},
    1 / 8: {"en": "1/8: bytes where bits were asked?", "zh": "1/8：是否把字节当成了比特？"},
    1e3: {"en": "1000x: a unit prefix off by one step (k, M, G; ms and s)?", "zh": "1000 倍：单位差了一级？"},
    1e-3: {"en": "1/1000: a unit prefix off by one step (k, M, G; ms and s)?", "zh": "千分之一：单位差了一级？"},
    _GIB: {"en": "GB where GiB was asked (or the reverse): 1 GiB = 1.074 GB",
           "zh": "GB 与 GiB 混淆：1 GiB = 1.074 GB"},
    1 / _GIB: {"en": "GiB where GB was asked (or the reverse): 1 GiB = 1.074 GB",
               "zh": "GiB 与 GB 混淆：1 GiB = 1.074 GB"},
}


def _pairs(value: Any) -> list[tuple[Any, Any]]:
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, str):
        out = []
        for part in re.split(r"\s*[,;，；]\s*", value.strip()):
            if part:  # the first separator present, in this order: keys may hold a "-" themselves
                sep = next((x for x in (":", "：", "=", "->", "→", " - ", "—", "-") if x in part), None)
                if sep is None:
                    raise Wrong(f"{part!r}: write each pair as left:right.")
                left, right = part.split(sep, 1)
                out.append((left.strip(), right.strip()))
        return out
    if isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        return [tuple(p) for p in value]
    raise Wrong("a dict {left: right} (or \"a:1, b:2\") was expected.")


def _grade_match(q: Question, value: Any, lang: str) -> None:
    got = {_lookup(q, a, lang, "left"): _lookup(q, b, lang, "right") for a, b in _pairs(value)}
    wrong = [a for a in q.answer if a in got and got[a] != q.answer[a]]
    unpaired = [a for a in q.answer if a not in got]
    if not wrong and not unpaired:
        return
    parts = []
    if wrong:
        parts.append(f"{_tr('pairs', lang)}: " + ", ".join(
            f"{q._choice_text(a, lang, 'left')} ↔ {q._choice_text(got[a], lang, 'right')}" for a in wrong))
    if unpaired:
        parts.append(f"{_tr('unpaired', lang)}: " + ", ".join(q._choice_text(a, lang, 'left') for a in unpaired))
    raise Wrong("; ".join(parts) + ".")


def _grade_order(q: Question, value: Any, lang: str) -> None:
    got = [_lookup(q, v, lang) for v in _items(value, q._keys())]
    if sorted(got) != sorted(q.answer):
        missing = [k for k in q.answer if k not in got]
        twice = sorted({k for k in got if got.count(k) > 1})
        detail = ", ".join(filter(None, [f"{_tr('missing', lang)}: {', '.join(missing)}" if missing else "",
                                         f"2x: {', '.join(twice)}" if twice else ""]))
        raise Wrong(f"{_tr('order_all', lang)} ({detail}).")
    if got == list(q.answer):
        return
    i = next(i for i, (a, b) in enumerate(zip(got, q.answer, strict=True)) if a != b)
    raise Wrong(f"{_tr('first_wrong', lang)} {i + 1}: {got[i]}) {q._choice_text(got[i], lang)}.")


_GRADERS = {"single": _grade_single, "multi": _grade_multi, "numeric": _grade_numeric, "match": _grade_match,
            "order": _grade_order}


# --- the bank ----------------------------------------------------------------------------------------------------


@dataclass
class Bank:
    """Every question, by section; ``titles[n]`` is section n's ``{en, zh}`` title."""

    questions: list[Question]
    titles: dict[int, dict[str, str]]

    def __iter__(self) -> Iterator[Question]:
        return iter(self.questions)

    def __len__(self) -> int:
        return len(self.questions)

    @property
    def sections(self) -> list[int]:
        return sorted(self.titles)

    def section(self, n: int) -> list[Question]:
        return [q for q in self.questions if q.section == n]

    def get(self, qid: str) -> Question:
        for q in self.questions:
            if q.id == qid:
                return q
        raise KeyError(f"no question {qid!r} in the bank")


def bank_folder(folder: Path | str | None = None) -> Path:
    """``folder``, else ``$NVLAB_QUIZ_DIR``, else the course's bank (``lab_utils/data/quiz``)."""
    if folder is not None:
        return Path(folder)
    env = os.environ.get(QUIZ_ENV, "").strip()
    if env and not Path(env).is_dir():
        raise EnvError(f"{QUIZ_ENV}={env!r}: expected a folder of question files (s1_*.yaml ...), and there is none "
                       "there (or unset it for the course's bank)")
    return Path(env) if env else BANK_DIR


def _where(file: str, qid: str | None) -> str:
    return f"{file}, question {qid!r}" if qid else file


def _check_question(raw: Mapping[str, Any], file: str, rows: Mapping[str, Any]) -> None:
    """What the schema cannot say: the answer's keys are the choices' (every one once where it must), known rows."""
    where = _where(file, raw["id"])
    form, choices, answer = raw["form"], raw.get("choices"), raw["answer"]
    problem = None
    if form in ("single", "multi", "order"):
        keys = [str(k) for k in choices]
        picked = [answer] if form == "single" else answer
        if bad := [k for k in picked if k not in keys]:
            problem = f"answer names {bad}, not among the choices {keys}"
        elif form == "order" and sorted(picked) != sorted(keys):
            problem = f"an order answer lists every choice once: {keys}"
    elif form == "match":
        left, right = [str(k) for k in choices["left"]], [str(k) for k in choices["right"]]
        if sorted(map(str, answer)) != sorted(left):
            problem = f"a match answer pairs every left key {left} with a right key"
        elif bad := [v for v in answer.values() if str(v) not in right]:
            problem = f"answer pairs with {bad}, not among the right keys {right}"
    if problem is None and rows and (bad := [r for r in raw.get("rows") or [] if r not in rows]):
        problem = f"rows {bad} are not in rows.yaml"
    if problem:
        raise BankError(f"{where}: {problem}")


def _schema_error(err: Any, data: Any, file: str) -> BankError:
    path = list(err.absolute_path)
    qid = None
    if len(path) >= 2 and path[0] == "questions" and isinstance(path[1], int):
        with contextlib.suppress(AttributeError, IndexError, KeyError, TypeError):
            qid = data["questions"][path[1]].get("id")
        qid = qid or f"#{path[1] + 1}"
    at = "/".join(str(p) for p in path) or "(top)"
    return BankError(f"{_where(file, qid)}: does not match schema.json at {at}: {err.message}")


def _yaml(text: str) -> Any:
    """``yaml.safe_load`` through libyaml where PyYAML has it: the bank reads in 0.02 s instead of 0.2 s, in every
    process that loads it (each test worker, each kernel of a lab with a quiz)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load_bank(folder: Path | str | None = None) -> Bank:
    """Read and validate the question bank in ``folder`` (see ``bank_folder``): every ``s<N>_*.yaml``, checked
    against the folder's ``schema.json`` (the course's where it has none), with ``rows.yaml`` for the syllabus rows."""
    root = bank_folder(folder)
    files = sorted(root.glob("s[0-9]*_*.yaml"), key=lambda p: (int(re.match(r"s(\d+)", p.name)[1]), p.name))
    if not files:
        raise BankError(f"no question bank in {root}: expected s1_stack.yaml ... s6_industry.yaml there "
                        f"(or set {QUIZ_ENV} to a folder that has them)")
    # a trainer's own bank is held to the course's schema unless it brings its own
    schema_path = root / "schema.json" if (root / "schema.json").exists() else BANK_DIR / "schema.json"
    schema = json.loads(schema_path.read_text(encoding="utf-8"))
    validator = jsonschema.validators.validator_for(schema)(schema)
    rows: dict[str, dict[str, Any]] = {}
    if (root / "rows.yaml").exists():
        raw_rows = _yaml((root / "rows.yaml").read_text(encoding="utf-8")) or []
        if isinstance(raw_rows, Mapping):  # {rows: [...]} is read too
            raw_rows = raw_rows.get("rows", [])
        rows = {str(r["id"]): dict(r) for r in raw_rows}
    questions: list[Question] = []
    titles: dict[int, dict[str, str]] = {}
    seen: dict[str, str] = {}
    for path in files:
        name = path.name
        try:
            data = _yaml(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise BankError(f"{name}: not valid YAML ({err})") from None
        errors = sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
        if errors:
            raise _schema_error(errors[0], data, name)
        section = data["section"]
        if section in titles:
            raise BankError(f"{name}: section {section} is also in another file")
        titles[section] = dict(data["title"])
        for raw in data["questions"]:
            _check_question(raw, name, rows)
            qid = raw["id"]
            if qid in seen:
                raise BankError(f"{_where(name, qid)}: the id is used twice (also in {seen[qid]})")
            seen[qid] = name
            choices, answer = raw.get("choices"), raw["answer"]
            if raw["form"] == "match":  # keys as text: YAML reads a bare 1 as a number
                choices = {side: {str(k): v for k, v in choices[side].items()} for side in ("left", "right")}
                answer = {str(k): str(v) for k, v in answer.items()}
            elif choices is not None:
                choices = {str(k): v for k, v in choices.items()}
            questions.append(Question(
                id=qid, section=section, form=raw["form"], prompt=dict(raw["prompt"]), answer=answer,
                explanation=dict(raw["explanation"]), choices=choices, rows=tuple(raw.get("rows") or ()),
                lab=raw.get("lab"), terms=tuple(dict(t) for t in raw.get("terms") or ()),
                row_text=tuple(rows[r] for r in raw.get("rows") or ()) if rows else ()))
    return Bank(questions, titles)
