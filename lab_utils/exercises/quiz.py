"""Lab 09's exam review: the question bank, its graded questions, a quiz runner, the glossary and the stack map.

``load_bank`` reads and validates the YAML bank (``lab_utils/data/quiz/``; ``NVLAB_QUIZ_DIR`` points at another);
``question.exercise("zh").check(answer)`` grades one answer through the exercise framework (both in ``quiz_bank``,
the quiz's phrases in ``quiz_text``, re-exported here). ``QuizRunner`` draws
questions by section with a fixed seed: ``next()``, ``answer(x)``, ``check(answers, section)``, ``score()``,
``missed()``. ``strategy_scores`` scores fixed ways of guessing against ``GUESS_LIMIT``. ``glossary`` is the
table of terms (``nvlab quiz glossary`` writes it to ``docs/glossary.md``); ``stack_map`` links the stack to the
labs. Importing this module reads no file: a bank is read when it is loaded.

Design notes: docs/internals.md#lab_utilsexercisesquizpy
"""

from __future__ import annotations

import hashlib
import html
import random
import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from lab_utils.args import check_int
from lab_utils.course.catalog import LABS
from lab_utils.exercises.framework import Exercise, Outcome, Status, Wrong, is_blank
from lab_utils.exercises.quiz_bank import (
    BANK_DIR,
    BYTE_UNITS,
    FORMS,
    QUIZ_ENV,
    Bank,
    BankError,
    Question,
    bank_folder,
    in_byte_unit,
    load_bank,
)
from lab_utils.exercises.quiz_text import LANGUAGES, _lang, _tr, outcome_line, ui_text

__all__ = [
    "BANK_DIR", "QUIZ_ENV", "FORMS", "LANGUAGES", "BankError", "Question", "Bank", "load_bank", "QuizRunner",
    "glossary", "stack_map", "STACK",
    "shuffled", "BYTE_UNITS", "in_byte_unit", "STRATEGIES", "GUESS_LIMIT", "strategy_scores", "ui_text",
    "outcome_line", "bank_folder",
]

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
        # each section's first n in the seed's order (all of them when n is None: pool[:None])
        self.questions = [q for s in wanted for q in sorted(bank.section(s), key=lambda q: _draw(seed, q.id))[:n]]
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
        """Every question not answered right (wrong, or blank), with the lab; the right answer and why only where an
        answer of yours was checked (as ``solution``: a blank says to answer it first)."""
        lang = self.language
        rows = []
        for q in self.questions:
            out = self.outcomes.get(q.id)
            if out is not None and out.correct:
                continue
            status = "not attempted" if out is None or out.status is Status.NOT_ATTEMPTED else out.status.value
            given = self.given.get(q.id)
            tried = q.id in self._exercises and self._exercises[q.id][1].attempted
            rows.append({"id": q.id, "section": q.section, "status": status,
                         "yours": None if is_blank(given) else given,
                         "answer": q.answer_text(lang) if tried else _tr("answer_first", lang),
                         "why": q.explanation[lang] if tried else "", "lab": q.lab_text(lang)})
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
    median = statistics.median(numbers) if numbers else 0.0
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


def stack_map(language: str = "en") -> StackMap:
    """The stack, bottom to top: one ``<details>`` per layer, its components, and links to the labs of this course
    that touched each (``../labs/NN_*.ipynb``, relative to a notebook in ``labs/`` or ``solutions/``)."""
    lang = _lang(language)
    labs = {lab.number: lab for lab in LABS}
    head = ("component", "labs", "what the lab did") if lang == "en" else ("组件", "实验", "实验做了什么")
    parts = ['<div class="nvlab-stack-map">']
    for layer_en, layer_zh, what_en, what_zh, components in STACK:
        name, what = (layer_en, what_en) if lang == "en" else (layer_zh, what_zh)
        parts.append(f"<details><summary><b>{html.escape(name)}</b>: {html.escape(what)}</summary>")
        parts.append(f"<table><tr><th>{head[0]}</th><th>{head[1]}</th><th>{head[2]}</th></tr>")
        for comp, numbers, did in components:
            links = [f'<a href="../labs/{html.escape(labs[n].filename)}">{n} {html.escape(labs[n].title)}</a>'
                     for n in numbers if n in labs]
            parts.append(f"<tr><td>{html.escape(comp)}</td><td>{'<br>'.join(links) or '-'}</td>"
                         f"<td>{html.escape(did)}</td></tr>")
        parts.append("</table></details>")
    parts.append("</div>")
    return StackMap("\n".join(parts))
