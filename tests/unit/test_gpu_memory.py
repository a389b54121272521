"""``memory.gpu_memory``: the card size a run plans for and is held to. Config validation (naming
the key, the value and what is allowed), which budget ``hone plan`` and the bench's estimate use,
the process cap (torch's memory fraction, faked here: no GPU on the CPU), and the CPU note."""

from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from hone.config import parse_config
from hone.config.errors import ConfigError
from hone.transforms.card import CardMemoryError, cap_process_memory, device_memory
from hone.units import GIB

_RAW = {"model": {"preset": "llama3-8b"}, "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}]}}


def _cfg(gpu_memory):
    return parse_config({**_RAW, "adapter": {"type": "lora"}, "memory": {"gpu_memory": gpu_memory}})


@pytest.mark.parametrize(
    ("value", "expected"), [("auto", None), ("80GiB", 80 * GIB), (24, 24 * GIB), ("81559MiB", 81559 * 2**20)]
)
def test_sizes_and_auto_are_read(value, expected):
    assert _cfg(value).memory.gpu_memory_bytes == expected


@pytest.mark.parametrize(("value", "says"), [("80 giga", "is not a memory size"), (0, "is not a positive memory size")])
def test_a_bad_size_names_the_key_the_value_and_the_units(value, says):
    with pytest.raises(ConfigError, match=f"memory.gpu_memory: '{value}' {says}"):
        _cfg(value)


def test_the_plan_budget_is_the_flag_then_the_config_then_the_card():
    assert device_memory("cuda", "40GiB", 24 * GIB) == (40 * GIB, "--gpu-memory")
    assert device_memory("cuda", None, 24 * GIB) == (24 * GIB, "memory.gpu_memory")
    assert device_memory("cpu", None, 24 * GIB)[1] == "this machine's RAM"


def test_the_estimate_and_the_decisions_plan_for_the_configured_card():
    from hone.transforms.decide import decided_estimate

    small, large = _cfg("20GiB"), _cfg("141GiB")
    assert decided_estimate(small).total < decided_estimate(large).total  # a small card checkpoints more


def _fake_cuda(monkeypatch, total):
    fractions = []
    props = SimpleNamespace(total_memory=total, name="FakeGPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)

    def cap(fraction, device):
        assert isinstance(device, int), f"torch wants the card's index, got {device!r}"
        fractions.append(fraction)

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", cap)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fractions


def test_the_process_is_capped_at_the_configured_share_of_the_card(monkeypatch):
    fractions = _fake_cuda(monkeypatch, 140 * GIB)
    said = cap_process_memory(80 * GIB, torch.device("cuda", 0))
    assert fractions == [pytest.approx(80 / 140)] and "capped at 80.0 GiB of FakeGPU's 140.0 GiB" in said
    cap_process_memory(70 * GIB, torch.device("cuda"))  # a one-process run's device has no index
    assert fractions[-1] == pytest.approx(70 / 140)
    fractions.pop()
    assert cap_process_memory(None, torch.device("cuda", 0)) is None and fractions == [pytest.approx(80 / 140)]
    assert cap_process_memory(80 * GIB, torch.device("cpu")) is None


def test_more_than_the_card_has_is_refused_naming_the_key(monkeypatch):
    fractions = _fake_cuda(monkeypatch, 80 * GIB)
    with pytest.raises(CardMemoryError, match=r"memory.gpu_memory: 141.0 GiB is more than FakeGPU has \(80.0 GiB\); allowed"):
        cap_process_memory(141 * GIB, torch.device("cuda", 0))
    assert fractions == []


def test_a_cpu_run_notes_that_the_key_is_unused(monkeypatch):
    from hone.train import run
    from hone.train.run import _cap_memory

    monkeypatch.setattr(run, "cap_process_memory", lambda *a: pytest.fail("no cap on the CPU"))
    console = Console(record=True, width=200)
    _cap_memory(_cfg("80GiB"), torch.device("cpu"), console)
    assert "memory.gpu_memory applies to CUDA devices; unused on cpu" in console.export_text()
