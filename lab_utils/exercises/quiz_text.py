"""The quiz's own phrases in both languages of the bank (English, Chinese): feedback, the panel's words, and what
a hint or the answer says before it has anything to give.

Design notes: docs/internals.md#lab_utilsexercisesquizpy
"""

from __future__ import annotations

from lab_utils.exercises.framework import Outcome, Status

LANGUAGES = ("en", "zh")

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
    "answer_first": {"en": "answer it first", "zh": "请先作答"},
    "solution_first": {"en": "The answer comes after yours was checked: answer it (runner.answer or runner.check), "
                             "then call this again ({hint} gives a hint meanwhile).",
                       "zh": "先作答并检查（runner.answer 或 runner.check），再查看答案；"
                             "在此之前可用 {hint} 查看提示。"},
}



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
