"""Lab 09's quiz, one question at a time: the question, a control fitted to its form (choices, several choices,
an order, pairs, a number), Submit grades it with the runner's own check, Next moves on."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as w

from lab_utils.exercises.framework import Outcome
from lab_utils.exercises.quiz import Question, QuizRunner, outcome_line, ui_text
from lab_utils.widgets.core import Panel, interactive, show


class QuizPanel(Panel):
    """``runner``'s questions in order; ``answer_value()`` is what the control holds, in the form ``check`` takes.

    The panel grades through ``runner`` (``runner.answer``), so ``runner.score()`` counts what was submitted here."""

    def __init__(self, runner: QuizRunner):
        self.runner = runner
        self.question: Question | None = None
        self.outcome: Outcome | None = None
        self.prompt = w.HTML()
        self.control = w.VBox()
        self.feedback = w.HTML()
        lang = runner.language  # the buttons and status lines in the quiz's language, as its questions are
        self.submit = w.Button(description=ui_text("submit", lang), button_style="primary")
        self.next_button = w.Button(description=ui_text("next", lang))
        self.submit.on_click(lambda _b: self.grade())
        self.next_button.on_click(lambda _b: self.advance())
        self.widget = w.VBox([self.prompt, self.control, w.HBox([self.submit, self.next_button]), self.feedback])
        self._inputs: dict[str, Any] = {}

    def advance(self) -> Question | None:
        """Open the next question (``None`` at the end) and build its control."""
        q = self.question = self.runner.next(show=False)
        self.outcome, self.feedback.value, self._inputs = None, "", {}
        lang = self.runner.language
        if q is None:
            self.prompt.value = (f"<b>{ui_text('end', lang)}</b> <code>runner.score()</code> "
                                 f"{ui_text('tally', lang)}")
            self.control.children = ()
            self.submit.disabled = self.next_button.disabled = True
            return None
        self.prompt.value = f"<pre style='white-space: pre-wrap'>{html.escape(q.text(lang, self.runner._pos))}</pre>"
        keys = q._keys() if q.form != "match" else q._keys("left")
        if q.form == "single":
            self._inputs["value"] = w.RadioButtons(options=keys, value=None, description=ui_text("answer", lang))
        elif q.form == "multi":
            self._inputs.update({k: w.Checkbox(description=k, value=False, indent=False) for k in keys})
        elif q.form == "order":
            self._inputs["value"] = w.Text(placeholder=", ".join(keys), description=ui_text("order_label", lang))
        elif q.form == "match":
            rights = [("", None)] + [(k, k) for k in q._keys("right")]
            self._inputs.update({k: w.Dropdown(options=rights, value=None, description=k) for k in keys})
        else:  # numeric
            self._inputs["value"] = w.Text(placeholder=ui_text("numeric", lang), description=ui_text("answer", lang))
        self.control.children = tuple(self._inputs.values())
        self.submit.disabled = False
        return q

    def answer_value(self) -> Any:
        """The control's value as ``QuizRunner.answer`` takes it (None when left blank)."""
        if (q := self.question) is None:
            return None
        if q.form == "multi":
            return [k for k, box in self._inputs.items() if box.value] or None
        if q.form == "match":
            return {k: d.value for k, d in self._inputs.items() if d.value is not None} or None
        value = self._inputs["value"].value
        if q.form == "order":
            return [k.strip() for k in value.split(",") if k.strip()] or None
        return value if value not in ("", None) else None

    def grade(self) -> Outcome | None:
        """Grade the control's answer; the outcome (with why, and the explanation when right) is shown below."""
        if self.question is None:
            return None
        lang = self.runner.language
        out = self.outcome = self.runner.answer(self.answer_value(), quiet=True)
        lines = [outcome_line(out, lang)]
        if out.correct:
            lines.append(f"{ui_text('why', lang)}: {self.question.explanation[lang]}")
        if lab := self.question.lab_text(lang):
            lines.append(lab)
        self.feedback.value = "<br>".join(html.escape(t) for t in lines)
        return out

    def headless(self) -> None:
        q, lang = self.advance(), self.runner.language
        print(q.text(lang, self.runner._pos) if q else ui_text("no_questions", lang))
        print(f"({ui_text('one_of', lang).format(n=len(self.runner))})")


def quiz_panel(runner: QuizRunner) -> QuizPanel:
    """Show ``runner``'s quiz one question at a time (headless: print the first question)."""
    panel = QuizPanel(runner)
    if interactive():
        panel.advance()
    return show(panel)
