"""Matching a checkpoint's optimizer groups, schedule and tensor shapes to another layout
(hone.train.checkpoint_layout_change); the resumed runs themselves:
tests/distributed/test_expert_parallel_fsdp.py."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties, TensorStorageMetadata

from hone.train.checkpoint_layout import CheckpointError
from hone.train.checkpoint_layout_change import (
    as_saved_shapes,
    check_shapes,
    put_back,
    regroup,
    regroup_schedule,
    saved_group_template,
)

PATH = Path("step-2")


def _group(names, decay, lr=0.1):
    return {"params": names, "lr": lr, "initial_lr": 0.2, "weight_decay": decay}


def test_groups_split_by_kind_are_matched_by_name():
    """Expert parallel + FSDP2 saved (decay DTensors, decay blocks, no decay); one process has
    (decay, no decay): each group takes the settings of the saved groups of its weights."""
    saved = [_group(["a", "b"], 0.01), _group(["experts"], 0.01), _group(["norm"], 0.0)]
    current = [{"params": ["a", "experts", "b"]}, {"params": ["norm"]}]
    groups, mapping = regroup(current, saved, PATH)
    assert groups == [_group(["a", "experts", "b"], 0.01), _group(["norm"], 0.0)]
    assert mapping == [0, 2]
    schedule = {"base_lrs": [1.0, 2.0, 3.0], "_last_lr": [4.0, 5.0, 6.0], "last_epoch": 2, "lr_lambdas": [{}, {"x": 1}, None]}
    assert regroup_schedule(schedule, mapping, 3) == {
        "base_lrs": [1.0, 3.0],
        "_last_lr": [4.0, 6.0],
        "last_epoch": 2,
        "lr_lambdas": [{}, None],
    }


def test_one_group_split_in_two():
    saved = [_group(["a", "experts"], 0.01), _group(["norm"], 0.0)]
    groups, mapping = regroup([{"params": ["a"]}, {"params": ["experts"]}, {"params": ["norm"]}], saved, PATH)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.01, 0.0] and mapping == [0, 0, 1]


def test_weights_saved_under_different_settings_or_absent_are_refused():
    saved = [_group(["a"], 0.01), _group(["b"], 0.0)]
    with pytest.raises(CheckpointError, match=r"different settings \(weight_decay\)"):
        regroup([{"params": ["a", "b"]}], saved, PATH)
    with pytest.raises(CheckpointError, match=r"no group for \['c'\]"):
        regroup([{"params": ["a", "c"]}], saved, PATH)


def _metadata(entries):
    return SimpleNamespace(state_dict_metadata=entries)


def _tensor(*size):
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), [])


def test_the_template_holds_every_saved_group_and_a_tensor_setting_as_a_tensor():
    meta = _metadata(
        {
            "optim.param_groups.1.params": BytesStorageMetadata(),
            "optim.param_groups.0.params": BytesStorageMetadata(),
            "optim.param_groups.0.lr": _tensor(),
            "model.w": _tensor(2, 2),
        }
    )
    template = saved_group_template(meta)
    assert len(template) == 2 and template[1] == {"params": None}
    assert isinstance(template[0]["lr"], torch.Tensor) and template[0]["params"] is None


def test_an_expert_lora_b_is_read_under_its_saved_shape_and_put_back():
    weight, moment = torch.zeros(3, 8), torch.zeros(3, 8)
    state = {"model": {"m.experts.lora_B.default": weight}, "optim": {"state": {"m.experts.lora_B.default": {"exp_avg": moment}}}}
    meta = _metadata(
        {"model.m.experts.lora_B.default": _tensor(3, 2, 4), "optim.state.m.experts.lora_B.default.exp_avg": _tensor(3, 2, 4)}
    )
    undo = as_saved_shapes(state, meta)
    check_shapes(state, meta, PATH)
    state["model"]["m.experts.lora_B.default"].copy_(torch.arange(24.0).view(3, 2, 4))  # what DCP would read
    put_back(undo)
    assert state["model"]["m.experts.lora_B.default"] is weight
    assert torch.equal(weight, torch.arange(24.0).view(3, 8))


def test_a_shape_that_cannot_be_read_is_named():
    state = {"model": {"m.experts.lora_B.default": torch.zeros(3, 5)}, "optim": {"state": {}}}
    meta = _metadata({"model.m.experts.lora_B.default": _tensor(3, 8)})
    with pytest.raises(CheckpointError, match=r"holds .model.m.experts.lora_B.default. as \(3, 8\), this run as \(3, 5\)"):
        check_shapes(state, meta, PATH)


def test_an_expert_lora_b_saved_without_expert_parallelism_is_read_whole_then_kept():
    weight = torch.zeros(3, 2, 4)  # [out, r, E] (on one process: every expert)
    state = {"model": {"m.experts.lora_B.default": weight}, "optim": {"state": {}}}
    meta = _metadata({"model.m.experts.lora_B.default": _tensor(3, 8)})
    undo = as_saved_shapes(state, meta)
    check_shapes(state, meta, PATH)
    state["model"]["m.experts.lora_B.default"].copy_(torch.arange(24.0).view(3, 8))
    put_back(undo)
    assert state["model"]["m.experts.lora_B.default"] is weight
    assert torch.equal(weight, torch.arange(24.0).view(3, 2, 4))
