"""``nvlab quiz``: lab 09's question bank checked, its guessability measured, and ``docs/glossary.md`` written.

    nvlab quiz check [FOLDER]                          # validate a bank (default: the course's)
    nvlab quiz strategies [FOLDER] [--seed N] [--language zh]  # how fixed guesses score (exit 1 over the limit)
    nvlab quiz glossary [PATH]                         # write the glossary (generated: never edit it by hand)

Design notes: docs/internals.md#lab_utilsexercisesquizpy"""

from __future__ import annotations

import sys
from pathlib import Path

from lab_utils.course.catalog import repo_root
from lab_utils.exercises.quiz import GUESS_LIMIT, QuizRunner, glossary, strategy_scores
from lab_utils.exercises.quiz_bank import Bank, BankError, load_bank

GLOSSARY_PATH = repo_root() / "docs" / "glossary.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def glossary_markdown(bank: Bank) -> str:
    """The text of ``docs/glossary.md`` for ``bank``."""
    table = glossary(bank)
    lines = [
        "# Glossary: English ↔ 中文",
        "",
        "<!-- GENERATED from the question bank (lab_utils/data/quiz) by "
        "`nvlab quiz glossary`. Do not edit by hand: tests/test_quiz.py fails when this "
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


def strategies(folder: str | None = None, seed: int = 0, language: str = "en") -> int:
    """Print ``strategy_scores`` for the bank as written and for the whole-bank quiz of ``seed`` (as a student sees
    it); 1 when any strategy scores over ``GUESS_LIMIT``."""
    bank = load_bank(folder)
    worst = 0.0
    for title, qs in (("in the bank's order", bank.questions),
                      (f"shuffled, seed {seed}", QuizRunner(bank, seed=seed, language=language).questions)):
        table = strategy_scores(qs, language)
        worst = max(worst, float(table["score"].max()))
        print(f"== {len(qs)} questions {title} ({language}): share right of the questions each strategy answers ==")
        print(table.to_string(index=False, formatters={"score": "{:.0%}".format, "of_all": "{:.0%}".format}))
        print()
    print(f"best strategy: {worst:.0%} (limit {GUESS_LIMIT:.0%}): {'too guessable' if worst > GUESS_LIMIT else 'ok'}")
    return 1 if worst > GUESS_LIMIT else 0


def main(action: str, target: str | None = None, seed: int = 0, language: str = "en") -> int:
    """``nvlab quiz ACTION [TARGET]``: ``check`` the bank in folder TARGET, score its ``strategies``, or write the
    ``glossary`` to TARGET; a bad bank exits 1, an ``NVLAB_QUIZ_DIR`` that is no folder 2."""
    try:
        if action == "check":
            bank = load_bank(target)
            print(f"{len(bank)} questions in sections {bank.sections}: valid")
        elif action == "strategies":
            return strategies(target, seed, language)
        else:
            print(f"wrote {write_glossary(target)}")
    except ValueError as err:  # a bad bank (1), or an NVLAB_QUIZ_DIR that is no folder (EnvError: 2)
        print(f"error: {err}", file=sys.stderr)
        return 1 if isinstance(err, BankError) else 2
    return 0
