"""``loss.png``: train and eval loss against the optimizer step.

Drawn with matplotlib's object API on an Agg canvas, so no global backend is switched (the
caller's matplotlib state is left alone) and no display is needed.
"""

from pathlib import Path
from typing import Any

from hone.atomic import atomic_write_with


def plot_losses(rows: list[dict[str, Any]], target: Path, *, title: str | None = None) -> Path:
    """Draw the loss curves of metrics ``rows`` into ``target`` (written atomically)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None and "eval_loss" not in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", linewidth=1.5, markersize=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean per trained token)")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if train or evals:
        ax.legend()
    fig.tight_layout()
    atomic_write_with(Path(target), lambda tmp: fig.savefig(tmp, format="png"))
    return Path(target)
