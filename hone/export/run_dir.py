"""Read what ``hone train`` leaves behind: ``config.yml`` (the resolved config) and ``final/``."""

from dataclasses import dataclass
from pathlib import Path

import yaml

from hone.config import HoneConfig, parse_config
from hone.models.errors import ModelError
from hone.run_files import CONFIG_FILE, FINAL_DIR


@dataclass(frozen=True)
class Run:
    directory: Path
    cfg: HoneConfig
    final: Path
    is_adapter: bool
    """``final/`` holds a PEFT adapter (LoRA run), else a full model."""


def read_run(run_dir: Path) -> Run:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ModelError(f"run directory '{run_dir}' does not exist (it is a training.output_dir written by hone train)")
    config_path = run_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ModelError(f"'{run_dir}' has no {CONFIG_FILE}, so it is not a run directory written by hone train")
    try:
        raw = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ModelError(f"cannot read '{config_path}': {exc}") from None
    cfg = parse_config(raw, str(config_path))
    final = run_dir / FINAL_DIR
    if not final.is_dir():
        raise ModelError(
            f"'{run_dir}' has no {FINAL_DIR}/ directory: the run has not finished (resume it with "
            "--set training.resume=latest, then generate or merge)"
        )
    if (final / "adapter_config.json").is_file():
        return Run(run_dir, cfg, final, is_adapter=True)
    if (final / "config.json").is_file():
        return Run(run_dir, cfg, final, is_adapter=False)
    raise ModelError(f"'{final}' holds neither a PEFT adapter (adapter_config.json) nor a model (config.json)")
