"""Shared fixtures: the bundled tokenizer, a JSONL writer, and a cache that never leaves tmp.

``HONE_CACHE_DIR`` points into pytest's temporary directory for the whole session, so no
test (data, training, CLI) ever writes prepared data into the user's ``~/.cache``.

Without a GPU, every test process computes on one thread (pytest's own and the processes it
starts, through ``OMP_NUM_THREADS``), unless ``OMP_NUM_THREADS`` says otherwise: the tests'
models are tiny, so a second intra-op thread divides no real work, and its spin-waiting took
the CPU from the first (the CPU suites ran 1.3x to 1.8x faster in wall-clock time on 2 cores).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def write_jsonl(directory: Path, rows: Iterable[Any], name: str = "data.jsonl") -> Path:
    """Write ``rows`` (dicts, or raw strings written verbatim as lines) to ``directory/name``."""
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return path


@pytest.fixture(name="write_jsonl")
def write_jsonl_fixture() -> Callable[..., Path]:
    """``write_jsonl(tmp_path, rows, name="data.jsonl") -> Path``."""
    return write_jsonl


@pytest.fixture(scope="session")
def tokenizer():
    """The tokenizer bundled in ``hone/assets/tokenizer`` (loaded once per session)."""
    from hone.config.model import ModelConfig
    from hone.models.tokenizer import load_tokenizer

    return load_tokenizer(ModelConfig(preset="tiny-llama"))


@pytest.fixture(scope="module", autouse=True)
def _torch_seeded_per_module():
    """Each test module starts from the same global torch random state, whichever modules the
    process ran before it (pytest-xdist hands files to its workers in no fixed order): what a
    module's fixtures and tests draw without a seed of their own is the same in every run."""
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _hone_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HONE_CACHE_DIR", str(tmp_path_factory.mktemp("hone_cache")))
        yield


@pytest.fixture
def make_data_config(tmp_path: Path) -> Callable[..., Any]:
    """``make_data_config(datasets, seed=42, **data_options) -> HoneConfig`` for a preset model,
    with the prepared-data cache in ``tmp_path / "cache"`` unless the options say otherwise."""
    from hone.config import parse_config

    def make(datasets: list[dict[str, Any]], seed: int = 42, **data: Any):
        data.setdefault("dataset_prepared_path", str(tmp_path / "cache"))
        raw = {
            "model": {"preset": "tiny-llama"},
            "data": {"datasets": [{k: str(v) if isinstance(v, Path) else v for k, v in d.items()} for d in datasets], **data},
            "training": {"seed": seed},
        }
        if "test_datasets" in data:
            raw["data"]["test_datasets"] = [
                {k: str(v) if isinstance(v, Path) else v for k, v in d.items()} for d in data["test_datasets"]
            ]
        return parse_config(raw)

    return make


def trained_spans(tokenizer: Any, row: dict[str, Any]) -> list[str]:
    """The decoded runs of consecutive trained tokens of an encoded row."""
    spans, run = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != -100:
            assert label == token, "a trained label must be the token at its position"
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


@pytest.fixture(name="trained_spans")
def trained_spans_fixture() -> Callable[[Any, dict[str, Any]], list[str]]:
    """``trained_spans(tokenizer, row) -> list[str]``: decoded runs of trained tokens."""
    return trained_spans


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches live per process: a graph an earlier test compiled would turn a test's
    first compilation into a "recompile". Compile tests opt in with
    ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


#: The published config.json of the real models the examples name (tests/data/hub_standin_configs.json).
HUB_STANDIN_CONFIGS = Path(__file__).parent / "data" / "hub_standin_configs.json"


def write_hub_standins(cache: Path) -> Path:
    """A Hugging Face hub cache under ``cache`` holding a stand-in snapshot of every model id the
    examples name: the real model's config.json (so sequence-length checks and ``hone plan`` see
    the real architecture), hone's bundled tokenizer files, and one tiny but complete safetensors
    file. That is everything ``hone validate`` and ``hone plan`` read of a model: metadata, never
    the weights (they check that the weight files are complete, not what they hold)."""
    import torch
    from safetensors.torch import save_file

    from hone.models.tokenizer import bundled_tokenizer_path

    configs = json.loads(HUB_STANDIN_CONFIGS.read_text(encoding="utf-8"))
    revision = "0" * 40
    for repo_id, config in configs.items():
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
        (snapshot / "config.json").write_text(json.dumps(config), encoding="utf-8")
        for file in bundled_tokenizer_path().iterdir():
            (snapshot / file.name).write_bytes(file.read_bytes())
        save_file({"stand_in": torch.zeros(2)}, str(snapshot / "model.safetensors"))
    return cache


@pytest.fixture
def hub_standins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``HF_HUB_CACHE`` pointed at a stand-in cache of the examples' model ids (offline)."""
    cache = write_hub_standins(tmp_path / "hf-hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache
