"""Lab 09's exam review: the question bank, its graded questions, a quiz runner, the glossary and the stack map.

``load_bank`` reads and validates the YAML bank (``lab_utils/data/quiz/``; ``NVLAB_QUIZ_DIR`` points at another);
``question.exercise("zh").check(answer)`` grades one answer through the exercise framework. ``QuizRunner`` draws
questions by section with a fixed seed: ``next()``, ``answer(x)``, ``check(answers, section)``, ``score()``,
``missed()``. ``strategy_scores`` scores fixed ways of guessing against ``GUESS_LIMIT``. ``glossary`` /
``write_glossary`` produce ``docs/glossary.md`` (generated: never edit it by hand); ``stack_map`` links the stack
to the labs. Importing this module reads nothing; YAML and jsonschema are imported when a bank is loaded.

Design notes: docs/internals.md#lab_utilsexercisesquizpy
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import math
import os
import random
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jsonschema
import pandas as pd
import yaml

from lab_utils import DATA_DIR
from lab_utils.args import check_int
from lab_utils.course.catalog import LABS, repo_root
from lab_utils.exercises.framework import Exercise, Outcome, Status, Wrong, is_blank, match_slip, normal_text, number
from lab_utils.procs import EnvError

__all__ = [
    "BANK_DIR", "QUIZ_ENV", "FORMS", "LANGUAGES", "BankError", "Question", "Bank", "load_bank", "QuizRunner",
    "glossary", "glossary_markdown", "write_glossary", "GLOSSARY_PATH", "stack_map", "STACK",
    "shuffled", "BYTE_UNITS", "in_byte_unit", "STRATEGIES", "GUESS_LIMIT", "strategy_scores", "ui_text",
    "outcome_line",
]

BANK_DIR = DATA_DIR / "quiz"
QUIZ_ENV = "NVLAB_QUIZ_DIR"  # another bank folder (a trainer's own; the tests' fixture)
FORMS = ("single", "multi", "numeric", "match", "order")
LANGUAGES = ("en", "zh")
GLOSSARY_PATH = repo_root() / "docs" / "glossary.md"

# The few phrases this module writes itself, in both languages of the bank.
_T = {
    "missing": {"en": "missing", "zh": "漏选"},
    "extra": {"en": "not part of the answer", "zh": "多选"},
    "n_missing": {"en": "{n} right ones missing", "zh": "漏选 {n} 项"},
    "n_extra": {"en": "{n} not part of the answer", "zh": "多选 {n} 项"},
    "why": {"en": "Why", "zh": "解析"},
    "answer": {"en": "Answer", "zh": "答案"},
    "lab": {"en": "Measured in lab", "zh": "相关实验"},
    "rows": {"en": "Syllabus", "zh": "大纲"},
    "unknown": {"en": "is not one of the choices", "zh": "不在选项中"},
    "pairs": {"en": "wrong pairs", "zh": "配对错误"},
    "unpaired": {"en": "not paired", "zh": "未配对"},
    "first_wrong": {"en": "the first item out of place is at position", "zh": "第一个位置错误的是第"},
    "pick_one": {"en": "pick one key", "zh": "请只选一个选项"},
    "order_all": {"en": "put every item in order", "zh": "请排列所有选项"},
    "high": {"en": "too high", "zh": "偏高"},
    "low": {"en": "too low", "zh": "偏低"},
    "within": {"en": "not within", "zh": "误差超过"},
    "not_right": {"en": "not this one", "zh": "不是这个"},
    "single": {"en": "one answer: a key", "zh": "单选：填一个选项字母"},
    "multi": {"en": "several answers: keys, e.g. \"a,c\"", "zh": "多选：填多个选项，例如 \"a,c\""},
    "numeric": {"en": "a number", "zh": "填一个数"},
    "match": {"en": "pairs: {left: right}, e.g. {\"a\": \"1\"}", "zh": "配对：{左: 右}，例如 {\"a\": \"1\"}"},
    "order": {"en": "every key in order, e.g. [\"b\", \"a\", \"c\"]",
              "zh": "按顺序排列所有选项，例如 [\"b\", \"a\", \"c\"]"},
    "in": {"en": "in", "zh": "单位"},
    # the quiz panel's controls and status line (lab_utils.widgets.quiz_view)
    "submit": {"en": "Submit", "zh": "提交"},
    "next": {"en": "Next question", "zh": "下一题"},
    "end": {"en": "End of the quiz.", "zh": "测验结束。"},
    "tally": {"en": "has the tally.", "zh": "给出总分。"},
    "order_label": {"en": "order", "zh": "顺序"},
    "one_of": {"en": "one of {n}; in JupyterLab this is a panel: answer, Submit, Next question",
               "zh": "共 {n} 题之一；在 JupyterLab 中是一个面板：作答、提交、下一题"},
    "no_questions": {"en": "no questions", "zh": "没有题目"},
    Status.CORRECT.value: {"en": "correct", "zh": "正确"},
    Status.INCORRECT.value: {"en": "incorrect", "zh": "错误"},
    Status.NOT_ATTEMPTED.value: {"en": "not attempted", "zh": "未作答"},
    Status.NOT_APPLICABLE.value: {"en": "not applicable on this tier", "zh": "本环境不适用"},
    Status.NOT_NOW.value: {"en": "not checked now", "zh": "暂未检查"},
    "retry": {"en": "Try again: the answer and its explanation come after a second wrong answer ({hint} gives a hint "
                    "first).",
              "zh": "请再试一次：再答错一次才会显示答案和解析（可先用 {hint} 查看提示）。"},
    # what a hint or the answer says before it has anything to give (framework.HELP_TEXTS' placeholders)
    "no_more_hints": {"en": "No more hints: all {n} were shown. Once you have answered, {solution} shows the answer.",
                      "zh": "没有更多提示了：{n} 条提示已全部显示。作答并检查之后，{solution} 会显示答案。"},
    "solution_first": {"en": "The answer comes after yours was checked: answer it (runner.answer or runner.check), "
                             "then call this again ({hint} gives a hint meanwhile).",
                       "zh": "先作答并检查（runner.answer 或 runner.check），再查看答案；"
                             "在此之前可用 {hint} 查看提示。"},
}


class BankError(ValueError):
    """The bank cannot be used; the message names the file and, where there is one, the question id."""


def _lang(language: str) -> str:
    if language not in LANGUAGES:
        raise ValueError(f"language={language!r}: use one of {LANGUAGES}")
    return language


def _tr(key: str, language: str) -> str:
    return _T[key][language]


def ui_text(key: str, language: str) -> str:
    """One of the phrases the quiz and its panel write themselves (a button, a status word), in ``language``."""
    return _tr(key, _lang(language))


def outcome_line(out: Outcome, language: str) -> str:
    """``str(out)`` with its status word in ``language`` (the message is already in it)."""
    return str(out).replace(f": {out.status.value}.", f": {ui_text(out.status.value, language)}.", 1)


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
    file: str = ""
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
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    folder: Path | None = None

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
        try:
            qid = data["questions"][path[1]].get("id")
        except (AttributeError, IndexError, KeyError, TypeError):
            qid = None
        qid = qid or f"#{path[1] + 1}"
    at = "/".join(str(p) for p in path) or "(top)"
    return BankError(f"{_where(file, qid)}: does not match schema.json at {at}: {err.message}")


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
        raw_rows = yaml.safe_load((root / "rows.yaml").read_text(encoding="utf-8")) or []
        if isinstance(raw_rows, Mapping):  # {rows: [...]} is read too
            raw_rows = raw_rows.get("rows", [])
        rows = {str(r["id"]): dict(r) for r in raw_rows}
    questions: list[Question] = []
    titles: dict[int, dict[str, str]] = {}
    seen: dict[str, str] = {}
    for path in files:
        name = path.name
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
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
                lab=raw.get("lab"), terms=tuple(dict(t) for t in raw.get("terms") or ()), file=name,
                row_text=tuple(rows[r] for r in raw.get("rows") or ()) if rows else ()))
    return Bank(questions, titles, rows, root)


# --- the quiz runner -------------------------------------------------------------------------------------------


def _draw(seed: int, qid: str) -> str:
    """A question's place in the order for ``seed``: a hash of both, so the order is the same on every machine and
    Python, and adding a question to the bank moves no other (the first n of a section change only when the new one
    draws a place among them)."""
    return hashlib.sha256(f"{seed}:{qid}".encode()).hexdigest()


def _rng(seed: int, what: str) -> random.Random:
    return random.Random(int(_draw(seed, what), 16))  # an int seed: the same sequence on every machine


def shuffled(questions: Sequence[Question], seed: int) -> list[Question]:
    """``questions`` with their choices in an order fixed by ``seed``, letters given out again (``reordered``).

    Every order comes from a hash of seed and id, except that a single-choice question's right letter is dealt,
    not drawn: questions with n choices take the letters of a shuffled ``a … n`` in turn, so every letter is right
    about equally often. (Drawn letters put over 35 % of this bank's 60 on one letter in about 4 seeds of 10.)"""
    dealt: dict[int, list[int]] = {}  # number of choices -> right places still to give out
    rounds: dict[int, int] = {}
    out = []
    for q in questions:
        rng = _rng(seed, f"choices:{q.id}")
        if q.form == "match":
            left, right = list(q.choices["left"]), list(q.choices["right"])
            rng.shuffle(left)
            rng.shuffle(right)
            out.append(q.reordered(left=left, right=right))
        elif q.form == "single":
            others = [k for k in q.choices if k != q.answer]
            rng.shuffle(others)
            n = len(q.choices)
            if not dealt.get(n):
                rounds[n] = rounds.get(n, 0) + 1
                dealt[n] = list(range(n))
                _rng(seed, f"deal:{n}:{rounds[n]}").shuffle(dealt[n])
            others.insert(dealt[n].pop(), q.answer)
            out.append(q.reordered(others))
        elif q.form in ("multi", "order"):
            order = list(q.choices)
            rng.shuffle(order)
            out.append(q.reordered(order))
        else:
            out.append(q)
    return out


class QuizRunner:
    """Questions of ``sections`` (all by default), ``n`` per section (all by default), in an order fixed by
    ``seed`` (a hash of seed and id: the same on every machine); text and feedback in ``language`` ("en" or "zh").
    The choices are shuffled by ``seed`` too (``shuffled``; ``shuffle=False`` shows the bank's order): the letters
    shown are the letters graded, and ``key()`` gives them.

    One at a time: ``next()`` shows a question, ``answer(x)`` grades it at once (a wrong answer gets one more try
    before the answer and its explanation are shown). A section at
    a time: ``show(section)`` prints its questions, ``check(answers, section)`` grades a dict ``{id: answer}``.
    ``score()`` is a table per section; ``missed()`` lists what was wrong or left blank, with the right answer;
    ``hint(id)`` and ``solution(id)`` help with one question.
    """

    def __init__(self, bank: Bank, sections: Sequence[int] | None = None, n: int | None = None, seed: int = 0,
                 language: str = "en", shuffle: bool = True) -> None:
        self.bank = bank
        self.language = _lang(language)
        wanted = list(sections) if sections is not None else bank.sections
        if bad := [s for s in wanted if s not in bank.titles]:
            raise ValueError(f"sections {bad} are not in the bank (it has {bank.sections})")
        if n is not None:
            check_int(n, "n", "QuizRunner", what="questions per section, or None for all")
        self.questions: list[Question] = []
        for s in wanted:
            pool = sorted(bank.section(s), key=lambda q: _draw(seed, q.id))
            self.questions += pool[:n] if n is not None else pool
        if shuffle:
            self.questions = shuffled(self.questions, seed)
        self.sections = wanted
        self.outcomes: dict[str, Outcome] = {}
        self.given: dict[str, Any] = {}
        self._exercises: dict[str, tuple[Question, Exercise]] = {}
        self._pos = 0
        self._current: Question | None = None

    def __len__(self) -> int:
        return len(self.questions)

    def in_section(self, section: int | None) -> list[Question]:
        """The chosen questions of ``section``, or all of them when ``None``."""
        return self.questions if section is None else [q for q in self.questions if q.section == section]

    def title(self, section: int) -> str:
        return self.bank.titles[section][self.language]

    # one at a time
    def next(self, show: bool = True) -> Question | None:
        """The next question (printed), or ``None`` at the end."""
        if self._pos >= len(self.questions):
            self._current = None
            if show:
                print("End of the quiz: runner.score() and runner.missed()." if self.language == "en"
                      else "测验结束：runner.score() 与 runner.missed()。")
            return None
        self._current = self.questions[self._pos]
        self._pos += 1
        if show:
            print(self._current.text(self.language, self._pos))
        return self._current

    def answer(self, value: Any, quiet: bool = False) -> Outcome:
        """Grade ``value`` for the question ``next()`` showed last; prints the outcome, and the explanation when it
        is right (a wrong one gets one more try before the answer is shown)."""
        q = self._current
        if q is None:
            raise RuntimeError("no question is open: call runner.next() first")
        out = self._grade(q, value, "runner.answer(...)")
        if not quiet:
            print(out)
            if out.status is Status.CORRECT:
                print(f"   {_tr('why', self.language)}: {q.explanation[self.language]}")
            if (lab := q.lab_text(self.language)):
                print(f"   {lab}")
        return out

    def _grade(self, q: Question, value: Any, var: str) -> Outcome:
        exercise = self._exercise(q)
        exercise.var = var  # the name the student wrote it under, in the outcome's message
        out = exercise.check(value, quiet=True)
        self.outcomes[q.id] = out
        self.given[q.id] = value
        return out

    # a section at a time
    def show(self, section: int | None = None) -> None:
        """Print the questions of ``section`` (every chosen one when ``None``), numbered, with their ids."""
        for s in [section] if section is not None else self.sections:
            print(f"== {s}. {self.title(s)} ==")
            for i, q in enumerate(self.in_section(s), 1):
                print(q.text(self.language, i))
                print()

    def template(self, section: int | None = None) -> dict[str, None]:
        """``{id: None}`` for the questions of ``section``: a dict to fill in."""
        return {q.id: None for q in self.in_section(section)}

    def key(self, section: int | None = None) -> dict[str, Any]:
        """The right answers ``{id: answer}`` of ``section`` (or all): what a solution fills in."""
        return {q.id: q.key() for q in self.in_section(section)}

    def check(self, answers: Mapping[str, Any] | None, section: int | None = None,
              quiet: bool = False) -> list[Outcome]:
        """Grade ``answers`` (``{id: answer}``; ``None`` is all blank) for the questions of ``section`` (or all).

        Prints one line per question (wrong ones with why; from a question's second wrong answer on, its answer and
        explanation too) and the section's tally."""
        if answers is not None and not isinstance(answers, Mapping):
            raise TypeError(f"answers should be a dict {{question id: answer}}, got {type(answers).__name__}")
        answers = answers or {}
        qs = self.in_section(section)
        if unknown := sorted(set(answers) - {q.id for q in qs}):
            print(f"(ignored: {', '.join(unknown)} not among these questions)")
        name = f"answers_s{section}" if section is not None else "answers"  # the notebook's dict of the section
        outs = [self._grade(q, answers.get(q.id), f"{name}[{q.id!r}]") for q in qs]
        if not quiet:
            for o in outs:
                print(o)
            right = sum(o.correct for o in outs)
            blank = sum(o.status is Status.NOT_ATTEMPTED for o in outs)
            where = f"section {section}" if section is not None else "quiz"
            print(f"{where}: {right}/{len(outs)} right, {blank} blank")
        return outs

    def hint(self, qid: str) -> str:
        """The next hint of question ``qid``: its syllabus rows, then the lab that measured it."""
        return self._exercise(self._question(qid)).hint()

    def solution(self, qid: str) -> str:
        """The answer of question ``qid`` with its explanation (in the letters this quiz shows)."""
        return self._exercise(self._question(qid)).solution()

    def _question(self, qid: str) -> Question:
        """Question ``qid`` as this quiz shows it (its choices in this seed's order), else as the bank has it."""
        return next((q for q in self.questions if q.id == qid), None) or self.bank.get(qid)

    def _exercise(self, q: Question) -> Exercise:
        # Graded as shown: the exercise is the shown question's, made again if another object stands for the id.
        held = self._exercises.get(q.id)
        if held is None or held[0] is not q:
            held = self._exercises[q.id] = (q, q.exercise(self.language, var=f"answers[{q.id!r}]",
                                                          hint_call=f"runner.hint({q.id!r})"))
        return held[1]

    # results
    def score(self) -> pd.DataFrame:
        """One row per section: questions, answered, right, and the share right (of all its questions)."""
        rows = []
        for s in self.sections:
            qs = self.in_section(s)
            outs = [self.outcomes.get(q.id) for q in qs]
            answered = sum(o is not None and o.graded for o in outs)
            right = sum(o is not None and o.correct for o in outs)
            rows.append({"section": s, "title": self.title(s), "questions": len(qs), "answered": answered,
                         "right": right, "score": right / len(qs) if qs else float("nan")})
        return pd.DataFrame(rows, columns=["section", "title", "questions", "answered", "right", "score"])

    def missed(self) -> pd.DataFrame:
        """Every question not answered right (wrong, or blank), with the right answer, why, and the lab."""
        lang = self.language
        rows = []
        for q in self.questions:
            out = self.outcomes.get(q.id)
            if out is not None and out.correct:
                continue
            status = "not attempted" if out is None or out.status is Status.NOT_ATTEMPTED else out.status.value
            given = self.given.get(q.id)
            rows.append({"id": q.id, "section": q.section, "status": status,
                         "yours": None if is_blank(given) else given, "answer": q.answer_text(lang),
                         "why": q.explanation[lang], "lab": q.lab_text(lang)})
        return pd.DataFrame(rows, columns=["id", "section", "status", "yours", "answer", "why", "lab"])


# --- guessing: can the review be passed without reading it? ------------------------------------------------------

GUESS_LIMIT = 0.35  # the most any fixed way of answering may score, as a share of the questions it answers


def _by_length(q: Question, lang: str, longest: bool = True) -> list[str]:
    """The keys, longest choice text first (or shortest); a tie keeps the shown order."""
    return sorted(q._keys(), key=lambda k: len(q._choice_text(k, lang)), reverse=longest)


def _first(n: int) -> Any:
    return lambda q, lang: q._keys()[:n]


_WORD = re.compile(r"[a-z0-9]+|[\u4e00-\u9fff]")  # a Latin word or number, or one Chinese character


_STOP = frozenset("the and with that for from this its are was were has have into than then them they their what "
                  "which who how why when where does not one all any can per".split())  # words every choice has
_STOP_ZH = frozenset("的了是在和与或一个不这那其它们哪些以及")


def _words(text: str) -> set[str]:
    """The words a guesser would compare: Latin words of 3+ letters and Chinese characters, common ones left out."""
    return {w for w in _WORD.findall(text.lower()) if (len(w) > 2 and w not in _STOP) or
            (not w.isascii() and w not in _STOP_ZH)}


def _by_shared_words(q: Question, lang: str, side: str | None = None, text: str | None = None) -> list[str]:
    """The keys, the choice sharing most words with the question (or ``text``) first; a tie keeps the shown order."""
    asked = _words(text if text is not None else q.prompt[lang])
    return sorted(q._keys(side), key=lambda k: -len(asked & _words(q._choice_text(k, lang, side))))


def _pairs_by_shared_words(q: Question, lang: str) -> dict[str, str]:
    """Each left item with the right one sharing most words with it (a right one may be used twice)."""
    return {a: _by_shared_words(q, lang, "right", q._choice_text(a, lang, "left"))[0] for a in q._keys("left")}


def _number_in_prompt(q: Question, lang: str) -> Any:
    numbers = _NUMBER_IN_TEXT.findall(q.prompt[lang].replace(",", ""))
    return float(numbers[0]) if numbers else None


_NUMBER_IN_TEXT = re.compile(r"\d+(?:\.\d+)?")


def _median_of(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _always(key: str) -> Any:
    return lambda q, lang: key


# A strategy answers the forms it names and leaves the others blank. Letters and places are those shown.
STRATEGIES: dict[str, dict[str, Any]] = {
    **{f"always {k}": {"single": _always(k)} for k in "abcd"},
    "always the longest choice": {"single": lambda q, lang: _by_length(q, lang)[0]},
    "always the shortest choice": {"single": lambda q, lang: _by_length(q, lang, longest=False)[0]},
    "the first two": {"multi": _first(2)},
    "the first three": {"multi": _first(3)},
    "all but the last": {"multi": lambda q, lang: q._keys()[:-1]},
    "all of them": {"multi": lambda q, lang: q._keys()},
    "the two longest": {"multi": lambda q, lang: _by_length(q, lang)[:2]},
    "the three longest": {"multi": lambda q, lang: _by_length(q, lang)[:3]},
    "as listed": {"order": lambda q, lang: q._keys()},
    "pairs in listed order": {"match": lambda q, lang: dict(zip(q._keys("left"), q._keys("right"), strict=False))},
    "a, and the first three of several": {"single": _always("a"), "multi": _first(3)},
    "most words shared with the question": {"single": lambda q, lang: _by_shared_words(q, lang)[0]},
    "the two sharing most words": {"multi": lambda q, lang: _by_shared_words(q, lang)[:2]},
    "the three sharing most words": {"multi": lambda q, lang: _by_shared_words(q, lang)[:3]},
    "pairs sharing most words": {"match": _pairs_by_shared_words},
    "ordered by words shared": {"order": lambda q, lang: _by_shared_words(q, lang)},
    "fewest words shared with the question": {"single": lambda q, lang: _by_shared_words(q, lang)[-1]},
    "every choice sharing a word with the question": {
        "multi": lambda q, lang: [k for k in q._keys() if _words(q.prompt[lang]) & _words(q._choice_text(k, lang))]
        or q._keys()[:1]},
    "none of them": {"multi": lambda q, lang: []},
    "in reverse": {"order": lambda q, lang: q._keys()[::-1]},
    "a number in the question": {"numeric": _number_in_prompt},
    "the median answer of the bank": {"numeric": "median"},  # filled in by strategy_scores from the questions
}


def strategy_scores(questions: Sequence[Question] | Bank, language: str = "en") -> pd.DataFrame:
    """How each of ``STRATEGIES`` scores on ``questions`` (as shown: a bank's own order, or ``shuffled``): the
    questions it answers, how many right, ``score`` (right / answered, held to ``GUESS_LIMIT``) and ``of_all``
    (right / every question)."""
    lang = _lang(language)
    qs = list(questions)
    numbers = [float(q.answer["value"]) for q in qs if q.form == "numeric"]
    median = _median_of(numbers) if numbers else 0.0
    rows = []
    for name, forms in STRATEGIES.items():
        answered = right = 0
        for q in qs:
            if q.form not in forms:
                continue
            answered += 1
            pick = forms[q.form]
            guess = median if pick == "median" else pick(q, lang)
            try:
                if guess is None or guess == []:  # a strategy with no guess here, or "none of them": wrong
                    raise Wrong("no answer")
                q.grade(guess, lang, explain=False, name_keys=False)
            except Wrong:
                continue
            right += 1
        rows.append({"strategy": name, "forms": ", ".join(forms), "answered": answered, "right": right,
                     "score": right / answered if answered else 0.0, "of_all": right / len(qs) if qs else 0.0})
    return pd.DataFrame(rows, columns=["strategy", "forms", "answered", "right", "score", "of_all"])


# --- the glossary ---------------------------------------------------------------------------------------------


def glossary(bank: Bank) -> pd.DataFrame:
    """Every term of the bank, English ↔ Chinese, once per pair, sorted (case-insensitively) by the English;
    ``sections`` lists where it appears."""
    found: dict[tuple[str, str], set[int]] = {}
    for q in bank:
        for t in q.terms:
            found.setdefault((t["en"].strip(), t["zh"].strip()), set()).add(q.section)
    rows = [{"en": en, "zh": zh, "sections": ", ".join(map(str, sorted(s)))}
            for (en, zh), s in sorted(found.items(), key=lambda kv: (kv[0][0].lower(), kv[0][0], kv[0][1]))]
    return pd.DataFrame(rows, columns=["en", "zh", "sections"])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def glossary_markdown(bank: Bank) -> str:
    """The text of ``docs/glossary.md`` for ``bank``."""
    table = glossary(bank)
    lines = [
        "# Glossary: English ↔ 中文",
        "",
        "<!-- GENERATED from the question bank (lab_utils/data/quiz) by "
        "`python -m lab_utils.exercises.quiz glossary`. Do not edit by hand: tests/test_quiz.py fails when this "
        "file differs from what that command writes. -->",
        "",
        f"{len(table)} terms from the lab 09 question bank. *sections*: the syllabus sections whose questions use "
        "the term (1 stack, 2 inference, 3 NeMo, 4 lifecycle, 5 MLOps, 6 industry).",
        "",
        "| English | 中文 | sections |",
        "|---|---|---|",
    ]
    lines += [f"| {_cell(r.en)} | {_cell(r.zh)} | {r.sections} |" for r in table.itertuples()]
    return "\n".join(lines) + "\n"


def write_glossary(path: Path | str | None = None, bank: Bank | None = None) -> Path:
    """Write ``docs/glossary.md`` (or ``path``) from ``bank`` (default: ``load_bank()``); returns the path."""
    target = Path(path) if path is not None else GLOSSARY_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(glossary_markdown(bank if bank is not None else load_bank()), encoding="utf-8")
    return target


# --- the stack map ----------------------------------------------------------------------------------------------

# The stack's layers, bottom to top, with the components the course touches and the labs that touched them.
# (layer en, layer zh, what it solves en, zh, [(component, [labs], what the lab did)])
STACK: tuple[tuple[str, str, str, str, tuple[tuple[str, tuple[str, ...], str], ...]], ...] = (
    ("driver", "驱动", "the OS sees and manages the GPU", "操作系统识别并管理 GPU", (
        ("NVIDIA driver, nvidia-smi", ("00",), "the CUDA ceiling, driver ↔ CUDA compatibility"),
        ("NVML (pynvml)", ("00", "05"), "inventory, topology, MIG and ECC; the GPU exporter's metrics"),
    )),
    ("CUDA", "CUDA", "general computation on the GPU: kernels, blocks, grids", "GPU 通用计算：内核、线程块、网格", (
        ("CUDA runtime (in PyTorch's wheels)", ("00", "01"), "the runtime torch carries; no toolkit needed"),
        ("streams, events, synchronize", ("01", "09"), "timing asynchronous work; prefill and decode timed"),
        ("CUDA graphs", ("01",), "launch overhead removed by capture and replay"),
        ("kernels: grid, blocks, warps, masks", ("01b",), "a vector add, a fused softmax and a tiled matmul written "
                                                         "in Triton and timed; the add in CUDA C++"),
    )),
    ("accelerated libraries (CUDA-X)", "加速库（CUDA-X）", "tuned building blocks", "调优好的计算构件", (
        ("cuBLAS", ("01", "09"), "matmul TFLOP/s by size and dtype; the decoder's matmuls"),
        ("cuDNN", ("01",), "TF32 convolutions by default"),
        ("NCCL", ("02",), "all-reduce busbw, DDP gradients"),
        ("TensorRT, ModelOpt", ("03",), "engines, FP16/INT8/FP8, dynamic shapes"),
        ("RAPIDS, DALI, Magnum IO", (), "named in the syllabus; not measured in this course"),
    )),
    ("frameworks", "框架", "models in Python; the framework calls the libraries", "用 Python 写模型，框架调用底层库", (
        ("PyTorch", ("01", "02", "03", "09"), "AMP, DDP, torch.compile, export, a decoder with a KV cache"),
        ("ONNX, ONNX Runtime", ("03", "04"), "export, the CPU stand-in, the served model"),
    )),
    ("platforms and services", "平台与服务", "packaged containers, models, deployment",
     "打包好的容器、模型与部署工具", (
        ("NGC containers", ("00",), "what goes in the image, what stays on the host"),
        ("Dynamo-Triton (Triton Inference Server)", ("04", "05"), "model repository, dynamic batching, metrics"),
        ("NIM", ("09",), "an OpenAI-compatible request, shown (no server here)"),
        ("NeMo, Dynamo", ("09",), "exam review; Dynamo's prefill/decode split follows from lab 09's measurement"),
    )),
    ("operations", "运维", "service health, resource use, model quality", "服务健康、资源使用、模型质量", (
        ("Prometheus, PromQL, alerts", ("05",), "QPS, latency, alert rules graded by promtool"),
        ("DCGM-style GPU metrics", ("05",), "GPU_UTIL against SM and tensor activity"),
    )),
    ("enterprise suite", "企业套件", "supported, patched long-term branches", "有支持、有安全补丁的长期分支", (
        ("NVIDIA AI Enterprise, GPU Operator", ("09",), "exam review only"),
    )),
    ("industry solutions", "行业解决方案", "domain platforms with SDKs and models", "带 SDK 与预训练模型的领域平台", (
        ("Clara, DRIVE, Isaac, Omniverse, Riva, …", ("09",), "exam review only"),
    )),
)


class StackMap(str):
    """HTML text that a notebook renders as HTML (and a test reads as a string)."""

    def _repr_html_(self) -> str:
        return str(self)


def stack_map(language: str = "en", open_layers: bool = False) -> StackMap:
    """The stack, bottom to top: one ``<details>`` per layer, its components, and links to the labs of this course
    that touched each (``../labs/NN_*.ipynb``, relative to a notebook in ``labs/`` or ``solutions/``)."""
    lang = _lang(language)
    labs = {lab.number: lab for lab in LABS}
    head = ("component", "labs", "what the lab did") if lang == "en" else ("组件", "实验", "实验做了什么")
    parts = ['<div class="nvlab-stack-map">']
    for layer_en, layer_zh, what_en, what_zh, components in STACK:
        name, what = (layer_en, what_en) if lang == "en" else (layer_zh, what_zh)
        parts.append(f"<details{' open' if open_layers else ''}><summary><b>{html.escape(name)}</b>: "
                     f"{html.escape(what)}</summary>")
        parts.append(f"<table><tr><th>{head[0]}</th><th>{head[1]}</th><th>{head[2]}</th></tr>")
        for comp, numbers, did in components:
            links = [f'<a href="../labs/{html.escape(labs[n].filename)}">{n} {html.escape(labs[n].title)}</a>'
                     for n in numbers if n in labs]
            parts.append(f"<tr><td>{html.escape(comp)}</td><td>{'<br>'.join(links) or '-'}</td>"
                         f"<td>{html.escape(did)}</td></tr>")
        parts.append("</table></details>")
    parts.append("</div>")
    return StackMap("\n".join(parts))


def _strategies(args: list[str]) -> int:
    """Print ``strategy_scores`` for the bank as written and for the whole-bank quiz of ``--seed`` (as a student
    sees it); 1 when any strategy scores over ``GUESS_LIMIT``."""
    parser = argparse.ArgumentParser(prog="python -m lab_utils.exercises.quiz strategies")
    parser.add_argument("folder", nargs="?", help="the bank's folder (default: the course's)")
    parser.add_argument("--seed", type=int, default=0, help="the quiz's seed, a whole number")
    parser.add_argument("--language", choices=LANGUAGES, default="en")
    opts = parser.parse_args(args)
    bank, seed, lang = load_bank(opts.folder), opts.seed, opts.language
    worst = 0.0
    for title, qs in (("in the bank's order", bank.questions),
                      (f"shuffled, seed {seed}", QuizRunner(bank, seed=seed, language=lang).questions)):
        table = strategy_scores(qs, lang)
        worst = max(worst, float(table["score"].max()))
        print(f"== {len(qs)} questions {title} ({lang}): share right of the questions each strategy answers ==")
        print(table.to_string(index=False, formatters={"score": "{:.0%}".format, "of_all": "{:.0%}".format}))
        print()
    print(f"best strategy: {worst:.0%} (limit {GUESS_LIMIT:.0%}): {'too guessable' if worst > GUESS_LIMIT else 'ok'}")
    return 1 if worst > GUESS_LIMIT else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab_utils.exercises.quiz glossary [PATH]``: write the glossary; ``check [FOLDER]``: validate the
    bank; ``strategies [FOLDER] [--seed N] [--language zh]``: how fixed guesses score (exit 1 over the limit)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("glossary", "check", "strategies"):
        print("usage: python -m lab_utils.exercises.quiz glossary [PATH] | check [FOLDER] | "
              "strategies [FOLDER] [--seed N] [--language en|zh]", file=sys.stderr)
        return 2
    try:
        if args[0] == "check":
            bank = load_bank(args[1] if len(args) > 1 else None)
            print(f"{len(bank)} questions in sections {bank.sections}: valid")
        elif args[0] == "strategies":
            return _strategies(args[1:])
        else:
            print(f"wrote {write_glossary(args[1] if len(args) > 1 else None)}")
    except ValueError as err:  # a bad bank (1), or an NVLAB_QUIZ_DIR that is no folder (EnvError: 2)
        print(f"error: {err}", file=sys.stderr)
        return 1 if isinstance(err, BankError) else 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
