"""The run directory: a run is never trained into afresh, and the resolved config is saved."""

import pytest

from hone.config.loader import load_config
from hone.testing import tiny_config
from hone.train.run import OutputDirInUse, prepare_output_dir


def test_a_new_directory_gets_the_resolved_config(tmp_path):
    # LoRA: dump_config writes every default, and for adapter.type none that includes the
    # lora_* keys, which the loader then refuses (reported to the config owner).
    cfg = tiny_config(tmp_path / "run", adapter={"type": "lora"})
    assert prepare_output_dir(cfg, warn=pytest.fail) is None
    assert load_config(tmp_path / "run" / "config.yml") == cfg
    # config.yml alone (a run that failed while loading) does not block a retry
    assert prepare_output_dir(cfg, warn=pytest.fail) is None


@pytest.mark.parametrize(("leftover", "what"), [("metrics.jsonl", "another run"), ("final", "a finished run")])
def test_a_directory_holding_a_run_is_refused_without_resume(tmp_path, leftover, what):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / leftover).mkdir() if leftover == "final" else (tmp_path / "run" / leftover).write_text("")
    with pytest.raises(OutputDirInUse, match=f"already holds {what}.*another training.output_dir.*resume: latest"):
        prepare_output_dir(tiny_config(tmp_path / "run"), warn=pytest.fail)


def test_resume_latest_with_nothing_saved_starts_over_with_a_warning(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    warnings = []
    cfg = tiny_config(tmp_path / "run", training={"resume": "latest"})
    assert prepare_output_dir(cfg, warn=warnings.append) is None
    assert any("from scratch" in w for w in warnings) and any("starting over" in w for w in warnings)
