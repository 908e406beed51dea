"""Integrity of lab 09's question bank (lab_utils/data/quiz/): data only, read with yaml.safe_load.

Every section file validates against schema.json; ids are unique; every answer refers to keys that exist;
every text is given in English and Simplified Chinese; every row of rows.yaml (SYLLABUS.md §1-§6) is
covered by a question and every question's rows exist; no fixed way of answering ("always a", the longest
choice, the first three) scores over 35 % of the bank as written. The checks are also run on broken
questions, so that they are seen to fail.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from lab_utils.course.catalog import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parents[1]
QUIZ = ROOT / "lab_utils" / "data" / "quiz"
SECTION_FILES = {
    1: "s1_stack.yaml",
    2: "s2_inference.yaml",
    3: "s3_nemo.yaml",
    4: "s4_lifecycle.yaml",
    5: "s5_mlops.yaml",
    6: "s6_industry.yaml",
}
FORMS = ("single", "multi", "numeric", "match", "order")
MIN_QUESTIONS = 80
MIN_PER_FORM = 3

# Literal on purpose: deleting one of these rows from rows.yaml must fail a test.
INDUSTRY_ROWS = [
    "s6.clara", "s6.drive", "s6.isaac", "s6.metropolis", "s6.omniverse", "s6.cosmos", "s6.riva",
    "s6.merlin", "s6.morpheus", "s6.holoscan", "s6.aerial", "s6.earth2", "s6.jetson", "s6.egx_igx",
]
LIFECYCLE_ROWS = [
    "s4.stage.data_prep", "s4.stage.training", "s4.stage.optimization", "s4.stage.deployment",
    "s4.stage.monitoring",
]
CJK = re.compile(r"[\u4e00-\u9fff]")


def _load(name: str) -> Any:
    with open(QUIZ / name, encoding="utf-8") as f:
        return yaml.safe_load(f)


SCHEMA = json.loads((QUIZ / "schema.json").read_text(encoding="utf-8"))
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
SECTIONS = {n: _load(name) for n, name in SECTION_FILES.items()}
ROWS = _load("rows.yaml")
QUESTIONS = [q for n in sorted(SECTIONS) for q in SECTIONS[n]["questions"]]


def schema_errors(section: dict) -> list[str]:
    """Every schema violation of one section file, as 'path: message'."""
    errors = sorted(VALIDATOR.iter_errors(section), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def answer_problems(q: dict) -> list[str]:
    """What is wrong with a question's answer against its own choices (empty when nothing is)."""
    form, answer, choices = q.get("form"), q.get("answer"), q.get("choices")
    problems = []
    if form == "single":
        if not isinstance(choices, dict) or answer not in choices:
            problems.append(f"answer {answer!r} is not one of the choices {sorted(choices or {})}")
    elif form == "multi":
        if not isinstance(answer, list) or len(answer) < 2:
            problems.append(f"multi needs >= 2 correct keys, got {answer!r}")
        elif len(set(answer)) != len(answer):
            problems.append(f"repeated keys in {answer!r}")
        missing = [k for k in answer or [] if k not in (choices or {})]
        if missing:
            problems.append(f"answer keys {missing} are not among the choices {sorted(choices or {})}")
        if isinstance(answer, list) and choices and len(set(answer)) >= len(choices):
            problems.append("every choice is correct: nothing to tell apart")
    elif form == "numeric":
        value = (answer or {}).get("value") if isinstance(answer, dict) else None
        rel_tol = (answer or {}).get("rel_tol") if isinstance(answer, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            problems.append(f"numeric value {value!r} is not a finite number")
        if not isinstance(rel_tol, (int, float)) or isinstance(rel_tol, bool) or not 0 < rel_tol <= 0.2:
            problems.append(f"rel_tol {rel_tol!r} is not in (0, 0.2]")
        if choices is not None:
            problems.append("a numeric question has no choices")
    elif form == "match":
        left = (choices or {}).get("left") or {}
        right = (choices or {}).get("right") or {}
        if not isinstance(answer, dict):
            problems.append(f"match answer must map left keys to right keys, got {answer!r}")
        else:
            if set(answer) != set(left):
                problems.append(
                    f"answer's left keys {sorted(answer)} differ from the choices' left keys {sorted(left)}"
                )
            bad = sorted({v for v in answer.values() if v not in right})
            if bad:
                problems.append(f"answer's right keys {bad} are not among {sorted(right)}")
            if len(answer) < 3:
                problems.append("match needs >= 3 pairs")
    elif form == "order":
        if not isinstance(answer, list) or sorted(answer) != sorted(choices or {}):
            problems.append(f"order answer {answer!r} is not a permutation of the keys {sorted(choices or {})}")
        elif len(answer) < 3:
            problems.append("order needs >= 3 items")
    else:
        problems.append(f"unknown form {form!r}")
    return problems


def iter_texts(node: Any, path: str = ""):
    """Every bilingual text in a structure: a mapping with an 'en' or a 'zh' key, with its path."""
    if isinstance(node, dict):
        if "en" in node or "zh" in node:
            yield path, node
            return
        for key, value in node.items():
            yield from iter_texts(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from iter_texts(value, f"{path}[{i}]")


def text_problems(node: Any) -> list[str]:
    """Texts that lack a language, have an empty one, or carry keys other than en and zh."""
    problems = []
    for path, text in iter_texts(node):
        if set(text) != {"en", "zh"}:
            problems.append(f"{path}: keys {sorted(text)}, expected exactly ['en', 'zh']")
        for lang in ("en", "zh"):
            value = text.get(lang)
            if not isinstance(value, str) or not value.strip():
                problems.append(f"{path}: {lang} is missing or empty")
    return problems


# ---------------------------------------------------------------- schema and files


def test_schema_is_a_valid_draft_2020_12_schema():
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_exactly_the_six_section_files():
    on_disk = sorted(p.name for p in QUIZ.glob("s[0-9]_*.yaml"))
    assert on_disk == sorted(SECTION_FILES.values())


@pytest.mark.parametrize("section", sorted(SECTION_FILES))
def test_section_file_validates(section):
    data = SECTIONS[section]
    errors = schema_errors(data)
    assert not errors, f"{SECTION_FILES[section]}:\n" + "\n".join(errors)
    assert data["section"] == section


# ---------------------------------------------------------------- questions


def test_question_ids_unique():
    counts = collections.Counter(q["id"] for q in QUESTIONS)
    assert not [i for i, n in counts.items() if n > 1], "duplicate question ids"


@pytest.mark.parametrize("q", QUESTIONS, ids=lambda q: q["id"])
def test_answer_refers_to_choices(q):
    assert answer_problems(q) == []


@pytest.mark.parametrize("q", QUESTIONS, ids=lambda q: q["id"])
def test_texts_bilingual(q):
    assert text_problems(q) == []
    # The Chinese prompt and explanation are Chinese, not a copy of the English.
    for field in ("prompt", "explanation"):
        assert CJK.search(q[field]["zh"]), f"{q['id']}: {field}.zh has no Chinese characters"
        assert q[field]["zh"] != q[field]["en"]


def test_section_titles_bilingual():
    for n, data in SECTIONS.items():
        assert text_problems(data["title"]) == [], SECTION_FILES[n]


def test_glossary_consistent():
    """One English term has one Chinese translation across the bank (and the reverse), so the glossary
    lab 09 builds from the questions' terms has one entry per term."""
    zh_of, en_of = collections.defaultdict(set), collections.defaultdict(set)
    for q in QUESTIONS:
        for term in q["terms"]:
            zh_of[term["en"]].add(term["zh"])
            en_of[term["zh"]].add(term["en"])
    clashes = {k: sorted(v) for k, v in {**zh_of, **en_of}.items() if len(v) > 1}
    assert not clashes, f"terms translated more than one way: {clashes}"


def test_lab_pointers_name_existing_labs():
    labs = {p.name.split("_", 1)[0] for p in (ROOT / "solutions").glob(NOTEBOOK_GLOB)}
    pointers = {q["id"]: q["lab"]["lab"] for q in QUESTIONS if "lab" in q}
    assert pointers, "no question points to a lab"
    unknown = {qid: lab for qid, lab in pointers.items() if lab not in labs}
    assert not unknown, f"lab pointers to labs that do not exist: {unknown}"


def test_bank_size_and_forms():
    assert len(QUESTIONS) >= MIN_QUESTIONS
    forms = collections.Counter(q["form"] for q in QUESTIONS)
    assert all(forms[f] >= MIN_PER_FORM for f in FORMS), dict(forms)
    # A realistic mix: about half single-choice, the rest spread over the other forms.
    assert 0.35 <= forms["single"] / len(QUESTIONS) <= 0.65, dict(forms)


# ---------------------------------------------------------------- rows


def test_rows_file_well_formed():
    ids = [r["id"] for r in ROWS]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    for r in ROWS:
        assert set(r) == {"id", "section", "en", "zh"}, r
        assert re.fullmatch(r"s[1-6](\.[a-z0-9_]+)+", r["id"]), r["id"]
        assert r["id"].startswith(f"s{r['section']}."), r["id"]
        assert r["en"].strip() and r["zh"].strip(), r["id"]
    assert {r["section"] for r in ROWS} == set(SECTION_FILES)


def test_rows_include_industry_solutions_and_lifecycle_stages():
    ids = {r["id"] for r in ROWS}
    assert len(INDUSTRY_ROWS) == 14 and len(LIFECYCLE_ROWS) == 5
    missing = [r for r in INDUSTRY_ROWS + LIFECYCLE_ROWS if r not in ids]
    assert not missing, f"rows.yaml lacks {missing}"


def test_every_question_row_exists():
    ids = {r["id"] for r in ROWS}
    unknown = {q["id"]: [r for r in q["rows"] if r not in ids] for q in QUESTIONS}
    unknown = {k: v for k, v in unknown.items() if v}
    assert not unknown, f"questions name rows that rows.yaml lacks: {unknown}"


def test_every_row_covered():
    covered = {r for q in QUESTIONS for r in q["rows"]}
    uncovered = [r["id"] for r in ROWS if r["id"] not in covered]
    assert not uncovered, f"rows no question covers: {uncovered}"


def test_questions_cover_rows_of_their_own_section():
    for n, data in SECTIONS.items():
        for q in data["questions"]:
            assert any(r.startswith(f"s{n}.") for r in q["rows"]), f"{q['id']} covers no row of section {n}"


# ---------------------------------------------------------------- the checks can fail


def _first(form: str) -> dict:
    return copy.deepcopy(next(q for q in QUESTIONS if q["form"] == form))


def _broken(mutate) -> dict:
    q = _first(mutate.__name__.split("_")[0])
    mutate(q)
    return q


def single_key_not_in_choices(q):
    q["answer"] = "zz"


def multi_one_key_missing(q):
    q["answer"] = [q["answer"][0], "zz"]


def match_right_key_missing(q):
    left = next(iter(q["answer"]))
    q["answer"][left] = "zz"


def match_left_key_dropped(q):
    q["answer"].pop(next(iter(q["answer"])))


def order_not_a_permutation(q):
    q["answer"] = q["answer"][:-1] + [q["answer"][0]]


def numeric_tolerance_too_wide(q):
    q["answer"]["rel_tol"] = 0.5


def numeric_not_finite(q):
    q["answer"]["value"] = float("nan")


@pytest.mark.parametrize(
    "mutate",
    [
        single_key_not_in_choices, multi_one_key_missing, match_right_key_missing, match_left_key_dropped,
        order_not_a_permutation, numeric_tolerance_too_wide, numeric_not_finite,
    ],
)
def test_broken_answer_is_caught(mutate):
    assert answer_problems(_first(mutate.__name__.split("_")[0])) == []  # the original is fine
    assert answer_problems(_broken(mutate)) != []


def test_broken_question_fails_schema_and_text_checks():
    section = copy.deepcopy(SECTIONS[1])
    q = section["questions"][0]
    q["id"] = "Bad Id"
    q["prompt"].pop("zh")
    q["form"] = "multi"
    q["answer"] = ["only_one"]
    errors = "\n".join(schema_errors(section))
    assert "Bad Id" in errors and "'zh' is a required property" in errors
    assert text_problems(q) != []

    section = copy.deepcopy(SECTIONS[2])
    numeric = next(q for q in section["questions"] if q["form"] == "numeric")
    numeric["answer"]["rel_tol"] = 0.5
    assert schema_errors(section)


# ---------------------------------------------------------------- guessing

GUESS_LIMIT = 0.35  # as quiz.GUESS_LIMIT; literal here, where the bank is read as data only


def _share(hits: list[bool]) -> float:
    return sum(hits) / len(hits) if hits else 0.0


def guess_scores(questions: list[dict]) -> dict[str, float]:
    """How fixed ways of answering without reading score on the bank as written: for each, the share right of
    the questions it answers (the key in file order, as a trainer printing the bank shows it)."""
    singles = [q for q in questions if q["form"] == "single"]
    multis = [q for q in questions if q["form"] == "multi"]
    scores = {f"always {k}": _share([q["answer"] == k for q in singles]) for k in "abcd"}
    for lang in ("en", "zh"):
        for name, pick in (("longest", max), ("shortest", min)):
            scores[f"always the {name} choice ({lang})"] = _share(
                [pick(q["choices"], key=lambda k, q=q: len(q["choices"][k][lang])) == q["answer"] for q in singles])
    keys = {q["id"]: list(q["choices"]) for q in multis}
    for name, take in (("the first two", lambda ks: ks[:2]), ("the first three", lambda ks: ks[:3]),
                       ("all but the last", lambda ks: ks[:-1]), ("all of them", lambda ks: ks),
                       ("the last two", lambda ks: ks[-2:])):
        scores[name] = _share([sorted(take(keys[q["id"]])) == sorted(q["answer"]) for q in multis])
    scores["as listed (order)"] = _share([q["answer"] == list(q["choices"]) for q in questions if q["form"] == "order"])
    scores["pairs in listed order (match)"] = _share(
        [all(q["answer"].get(a) == b for a, b in zip(q["choices"]["left"], q["choices"]["right"], strict=False))
         for q in questions if q["form"] == "match"])
    return scores


def test_no_fixed_guess_passes_the_bank():
    scores = guess_scores(QUESTIONS)
    over = {name: round(v, 3) for name, v in scores.items() if v > GUESS_LIMIT}
    assert not over, f"answering without reading scores over {GUESS_LIMIT:.0%}: {over}"


def test_the_guess_check_can_fail():
    every_a = copy.deepcopy(QUESTIONS)
    for q in every_a:
        if q["form"] == "single":
            q["answer"] = "a"
    assert guess_scores(every_a)["always a"] == 1.0


def test_uncovered_row_is_reported():
    row = {"id": "s1.not_a_real_row", "section": 1, "en": "x", "zh": "x"}
    covered = {r for q in QUESTIONS for r in q["rows"]}
    assert [r["id"] for r in ROWS + [row] if r["id"] not in covered] == [row["id"]]


# ---------------------------------------------------------------- links and answers a student can trust


@pytest.mark.parametrize(("lab", "valid"), [("00", True), ("05", True), ("06", True), ("07", True), ("08", True),
                                            ("09", False), ("6", False)])
def test_a_question_may_link_any_lab_from_00_to_08(lab, valid):
    """Labs 06-08 measured facts the review asks about (profiling, the service, MLOps); 09 is the review itself."""
    section = copy.deepcopy(SECTIONS[2])
    question = next(q for q in section["questions"] if q.get("lab"))
    question["lab"]["lab"] = lab
    assert (not schema_errors(section)) is valid, schema_errors(section)


QUESTION = {q["id"]: q for q in QUESTIONS}


def test_questions_once_open_to_two_answers_have_one():
    # An order of steps where serving and packaging could be swapped: now a containment, inside out.
    relation = QUESTION["s2-relation-inside-out"]
    assert "innermost" in relation["prompt"]["en"] and "最内层" in relation["prompt"]["zh"]
    # AI Enterprise is the supported edition of the layers below, not a rung that must sit in one place.
    assert "enterprise" not in QUESTION["s1-layers-bottom-to-top"]["choices"]
    # Run:ai also schedules GPUs (orchestration): in or out of "monitoring tools" were both defensible.
    tools = QUESTION["s4-monitoring-tools"]
    assert all("Run:ai" not in c["en"] for c in tools["choices"].values())


def test_the_chinese_of_a_choice_claims_no_more_than_its_english():
    # s4-dcgm-gpu-util's first choice once added, in Chinese only, that optimizing the code could no longer help.
    choice = QUESTION["s4-dcgm-gpu-util"]["choices"]["a"]
    assert "优化" not in choice["zh"] and "optimi" not in choice["en"]
