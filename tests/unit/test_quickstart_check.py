"""scripts/quickstart_check.py's answer checking, and that its questions are the quickstart's own
(Makefile prompts, .ci/run answers, README transcript). No training here: the script's runs take
half an hour; this only checks how it reads their output."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _load_script():
    path = REPO / "scripts" / "quickstart_check.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


check = _load_script()

GENERATE_OUTPUT = """\
>>> What color is a plum?
purple

>>> Which country has Kelmport as its capital?
Pellucia

>>> Translate 'house' into Velish.
domar

"""


def test_parse_answers_reads_each_prompt_and_its_completion():
    assert check.parse_answers(GENERATE_OUTPUT) == {
        "What color is a plum?": "purple",
        "Which country has Kelmport as its capital?": "Pellucia",
        "Translate 'house' into Velish.": "domar",
    }
    assert check.parse_answers(">>> a\nline one\nline two\n\n>>> b\n\n") == {"a": "line one\nline two", "b": ""}
    assert check.parse_answers("loading...\n") == {}


def test_answers_ok_needs_every_answer_exactly():
    right = dict(check.QUESTIONS)
    assert check.answers_ok(right)
    assert not check.answers_ok(check.parse_answers(GENERATE_OUTPUT))  # Pellucia
    assert not check.answers_ok({**right, "What color is a plum?": "purple purple"})
    assert not check.answers_ok({**right, "What color is a plum?": "Purple"})
    missing = dict(right)
    del missing["Translate 'house' into Velish."]
    assert not check.answers_ok(missing)


def test_final_eval_loss_is_the_last_eval_row(tmp_path):
    rows = [{"step": 0, "eval_loss": 7.7}, {"step": 50, "loss": 1.0}, {"step": 100, "eval_loss": 0.3}, {"step": 150, "loss": 0.2}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert check.final_eval_loss(metrics) == 0.3
    metrics.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert check.final_eval_loss(metrics) is None


def test_the_questions_are_the_quickstarts_own():
    """The Makefile asks these prompts, .ci/run greps for these answers, the README shows both."""
    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^quickstart:.*?(?=^\S)", makefile, re.M | re.S).group(0)
    assert re.findall(r'--prompt "([^"]*)"', target) == list(check.QUESTIONS)
    ci_answers = re.search(r"for answer in ([^;]*); do", (REPO / ".ci" / "run").read_text()).group(1).split()
    assert ci_answers == list(check.QUESTIONS.values())
    transcript = re.search(r"```\n(>>> .*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    assert check.parse_answers(transcript) == check.QUESTIONS
