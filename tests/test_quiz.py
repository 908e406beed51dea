"""Lab 09's question bank and quiz: every question of the bank (the course's when it is there, else the fixture)
graded right, wrong and blank in both languages; answers read forgivingly; a broken bank named by file and question;
the runner headless with blanks; the glossary in sync with docs/glossary.md; the stack map's links."""

from __future__ import annotations

import copy
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from lab_utils.course import catalog
from lab_utils.exercises import quiz
from lab_utils.exercises.framework import Status
from nvlab import cli
from nvlab.ops import quiz as quiz_cmd

FIXTURE = Path(__file__).parent / "data" / "quiz_fixture"
REAL = (quiz.BANK_DIR / "s1_stack.yaml").exists()
BANK_DIR = quiz.BANK_DIR if REAL else FIXTURE
BANK = quiz.load_bank(BANK_DIR)
IDS = [q.id for q in BANK]


def _wrong_answers(q: quiz.Question) -> list:
    """Plausible wrong answers of each form."""
    if q.form == "single":
        return [k for k in q.choices if k != q.answer][:2]
    if q.form == "multi":
        out = []
        if len(q.answer) > 1:
            out.append(q.answer[:-1])  # one missing
        if extra := [k for k in q.choices if k not in q.answer]:
            out.append([*q.answer, extra[0]])  # one too many
        return out
    if q.form == "numeric":
        v = q.answer["value"]
        return [v * 2, v / 2] if v else [1, -1]
    if q.form == "match":
        keys = list(q.answer)
        swapped = dict(q.answer)
        swapped[keys[0]], swapped[keys[1]] = q.answer[keys[1]], q.answer[keys[0]]
        return [swapped, {keys[0]: q.answer[keys[0]]}]  # two pairs swapped; all but one left unpaired
    order = list(q.answer)
    return [order[1:2] + order[:1] + order[2:], list(reversed(order)), order[:-1]]


def _right_written_differently(q: quiz.Question) -> list:
    if q.form == "single":
        return [f"  {q.answer.upper()} ", q.choices[q.answer]["en"], q.choices[q.answer]["zh"]]
    if q.form == "multi":
        return [", ".join(k.upper() for k in q.answer), tuple(reversed(q.answer)), set(q.answer)]
    if q.form == "numeric":
        v = q.answer["value"]
        return [str(v), f"{v} {q.answer['unit']['en']}".strip(), v * (1 + q.answer["rel_tol"] / 2)]
    if q.form == "match":
        return [", ".join(f"{a}:{b}" for a, b in q.answer.items()), list(q.answer.items())[::-1],
                {a.upper(): b for a, b in q.answer.items()}]
    return [" > ".join(q.answer), tuple(q.answer)]


@pytest.mark.parametrize("language", quiz.LANGUAGES)
@pytest.mark.parametrize("qid", IDS)
def test_every_question_right_wrong_and_blank(qid, language):
    q = BANK.get(qid)
    ex = q.exercise(language)
    for right in [q.key(), *_right_written_differently(q)]:
        out = ex.check(right, quiet=True)
        assert out.status is Status.CORRECT, (right, out.message)
    wrongs = _wrong_answers(q)
    assert len(wrongs) >= 1
    for i, wrong in enumerate([wrongs[0], *wrongs]):
        out = ex.check(wrong, quiet=True)
        assert out.status is Status.INCORRECT, (wrong, out.message)
        # The first wrong answer gets a retry; from the second on, the answer and the explanation come with it.
        assert (q.explanation[language] in out.message) is (i > 0), (i, out.message)
        assert (q.answer_text(language) in out.message) is (i > 0), (i, out.message)
    for blank in (None, ...):
        assert ex.check(blank, quiet=True).status is Status.NOT_ATTEMPTED


@pytest.mark.parametrize("qid", IDS)
def test_both_languages_have_the_same_keys(qid):
    q = BANK.get(qid)
    texts = [q.prompt, q.explanation, *q.terms]
    if q.form == "match":
        texts += [*q.choices["left"].values(), *q.choices["right"].values()]
    elif q.choices:
        texts += list(q.choices.values())
    if q.form == "numeric":
        texts.append(q.answer["unit"])
    if q.lab:
        texts += [t for t in (q.lab.get("where"), q.lab.get("note")) if t]
    for t in texts:
        assert set(t) == set(quiz.LANGUAGES), (qid, t)
    assert q.prompt["en"].strip() and q.prompt["zh"].strip()
    assert q.text("en") != q.text("zh")


def test_the_bank_covers_every_section_and_form():
    assert BANK.sections == [1, 2, 3, 4, 5, 6]
    assert all(BANK.section(s) for s in BANK.sections)
    assert {q.form for q in BANK} == set(quiz.FORMS)


# --- the messages ----------------------------------------------------------------------------------------------

FIX = quiz.load_bank(FIXTURE)


def _msg(qid: str, value, language: str = "en") -> str:
    """The message of a second wrong answer ``value`` (the first is only asked to try again)."""
    ex = FIX.get(qid).exercise(language)
    ex.check(value, quiet=True)
    out = ex.check(value, quiet=True)
    assert out.status is Status.INCORRECT, out.message
    return out.message


def test_multi_says_which_keys_are_missing_and_extra():
    assert "missing: d" in _msg("s3-nemo-parts", "a,b")
    assert "not part of the answer: c" in _msg("s3-nemo-parts", ["a", "b", "c", "d"])
    assert "漏选: d" in _msg("s3-nemo-parts", "a b", "zh")


def test_match_says_which_pairs_are_wrong():
    msg = _msg("s1-libraries", "nccl:2, cublas:1, dali:3")
    assert "NCCL ↔ dense linear algebra" in msg and "cuBLAS ↔ collectives" in msg
    assert "DALI" not in msg.split("Answer")[0]
    assert "not paired: DALI" in _msg("s1-libraries", {"nccl": "1", "cublas": "2"})


def test_order_names_the_first_item_out_of_place():
    assert "position 2: serve" in _msg("s2-layers", "export, serve, engine, package")
    assert "missing: package" in _msg("s2-layers", "export engine serve")


def test_numeric_names_the_likely_slip():
    assert "K and V" in _msg("s2-kv-bytes", 64) and "too low" in _msg("s2-kv-bytes", 64)
    assert "bits" in _msg("s2-kv-bytes", "1024 KiB")
    assert "a number" in _msg("s2-kv-bytes", "lots")


def test_more_forgiving_forms():
    assert FIX.get("s3-nemo-parts").exercise().check("ABD", quiet=True).correct  # one-letter keys run together
    assert FIX.get("s6-domains").exercise().check("clara - health; isaac: robots; riva -> speech", quiet=True).correct
    assert FIX.get("s1-libraries").exercise().check([("NCCL", "1"), ("cuBLAS", "2"), ("dali", "3")], quiet=True).correct


@pytest.mark.parametrize("language", quiz.LANGUAGES)
def test_a_wrong_answer_gets_a_retry_before_the_key_is_shown(language):
    runner = quiz.QuizRunner(BANK, language=language, seed=3)
    for q in runner.questions:
        wrong = _wrong_answers(q)[0]
        first = runner.check({q.id: wrong}, section=q.section, quiet=True)
        first = next(o for o in first if o.exercise.endswith(q.id))
        assert first.status is Status.INCORRECT
        assert q.explanation[language] not in first.message and q.answer_text(language) not in first.message, \
            first.message
        assert f"runner.hint({q.id!r})" in first.message, first.message  # where to look before trying again
        if q.form == "multi":  # which keys are missing would be the key itself
            assert not re.search(r"(missing|漏选): [a-z]", first.message), first.message
        second = runner.check({q.id: wrong}, section=q.section, quiet=True)
        second = next(o for o in second if o.exercise.endswith(q.id))
        assert q.explanation[language] in second.message and q.answer_text(language) in second.message


def test_the_messages_name_the_notebooks_dict_and_call(capsys):
    """The notebook fills ``answers_s1`` for section 1 and asks for hints with ``runner.hint("id")``."""
    runner = quiz.QuizRunner(BANK, n=3, seed=0)
    q = runner.in_section(1)[0]
    blank = runner.check({}, section=1, quiet=True)[0]
    assert f"`answers_s1[{q.id!r}]`" in blank.message and f"`runner.hint({q.id!r})`" in blank.message, blank.message
    assert ".hint()`" not in blank.message.replace(f"runner.hint({q.id!r})`", "")
    wrong = runner.check({q.id: _wrong_answers(q)[0]}, section=1, quiet=True)[0]
    assert wrong.message.startswith(f"`answers_s1[{q.id!r}]` = "), wrong.message
    runner.next(show=False)
    assert "`runner.answer(...)` = " in runner.answer(_wrong_answers(runner._current)[0], quiet=True).message


def test_hints_come_one_at_a_time(capsys):
    runner = quiz.QuizRunner(FIX, sections=[1])
    first, second, again = (runner.hint("s1-ceiling") for _ in range(3))
    assert first.startswith("Hint 1/2") and second.startswith("Hint 2/2") and first != second
    assert again.startswith("No more hints: all 2 were shown") and "`runner.solution('s1-ceiling')`" in again
    assert capsys.readouterr().out.count("Hint ") == 2  # each call prints its one hint


def test_runner_hint_and_solution(capsys):
    runner = quiz.QuizRunner(FIX, sections=[1])
    assert "driver compatibility" in runner.hint("s1-ceiling") and "00" in runner.hint("s1-ceiling")
    shown = next(q for q in runner.questions if q.id == "s1-ceiling")
    before = runner.solution("s1-ceiling")  # nothing answered yet: what to do first, not the answer
    assert before.startswith("The answer comes after yours was checked") and "The newest CUDA" not in before
    runner.check({"s1-ceiling": "z"}, section=1, quiet=True)  # an attempt, checked (wrong)
    assert f"{shown.answer}) The newest CUDA" in runner.solution("s1-ceiling")  # the letter this quiz shows
    plain = quiz.QuizRunner(FIX, sections=[1], shuffle=False)
    plain.check({"s1-ceiling": "b"}, section=1, quiet=True)
    assert "b) The newest CUDA" in plain.solution("s1-ceiling")
    assert "Hint 1/2" in capsys.readouterr().out
    zh = quiz.QuizRunner(FIX, sections=[1], language="zh")
    assert zh.solution("s1-ceiling").startswith("先作答并检查")


def test_an_answer_that_names_its_byte_unit_is_read_in_it():
    kib = FIX.get("s2-kv-bytes").exercise()  # asks KiB: 128
    for right in ("131072 bytes", "0.125 MiB", "128 kib", "131.072 kB"):
        assert kib.check(right, quiet=True).correct, right
    assert "GB where GiB" in _msg("s2-kv-bytes", 128 * 2**30 / 1e9)  # the GB/GiB slip is named
    assert quiz.in_byte_unit("150.8 GB", "GiB") == pytest.approx(140.44, rel=1e-3)
    assert quiz.in_byte_unit("150.8", "GiB") == "150.8" and quiz.in_byte_unit("3 s", "GiB") == "3 s"
    assert quiz.in_byte_unit("150.8 GB", "ms") == "150.8 GB"  # not a byte question: left to the unit check


def test_unknown_keys_are_named_not_crashed():
    assert "is not one of the choices" in _msg("s1-ceiling", "z")
    assert "is not one of the choices" in _msg("s3-nemo-parts", "a, q")


def test_hints_and_solution_come_from_the_question():
    ex = FIX.get("s1-ceiling").exercise("zh")
    assert "驱动兼容性与 CUDA 上限" in ex.hints[0] and "00" in ex.hints[1]
    assert "已安装驱动支持的最高 CUDA 版本" in ex.solution_text


# --- loading ----------------------------------------------------------------------------------------------------


def _broken(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "bank"
    shutil.copytree(FIXTURE, folder)
    path = folder / "s1_stack.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    return folder


@pytest.mark.parametrize(("edit", "words"), [
    (lambda d: d["questions"][0].update(answer="z"), r"s1_stack.yaml, question 's1-ceiling': answer names \['z'\]"),
    (lambda d: d["questions"][1]["prompt"].pop("zh"), r"s1_stack.yaml, question 's1-libraries': does not match "
                                                      r"schema.json at questions/1/prompt"),
    (lambda d: d["questions"][0].update(form="essay"), r"question 's1-ceiling'.*form"),
    (lambda d: d["questions"][1].update(id="s1-ceiling"), r"'s1-ceiling': the id is used twice"),
    (lambda d: d["questions"][0].update(rows=["9.nowhere"]), r"'s1-ceiling': rows \['9.nowhere'\] are not in rows"),
    (lambda d: d["questions"][1]["answer"].update(nccl="9"), r"'s1-libraries': answer pairs with \['9'\]"),
])
def test_a_broken_bank_names_the_file_and_the_question(tmp_path, edit, words):
    folder = _broken(tmp_path, edit)
    with pytest.raises(quiz.BankError, match=words):
        quiz.load_bank(folder)


def test_a_bank_without_its_own_schema_is_held_to_the_courses(tmp_path):
    folder = _broken(tmp_path, lambda d: None)
    assert len(quiz.load_bank(folder)) == len(FIX)  # the fixture's own schema allows its row ids ("1.driver")
    (folder / "schema.json").unlink()
    with pytest.raises(quiz.BankError, match=r"'s1-ceiling': does not match schema.json at questions/0/rows/0"):
        quiz.load_bank(folder)


def test_an_empty_folder_says_where_it_looked(tmp_path, monkeypatch):
    with pytest.raises(quiz.BankError, match=f"no question bank in {re.escape(str(tmp_path))}"):
        quiz.load_bank(tmp_path)
    monkeypatch.setenv(quiz.QUIZ_ENV, str(FIXTURE))
    assert quiz.bank_folder() == FIXTURE and len(quiz.load_bank()) == len(FIX)


def test_the_bank_check_command(capsys, tmp_path):
    assert cli.main(["quiz", "check", str(FIXTURE)]) == 0
    assert "valid" in capsys.readouterr().out
    assert cli.main(["quiz", "check", str(tmp_path)]) == 1  # no bank there: one line naming the folder
    assert f"no question bank in {tmp_path}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        cli.main(["quiz", "nonsense"])
    assert stop.value.code == 2


# --- the runner ------------------------------------------------------------------------------------------------


def test_a_runner_with_blanks_runs_headless_and_scores_zero(capsys):
    runner = quiz.QuizRunner(BANK, seed=0)
    for s in runner.sections:
        outs = runner.check(None, section=s)
        assert all(o.status is Status.NOT_ATTEMPTED for o in outs)
    while runner.next() is not None:
        assert runner.answer(None).status is Status.NOT_ATTEMPTED
    score = runner.score()
    assert list(score["section"]) == BANK.sections and (score["right"] == 0).all() and (score["answered"] == 0).all()
    assert len(runner.missed()) == len(BANK) and set(runner.missed()["status"]) == {"not attempted"}
    assert set(runner.missed()["answer"]) == {"answer it first"}  # a blank is no attempt: no answer given away
    assert "not attempted" in capsys.readouterr().out


def test_the_key_scores_full_marks_in_both_languages():
    for language in quiz.LANGUAGES:
        runner = quiz.QuizRunner(BANK, language=language)
        for s in runner.sections:
            assert all(o.correct for o in runner.check(runner.key(s), section=s, quiet=True))
        assert (runner.score()["score"] == 1.0).all() and runner.missed().empty


def test_one_at_a_time_with_feedback(capsys):
    runner = quiz.QuizRunner(FIX, sections=[1], language="zh")
    with pytest.raises(RuntimeError, match="next"):
        runner.answer("b")
    q = runner.next()
    assert q is not None and q.id in capsys.readouterr().out
    out = runner.answer(q.key())
    printed = capsys.readouterr().out
    assert out.correct and q.explanation["zh"] in printed
    q2 = runner.next()
    assert not runner.answer("wrong, wrong").correct
    assert runner.next() is None
    missed = runner.missed()
    assert list(missed["id"]) == [q2.id] and missed["status"].iloc[0] == "incorrect"
    assert missed["answer"].iloc[0] == q2.answer_text("zh") and missed["why"].iloc[0]  # answered: the answer shows
    assert runner.score().loc[0, "right"] == 1


def test_a_fixed_seed_gives_a_reproducible_order():
    orders = {seed: [q.id for q in quiz.QuizRunner(FIX, seed=seed).questions] for seed in range(8)}
    assert [q.id for q in quiz.QuizRunner(FIX, seed=3).questions] == orders[3]
    assert len({tuple(o) for o in orders.values()}) > 1
    sections = [q.section for q in quiz.QuizRunner(FIX, seed=5).questions]
    assert sections == sorted(sections)  # by section, shuffled within


# --- shuffled choices ---------------------------------------------------------------------------------------


def _texts(q: quiz.Question, keys) -> list[str]:
    return [q.choices[k]["en"] for k in keys]


def _pairs(q: quiz.Question) -> set[tuple[str, str]]:
    return {(q.choices["left"][a]["en"], q.choices["right"][b]["en"]) for a, b in q.answer.items()}


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_shuffled_letters_follow_their_choices(seed):
    runner = quiz.QuizRunner(BANK, seed=seed)
    moved = 0
    for shown in runner.questions:
        bank_q = BANK.get(shown.id)
        if shown.form in ("single", "multi"):
            right = [shown.answer] if shown.form == "single" else shown.answer
            bank_right = [bank_q.answer] if bank_q.form == "single" else bank_q.answer
            assert sorted(_texts(shown, right)) == sorted(_texts(bank_q, bank_right))  # the key followed its choice
            assert shown._keys() == [chr(ord("a") + i) for i in range(len(shown.choices))]  # lettered as shown
            for k in right:  # what the student reads beside a letter is what that letter is graded as
                assert f"   {k}) {shown.choices[k]['en']}" in shown.text()
            ex = runner._exercise(shown)
            assert ex.check(shown.key(), quiet=True).correct
            if shown.form == "single" and shown.answer != bank_q.answer:
                moved += 1  # the bank's letter now names another choice: wrong
                assert ex.check(bank_q.answer, quiet=True).status is Status.INCORRECT
                assert ex.check(bank_q.choices[bank_q.answer]["en"], quiet=True).correct  # the text still is right
        elif shown.form == "match":
            assert _pairs(shown) == _pairs(bank_q)
        elif shown.form == "order":
            assert _texts(shown, shown.answer) == _texts(bank_q, bank_q.answer)
        else:
            assert shown == bank_q
    assert moved >= len(BANK) // 10  # shuffling moved letters


def test_shuffling_is_fixed_by_the_seed():
    def letters(seed):
        return [q.key() for q in quiz.QuizRunner(BANK, seed=seed).questions]
    assert letters(3) == letters(3) and letters(3) != letters(4)
    plain = quiz.QuizRunner(BANK, shuffle=False)
    assert all(q is BANK.get(q.id) for q in plain.questions)


@pytest.mark.parametrize("seed", range(12))
def test_every_letter_is_dealt_about_as_often(seed):
    """A single-choice question's right letter is dealt, not drawn: among questions with n choices the letters'
    counts differ by at most one, whatever the seed (drawn letters would favour one in some seeds)."""
    for n_per_section in (None, 3):
        runner = quiz.QuizRunner(BANK, seed=seed, n=n_per_section)
        counts: dict[int, dict[str, int]] = {}
        for q in runner.questions:
            if q.form == "single":
                per = counts.setdefault(len(q.choices), dict.fromkeys(q._keys(), 0))
                per[q.answer] += 1
        for per in counts.values():
            assert max(per.values()) - min(per.values()) <= 1, (seed, n_per_section, counts)


def test_the_runner_grades_the_question_it_shows():
    runner = quiz.QuizRunner(BANK, seed=2)
    q = runner.next(show=False)
    assert runner.answer(q.key(), quiet=True).correct
    runner.questions[0] = BANK.get(q.id)  # another object for the same id (a panel's test does this): graded as it
    runner._pos = 0
    assert runner.answer(runner.next(show=False).key(), quiet=True).correct


# --- guessing ----------------------------------------------------------------------------------------------------


def _over(table):
    return table[table["score"] > quiz.GUESS_LIMIT][["strategy", "right", "answered", "score"]].to_dict("records")


@pytest.mark.skipif(not REAL, reason="the course's question bank (lab_utils/data/quiz) is not there yet")
@pytest.mark.parametrize("language", quiz.LANGUAGES)
def test_no_fixed_strategy_passes_the_bank_as_written(language):
    table = quiz.strategy_scores(BANK, language)
    assert set(table["strategy"]) >= {"always a", "always b", "always c", "always d", "always the longest choice",
                                      "the first two", "all of them", "pairs in listed order"}
    assert (table["answered"] > 0).all()
    assert not _over(table), _over(table)


@pytest.mark.skipif(not REAL, reason="the course's question bank (lab_utils/data/quiz) is not there yet")
@pytest.mark.parametrize("language", quiz.LANGUAGES)
def test_no_fixed_strategy_passes_a_shuffled_quiz_on_any_of_40_seeds(language):
    """Every strategy (by place, by length, by the words a choice shares with the question, the bank's median number,
    all or none of several) at most ``GUESS_LIMIT`` of the questions it answers, whatever the seed."""
    assert {"most words shared with the question", "the two sharing most words", "pairs sharing most words",
            "the median answer of the bank", "a number in the question", "none of them"} <= set(quiz.STRATEGIES)
    over = {}
    for seed in range(40):
        table = quiz.strategy_scores(quiz.QuizRunner(BANK, seed=seed, language=language).questions, language)
        assert (table[table["forms"] == "numeric"]["answered"] > 0).all()
        if _over(table):
            over[seed] = _over(table)
    assert not over, over


def test_the_shared_words_strategy_can_fail():
    """A bank whose right choice repeats the question's words is caught by the word-sharing guess."""
    echoed = [replace(q, prompt={lang: f"{q.prompt[lang]} {q._choice_text(q.answer, lang)}" for lang in quiz.LANGUAGES})
              if q.form == "single" else q for q in BANK]
    for language in quiz.LANGUAGES:
        table = quiz.strategy_scores(echoed, language).set_index("strategy")
        assert table.loc["most words shared with the question", "score"] > 0.9, language


def test_the_strategy_check_can_fail():
    """A bank whose key is always the first choice (as the course's once was) is caught."""
    first = [q.reordered([q.answer] + [k for k in q.choices if k != q.answer]) if q.form == "single" else q
             for q in BANK]
    table = quiz.strategy_scores(first).set_index("strategy")
    assert table.loc["always a", "score"] == 1.0 and table.loc["always b", "score"] == 0.0


def test_the_strategies_command(capsys, monkeypatch):
    code = quiz_cmd.main("strategies", str(BANK_DIR), seed=3)
    out = capsys.readouterr().out
    assert "always the longest choice" in out and "seed 3" in out and "limit 35%" in out
    assert code == (1 if "too guessable" in out else 0) and (code == 0 or not REAL)
    assert quiz_cmd.main("strategies", str(BANK_DIR), language="zh") == code
    monkeypatch.setattr(quiz_cmd, "GUESS_LIMIT", 0.0)  # every strategy that scores at all is now too much
    assert quiz_cmd.main("strategies", str(BANK_DIR)) == 1 and "too guessable" in capsys.readouterr().out


def test_sections_and_n_choose_questions():
    runner = quiz.QuizRunner(FIX, sections=[2, 1], n=1)
    assert [q.section for q in runner.questions] == [2, 1]
    assert len(quiz.QuizRunner(FIX, sections=[1]).questions) == len(FIX.section(1))
    with pytest.raises(ValueError, match="not in the bank"):
        quiz.QuizRunner(FIX, sections=[7])
    with pytest.raises(ValueError, match="n=0"):
        quiz.QuizRunner(FIX, n=0)
    with pytest.raises(ValueError, match="language"):
        quiz.QuizRunner(FIX, language="fr")


def test_answers_for_other_questions_are_ignored_not_crashed(capsys):
    runner = quiz.QuizRunner(FIX, sections=[1])
    runner.check({"s5-canary": "a"}, section=1)
    assert "ignored: s5-canary" in capsys.readouterr().out
    with pytest.raises(TypeError, match="dict"):
        runner.check(["b"], section=1)


def test_the_key_is_a_copy():
    q = FIX.get("s3-nemo-parts")
    k = q.key()
    k.append("c")
    assert q.key() == ["a", "b", "d"]
    assert copy.deepcopy(FIX.get("s1-libraries").key()) == {"nccl": "1", "cublas": "2", "dali": "3"}


# --- glossary and stack map --------------------------------------------------------------------------------------


def test_glossary_is_deduplicated_and_sorted():
    table = quiz.glossary(FIX)
    assert list(table["en"]) == sorted(table["en"], key=str.lower)
    assert len(table) == len(set(zip(table["en"], table["zh"], strict=True)))
    assert table.set_index("en").loc["driver", "zh"] == "驱动程序"  # used twice in the fixture, listed once


def test_write_glossary_writes_the_markdown(tmp_path):
    path = quiz_cmd.write_glossary(tmp_path / "g.md", FIX)
    text = path.read_text(encoding="utf-8")
    assert text == quiz_cmd.glossary_markdown(FIX) and "| KV cache | KV 缓存 | 2 |" in text and "Do not edit" in text


@pytest.mark.skipif(not REAL, reason="the course's question bank (lab_utils/data/quiz) is not there yet")
def test_committed_glossary_is_what_write_glossary_writes():
    committed = quiz_cmd.GLOSSARY_PATH.read_text(encoding="utf-8")
    assert committed == quiz_cmd.glossary_markdown(BANK), (
        "docs/glossary.md is generated: run `nvlab quiz glossary` and commit it")


def test_the_glossary_file_is_there_and_says_it_is_generated():
    text = quiz_cmd.GLOSSARY_PATH.read_text(encoding="utf-8")
    assert text.startswith("# Glossary") and "nvlab quiz glossary" in text


def test_stack_map_links_every_lab_it_names():
    html = quiz.stack_map()
    assert html.count("<details") == len(quiz.STACK) and html._repr_html_() == html
    links = set(re.findall(r'href="\.\./labs/([^"]+)"', html))
    assert links and links <= {lab.filename for lab in catalog.LABS}
    labs_dir = catalog.repo_root() / "labs"
    present = {p.name for p in labs_dir.glob("*.ipynb")}
    assert links - {catalog.lab_by_number("09").filename} <= present
    for layer in ("driver", "CUDA", "frameworks", "industry solutions"):
        assert f"<b>{layer}</b>" in html
    assert "<b>驱动</b>" in quiz.stack_map("zh")


def test_lab09_is_in_the_catalog():
    lab = catalog.lab_by_number("09")
    assert lab.filename == "09_exam_review.ipynb" and lab.needs == ("torch-cuda",)
