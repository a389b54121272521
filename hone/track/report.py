"""The few lines printed when a run ends: what it did, how fast, how well, where things are."""

from datetime import timedelta
from pathlib import Path


def format_duration(seconds: float) -> str:
    return str(timedelta(seconds=int(round(seconds))))


def percent_change(first: float, last: float) -> str:
    if first == 0:
        return ""
    return f" ({100 * (last - first) / abs(first):+.1f}%)"


def format_report(
    *,
    steps: int,
    total_steps: int,
    start_step: int,
    elapsed_s: float,
    wall_s: float,
    tokens: int,
    trained_tokens: int,
    final_loss: float | None,
    eval_losses: list[tuple[int, float]],
    skipped_steps: int,
    interrupted: str | None,
    output_dir: Path,
    final_dir: Path | None,
    last_checkpoint: Path | None,
    extra_outputs: list[Path],
) -> str:
    ran = steps - start_step
    head = "Finished" if not interrupted else f"Stopped by {interrupted}"
    resumed = f", resumed at step {start_step}" if start_step else ""
    rate = f"{tokens / elapsed_s:,.0f} tokens/s" if elapsed_s > 0 else "- tokens/s"
    lines = [
        f"{head}: step {steps}/{total_steps} ({ran} steps in {format_duration(wall_s)}{resumed})",
        f"  throughput: {rate} over {format_duration(elapsed_s)} of optimizer steps (eval and checkpoints "
        f"excluded), {trained_tokens:,} trained tokens",
        f"  train loss (last step): {'-' if final_loss is None else f'{final_loss:.4f}'}",
    ]
    if eval_losses:
        (first_step, first), (last_step, last) = eval_losses[0], eval_losses[-1]
        if len(eval_losses) > 1:
            lines.append(
                f"  eval loss: {first:.4f} (step {first_step}) -> {last:.4f} (step {last_step}){percent_change(first, last)}"
            )
        else:
            lines.append(f"  eval loss: {last:.4f} (step {last_step})")
    if skipped_steps:
        lines.append(f"  skipped steps (non-finite loss or gradient): {skipped_steps}")
    lines.append(f"  outputs in {output_dir}:")
    if final_dir is not None:
        lines.append(f"    {final_dir.name}/  the trained adapter or model")
    if last_checkpoint is not None:
        lines.append(
            f"    {last_checkpoint.relative_to(output_dir) if last_checkpoint.is_relative_to(output_dir) else last_checkpoint}/"
            "  resumable checkpoint"
        )
    for path in extra_outputs:
        suffix = "/" if path.is_dir() else ""
        lines.append(f"    {path.name}{suffix}")
    return "\n".join(lines)
