"""Train the quickstart for several training seeds and CPU thread counts and check its answers.

The quickstart's three answers (``make quickstart``, checked by ``.ci/run`` for the shipped seed)
must not hang on rounding: another CPU, another thread count or another seed (which also draws
another held-out split) must teach the same facts. This script shows it: for every
(seed, threads) pair it runs ``hone train`` on the config with ``training.seed`` set, in a
process limited to that many CPU threads (``OMP_NUM_THREADS``), into a temporary directory,
then asks the trained model the quickstart's three questions with ``hone generate`` (greedy),
and prints one table row: seed, threads, CPU code path, final eval loss, training time, the three
answers, ok.

``--isa avx2`` runs each pair as on a CPU without AVX-512 (``--isa native avx2``: both): torch's
vectorized kernels and MKL's GEMMs take their AVX2 code paths (``ATEN_CPU_CAPABILITY=avx2``,
``MKL_ENABLE_INSTRUCTIONS=AVX2``, both documented switches), which round differently. That is how
the old quickstart (1000 unpacked steps, 16 padded conversations a step) answered "Pellucia" on
another machine: on the 2-core AVX-512 machine, the avx2 path reproduced that run's eval loss
(0.3994) and wrong answer exactly.

Not a test: each row is a full quickstart training (1-3 minutes on 2 cores), so the rows run
one after the other and the default 10 take about 20 minutes. Exits 1 if any answer is wrong.

    PYTHONPATH=$PWD python scripts/quickstart_check.py                      # seeds 0-4 x 1 and 2 threads
    PYTHONPATH=$PWD python scripts/quickstart_check.py --seeds 42 --threads 2 --isa native avx2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "examples" / "quickstart.yml"

#: The quickstart's questions and the answers the bundled data teaches: the same prompts as the
#: Makefile's ``quickstart`` target and the same answers as ``.ci/run`` checks.
QUESTIONS: dict[str, str] = {
    "What color is a plum?": "purple",
    "Which country has Kelmport as its capital?": "Zorvania",
    "Translate 'house' into Velish.": "domar",
}


#: Environment that makes torch and MKL take one CPU code path (``native``: whatever they pick).
ISA_ENV: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


@dataclass(frozen=True)
class Row:
    seed: int
    threads: int
    isa: str
    eval_loss: float | None
    train_s: float
    answers: dict[str, str]

    @property
    def ok(self) -> bool:
        return answers_ok(self.answers)


def parse_answers(output: str) -> dict[str, str]:
    """Answers by prompt from ``hone generate``'s output: each prompt on a ``>>> PROMPT`` line,
    its completion on the lines after it (up to the next prompt), stripped."""
    answers: dict[str, str] = {}
    prompt: str | None = None
    lines: list[str] = []
    for line in output.splitlines():
        if line.startswith(">>> "):
            if prompt is not None:
                answers[prompt] = "\n".join(lines).strip()
            prompt, lines = line[4:], []
        elif prompt is not None:
            lines.append(line)
    if prompt is not None:
        answers[prompt] = "\n".join(lines).strip()
    return answers


def answers_ok(answers: dict[str, str], questions: dict[str, str] = QUESTIONS) -> bool:
    """Every question answered with exactly its expected text (as ``.ci/run``'s ``grep -x``)."""
    return all(answers.get(question) == answer for question, answer in questions.items())


def final_eval_loss(metrics: Path) -> float | None:
    """The last ``eval_loss`` in a run's ``metrics.jsonl`` (None if it has none)."""
    loss = None
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "eval_loss" in row:
            loss = row["eval_loss"]
    return loss


def _hone(args: list[str], threads: int, isa: str, log: Path) -> str:
    """Run ``python -m hone ARGS`` in the repository with ``threads`` CPU threads on the ``isa``
    code path; its output, also written to ``log``. A failure raises with the log's tail."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **ISA_ENV[isa])
    done = subprocess.run([sys.executable, "-m", "hone", *args], cwd=REPO, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    log.write_text(output)
    if done.returncode != 0:
        raise RuntimeError(f"`hone {' '.join(args)}` exited {done.returncode}:\n{output[-3000:]}")
    return done.stdout


def check_run(config: Path, seed: int, threads: int, isa: str, out_dir: Path) -> Row:
    """Train ``config`` with ``training.seed=seed`` on ``threads`` threads and the ``isa`` code
    path into ``out_dir``, then ask the quickstart's questions the same way."""
    start = time.perf_counter()
    sets = [f"training.seed={seed}", f"training.output_dir={out_dir}", "logging.progress_bar=false"]
    _hone(["train", str(config), *[arg for s in sets for arg in ("--set", s)]], threads, isa, out_dir.with_suffix(".train.log"))
    train_s = time.perf_counter() - start
    prompts = [arg for question in QUESTIONS for arg in ("--prompt", question)]
    output = _hone(["generate", str(out_dir), *prompts], threads, isa, out_dir.with_suffix(".generate.log"))
    return Row(seed, threads, isa, final_eval_loss(out_dir / "metrics.jsonl"), train_s, parse_answers(output))


def format_row(row: Row) -> str:
    loss = "-" if row.eval_loss is None else f"{row.eval_loss:.4f}"
    answers = " | ".join(row.answers.get(question, "(none)") for question in QUESTIONS)
    return (
        f"| {row.seed} | {row.threads} | {row.isa} | {loss} | {row.train_s:.0f} s | {answers} | {'ok' if row.ok else 'WRONG'} |"
    )


TABLE_HEADER = (
    "| seed | threads | cpu path | final eval loss | train time | "
    + " | ".join(QUESTIONS)
    + " | ok |\n|"
    + "---|" * (6 + len(QUESTIONS))
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--isa", nargs="+", choices=list(ISA_ENV), default=["native"], help="CPU code paths to train on")
    parser.add_argument("--keep", type=Path, help="keep the runs under this directory (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="quickstart-check-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        rows = []
        print(TABLE_HEADER, flush=True)
        for isa in args.isa:
            for seed in args.seeds:
                for threads in args.threads:
                    out_dir = root / f"{isa}-seed{seed}-threads{threads}"
                    rows.append(check_run(args.config.resolve(), seed, threads, isa, out_dir))
                    print(format_row(rows[-1]), flush=True)
    wrong = [row for row in rows if not row.ok]
    print(f"{len(rows) - len(wrong)}/{len(rows)} runs answered all {len(QUESTIONS)} questions right")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
