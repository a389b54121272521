"""Write what ``hone plan`` prints for every example config and bench spec, for a before/after diff.

Why: a refactor of the planner or the memory model must not change a single decision or number.
This runs ``hone plan`` in one process (loading torch once) on each ``examples/*.yml`` and
``benchmarks/specs/*.yml`` under a few fixed machines (a card and a host of fixed sizes, CPU and
CUDA, one and two processes), so the output depends on the code alone, and writes one text file
per (config, machine) into OUT_DIR. Compare two snapshots with ``diff -r``.

    python scripts/plan_snapshot.py OUT_DIR
"""

import contextlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (name, extra hone plan arguments): machines fixed in size, so the output is the code's alone.
MACHINES = (
    ("h100", ["--gpu-memory", "80GiB", "--host-memory", "128GiB"]),
    ("24g", ["--gpu-memory", "24GiB", "--host-memory", "64GiB"]),
    ("cpu", ["--device", "cpu", "--gpu-memory", "80GiB", "--host-memory", "128GiB"]),
    ("x2", ["--nproc-per-node", "2", "--gpu-memory", "80GiB", "--host-memory", "128GiB"]),
)


def main(out_dir: str) -> int:
    from hone.cli import main as hone

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = sorted((ROOT / "examples").glob("*.yml")) + sorted((ROOT / "benchmarks" / "specs").glob("*.yml"))
    for config in configs:
        for machine, extra in MACHINES:
            text = io.StringIO()
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                try:
                    code = hone(["plan", str(config.relative_to(ROOT)), *extra])
                except SystemExit as exc:  # argparse
                    code = exc.code
            name = f"{config.parent.name}__{config.stem}__{machine}.txt"
            (out / name).write_text(f"exit {code}\n{text.getvalue()}")
            print(f"{name}: exit {code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
