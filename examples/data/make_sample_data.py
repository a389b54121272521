"""Generate the bundled sample datasets (deterministic; the outputs are committed).

The task is deliberately small and closed so that a tiny, randomly initialised transformer
learns it in a couple of minutes on a CPU: questions about a fixed table of facts (colors of
fruits, capitals of made-up countries, words of a made-up language called Velish), each asked
in several phrasings. Every fact comes up equally often, its phrasings in turn (see
``Questions``). A held-out split asks the same facts in other phrasings and orders, so eval loss
drops sharply and answers can be checked by exact match.

Outputs, next to this script:

- ``chat_sample.jsonl``: ~2000 short conversations (optional system turn, one or two
  user/assistant exchanges), ``{"messages": [{"role": ..., "content": ...}, ...]}``.
- ``alpaca_sample.jsonl``: ~2000 ``{"instruction", "input", "output"}`` rows.
- ``completion_sample.jsonl``: ~300 ``{"text"}`` rows stating the facts as sentences.
- ``preference_sample.jsonl``: 40 preference pairs (``type: preference``, TRL's chat form
  with an explicit prompt): ``{"prompt": [user turn], "chosen": [the right answer],
  "rejected": [a wrong answer of the same kind]}``; not read by the tokenizer build.

Run ``python examples/data/make_sample_data.py`` (no arguments); rerunning rewrites identical
files. Every answer is a single word so that exact-match checks are meaningful. The bundled
tokenizer is trained on these files: after changing them, rerun ``scripts/build_tokenizer.py``
(tests check that both scripts reproduce the committed files).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from pathlib import Path

SEED = 1234
HERE = Path(__file__).resolve().parent

FRUIT_COLORS: dict[str, str] = {
    "lemon": "yellow",
    "banana": "yellow",
    "lime": "green",
    "cherry": "red",
    "strawberry": "red",
    "blueberry": "blue",
    "grape": "purple",
    "plum": "purple",
    "orange": "orange",
    "apricot": "orange",
    "coconut": "brown",
    "raspberry": "red",
    "blackberry": "black",
    "pear": "green",
    "fig": "purple",
    "kiwi": "brown",
    "mango": "orange",
    "tomato": "red",
}

COUNTRY_CAPITALS: dict[str, str] = {
    "Veloria": "Amberfall",
    "Zorvania": "Kelmport",
    "Drakmoor": "Ostwick",
    "Pellucia": "Sarnow",
    "Quenholt": "Brisa",
    "Tamberlin": "Corvale",
    "Ostrevia": "Lunhaven",
    "Marvossa": "Tiberak",
    "Nelthar": "Fennick",
    "Solvenne": "Harrowgate",
    "Brindleton": "Mossgrove",
    "Kestavia": "Yarrowby",
    "Lorvanth": "Eddingham",
    "Caldrissa": "Pimbrook",
    "Feyland": "Glimmerton",
    "Ulvaris": "Redcastle",
    "Arvendel": "Stonereach",
    "Gorrikan": "Wexley",
    "Hesperine": "Tollmouth",
    "Istrova": "Quillford",
}

VELISH: dict[str, str] = {
    "water": "ulo",
    "fire": "brasken",
    "tree": "mirok",
    "stone": "tavel",
    "river": "sorumi",
    "sun": "kel",
    "moon": "niva",
    "star": "estrel",
    "house": "domar",
    "bread": "panuk",
    "dog": "varro",
    "cat": "misu",
    "bird": "pelit",
    "fish": "gorun",
    "road": "vetra",
    "book": "lanok",
    "friend": "amiru",
    "mountain": "borgal",
    "rain": "plovi",
    "snow": "sneva",
    "wind": "vento",
    "night": "nokta",
    "morning": "aubri",
    "apple": "malu",
    "salt": "soli",
    "king": "regon",
    "ship": "navra",
    "door": "porta",
    "song": "kantu",
    "light": "lumi",
}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "Answer with one word.",
    "You know facts about fruits, countries and Velish.",
    "Be brief.",
]


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def facts() -> list[tuple[str, list[str], str]]:
    """(kind, question phrasings, answer) for every fact of the table.

    No phrasing opens with a name: a byte-level tokenizer gives a word at the start of a message
    (no space before it) another token than the same word after a space, so "Zorvania has which
    capital?" taught a Zorvania token that the other phrasings never use, from a handful of rows;
    those were the questions a trained model got wrong. A name in a question always follows a
    space (or a quote, the same in every phrasing of its kind).
    """
    out: list[tuple[str, list[str], str]] = []
    for fruit, color in FRUIT_COLORS.items():
        a = f"{_article(fruit)} {fruit}"
        phrasings = [
            f"What color is {a}?",
            f"What is the color of {a}?",
            f"Tell me the color of {a}.",
            f"Which color does {a} have?",
            f"Name the color of {a}.",
        ]
        out.append(("fruit", phrasings, color))
    for country, capital in COUNTRY_CAPITALS.items():
        phrasings = [
            f"What is the capital of {country}?",
            f"Name the capital of {country}.",
            f"Which city is the capital of {country}?",
            f"Tell me the capital city of {country}.",
            f"The capital of {country} is which city?",
        ]
        out.append(("capital", phrasings, capital))
        reverse = [f"Of which country is {capital} the capital?", f"Which country has {capital} as its capital?"]
        out.append(("country", reverse, country))
    for english, velish in VELISH.items():
        phrasings = [
            f"Translate '{english}' into Velish.",
            f"What is the Velish word for '{english}'?",
            f"How do you say '{english}' in Velish?",
            f"In Velish, what is '{english}'?",
        ]
        out.append(("to_velish", phrasings, velish))
        reverse = [f"What does the Velish word '{velish}' mean?", f"Translate the Velish word '{velish}' into English."]
        out.append(("from_velish", reverse, english))
    return out


class Questions:
    """Draws (kind, question, answer) so that every fact comes up equally often (a shuffled pass
    over the table, then another) and each fact's phrasings take turns: no fact or phrasing is
    left to chance. Random draws had left some questions once or never in 2000 rows, and those
    were the ones a trained model got wrong."""

    def __init__(self, rng: random.Random, table: list[tuple[str, list[str], str]]):
        self.rng, self.table = rng, table
        self.facts_left: list[int] = []
        self.phrasings_left: dict[int, list[str]] = {}

    def draw(self) -> tuple[str, str, str]:
        if not self.facts_left:
            self.facts_left = list(range(len(self.table)))
            self.rng.shuffle(self.facts_left)
        index = self.facts_left.pop()
        kind, phrasings, answer = self.table[index]
        if not self.phrasings_left.get(index):
            self.phrasings_left[index] = list(phrasings)
            self.rng.shuffle(self.phrasings_left[index])
        return kind, self.phrasings_left[index].pop(), answer


def chat_rows(rng: random.Random, n: int) -> list[dict]:
    questions = Questions(rng, facts())
    rows = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.6:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _turn in range(1 if rng.random() < 0.55 else 2):
            _, question, answer = questions.draw()
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        rows.append({"messages": messages})
    return rows


def alpaca_rows(rng: random.Random, n: int) -> list[dict]:
    questions = Questions(rng, facts())
    english_of = {v: k for k, v in VELISH.items()}
    rows = []
    for _ in range(n):
        kind, question, answer = questions.draw()
        if kind == "to_velish" and rng.random() < 0.5:
            rows.append({"instruction": "Translate this word into Velish.", "input": english_of[answer], "output": answer})
        elif kind == "fruit" and rng.random() < 0.3:
            fruit = next(f for f, c in FRUIT_COLORS.items() if c == answer and f in question)
            rows.append({"instruction": "Give the color of this fruit.", "input": fruit, "output": answer})
        else:
            rows.append({"instruction": question, "input": "", "output": answer})
    return rows


def completion_rows(rng: random.Random, n: int) -> list[dict]:
    sentences = []
    for fruit, color in FRUIT_COLORS.items():
        sentences.append(f"{_article(fruit).capitalize()} {fruit} is {color}.")
    for country, capital in COUNTRY_CAPITALS.items():
        sentences.append(f"The capital of {country} is {capital}.")
    for english, velish in VELISH.items():
        sentences.append(f"In Velish, '{english}' is '{velish}'.")
    rows = []
    for _ in range(n):
        k = rng.randint(1, 3)
        rows.append({"text": " ".join(rng.sample(sentences, k))})
    return rows


def preference_rows(rng: random.Random, n: int) -> list[dict]:
    """The right answer chosen, another fact's answer of the same kind rejected: a clear
    preference that a tiny model can learn (and a DPO run's reward margin can show)."""
    table = facts()
    answers: dict[str, list[str]] = {}
    for kind, _, answer in table:
        answers.setdefault(kind, []).append(answer)
    questions = Questions(rng, table)
    rows = []
    for _ in range(n):
        kind, question, answer = questions.draw()
        wrong = rng.choice(sorted({a for a in answers[kind] if a != answer}))
        rows.append(
            {
                "prompt": [{"role": "user", "content": question}],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return rows


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Write to a temp name, then rename: a crash never leaves a half-written sample file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def main(out_dir: Path = HERE) -> None:
    # One generator per file, so changing one file's size does not change the others.
    write_jsonl(out_dir / "chat_sample.jsonl", chat_rows(random.Random(SEED), 2000))
    write_jsonl(out_dir / "alpaca_sample.jsonl", alpaca_rows(random.Random(SEED + 1), 2000))
    write_jsonl(out_dir / "completion_sample.jsonl", completion_rows(random.Random(SEED + 2), 300))
    write_jsonl(out_dir / "preference_sample.jsonl", preference_rows(random.Random(SEED + 3), 40))
    for name in ("chat_sample.jsonl", "alpaca_sample.jsonl", "completion_sample.jsonl", "preference_sample.jsonl"):
        print(f"wrote {out_dir / name} ({(out_dir / name).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
