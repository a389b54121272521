"""Write what ``hone plan`` prints for every example config and bench spec, for a before/after diff.

Why: a refactor of the planner or the memory model must not change a single decision or number.
This runs ``hone plan`` in one process (loading torch once) on each ``examples/*.yml`` and
``benchmarks/specs/*.yml`` under a few fixed machines (a card and a host of fixed sizes, CPU and
CUDA, one and two processes), so the output depends on the code alone, and writes one text file
per (config, machine) into OUT_DIR. Compare two snapshots with ``diff -r``. Examples that name
a model id (``Qwen/Qwen3-8B``, ...) plan against the tests' stand-in hub cache (the real
config.json of each; tests/conftest.py), so the output does not depend on what this machine
has downloaded.

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


def use_hub_standins() -> None:
    """Point ``HF_HUB_CACHE`` at a fresh stand-in cache of the examples' model ids, offline."""
    import importlib.util
    import os
    import tempfile

    spec = importlib.util.spec_from_file_location("hone_tests_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    cache = conftest.write_hub_standins(Path(tempfile.mkdtemp(prefix="hone-hub-standins-")))
    os.environ["HF_HUB_CACHE"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"


def main(out_dir: str) -> int:
    use_hub_standins()
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
