"""The long-context planner: host memory of an offload split, FSDP's share of the weights, the
longest sequence per policy x tiling x loss (estimates only; tiny and real presets on the meta
device, no weights)."""

from dataclasses import replace

import pytest

from hone.config import parse_config
from hone.transforms.auto_policy import decide_memory, offload_layers_choice
from hone.transforms.long_context import best_row, longest_table, render_longest
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.facts import model_facts
from hone.transforms.memory.knobs import Knobs
from hone.transforms.memory.longest import longest_sequence
from hone.transforms.memory.terms.offload import HOST_BASE_BYTES, HOST_MARGIN, host_process_bytes, offload_split, pinned_block
from hone.transforms.memory.terms.tiled_layers import auto_layer_chunks, tiled_layer_state_bytes
from hone.units import GIB

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _cfg(preset="tiny-llama", seq=4096, layers=4, **memory):
    model = {"preset": preset, "dtype": "bfloat16"}
    if preset.startswith("tiny"):
        model["preset_overrides"] = {"num_hidden_layers": layers}
    return parse_config(
        {
            "model": model,
            "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": seq},
            "adapter": {"type": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_modules": QKVO},
            "memory": memory,
        }
    )


def test_pinned_blocks_round_up_to_powers_of_two():
    assert [pinned_block(n) for n in (0, 1, 3, 4, 5, 4 * GIB, 4 * GIB + 1)] == [0, 1, 4, 4, 8, 4 * GIB, 8 * GIB]


def test_offload_split_keeps_what_the_host_cannot_hold():
    block = 4 * GIB  # qwen3-8b's layer input at 512K tokens
    assert offload_split(36, block, "auto", None) == 36
    assert offload_split(36, block, "auto", 1024 * GIB) == 36
    room = int(128 * GIB * (1 - HOST_MARGIN)) - host_process_bytes(block)
    assert offload_split(36, block, "auto", 128 * GIB) == room // block < 36
    assert offload_split(36, block, 5, 128 * GIB) == 5  # a count is taken as written
    assert offload_split(36, block, 99, None) == 36
    assert offload_split(36, block, "auto", HOST_BASE_BYTES) == 0


def test_a_split_moves_memory_from_the_host_to_the_gpu():
    cfg = _cfg(seq=8192, layers=6)
    # asking for all 6: under LoRA layer 0's input is a leaf autograd keeps, 5 can move
    est = {k: estimate_memory(cfg, Knobs(checkpointing="offload", loss="fused_linear_ce", offload_layers=k)) for k in (0, 3, 6)}
    one_input = 2 * 8192 * 64  # bf16 x tokens x hidden of tiny-llama
    assert [e.offloaded_layers for e in est.values()] == [0, 3, 5]
    assert [e.host for e in est.values()] == [0, 3 * pinned_block(one_input), 5 * pinned_block(one_input)]
    assert all(e.host_total == host_process_bytes(one_input) + e.host for e in est.values())
    # the kept layers' inputs are on the GPU (two more while the offloaded ones come back)
    assert est[0].activations > est[3].activations >= est[6].activations
    full = estimate_memory(cfg, Knobs(checkpointing="full", loss="fused_linear_ce"))
    assert est[0].total == full.total and full.host == 0  # nothing offloaded is full
    # the config's key is the default
    assert (
        estimate_memory(_cfg(seq=8192, offload_layers=2), Knobs(checkpointing="offload", loss="fused_linear_ce")).offloaded_layers
        == 2
    )


def test_tiled_layers_count_half_an_input_beside_the_pinned_blocks():
    # calibrated on H100 rows: untiled offload holds ~4 inputs beside its pinned blocks, tiled ~0.5
    cfg = _cfg(seq=8192, layers=6)
    one_input = 2 * 8192 * 64
    whole = estimate_memory(cfg, Knobs(checkpointing="offload", loss="fused_linear_ce"))
    tiled = estimate_memory(cfg, Knobs(checkpointing="offload", loss="fused_linear_ce", tiled_layers=4))
    assert tiled.tiled_layers == 4 and whole.tiled_layers == 0 and tiled.host == whole.host > 0
    assert tiled.host_total == host_process_bytes(one_input, tiled_layers=True) + tiled.host
    assert whole.host_total - tiled.host_total == int(3.5 * one_input)


def test_auto_split_follows_the_host_budget():
    cfg = _cfg(seq=8192)
    block = pinned_block(2 * 8192 * 64)
    host = host_process_bytes(2 * 8192 * 64) + 3 * block
    want = offload_split(3, block, "auto", host)  # layer 0's input stays (LoRA)
    est = estimate_memory(cfg, Knobs(checkpointing="offload", loss="fused_linear_ce", host_budget=host))
    assert est.offloaded_layers == want < 3
    layers, why = offload_layers_choice(cfg, 4, host)
    assert layers == want and "on the GPU" in why
    assert offload_layers_choice(cfg, 4, 1024 * GIB) == (None, offload_layers_choice(cfg, 4, 1024 * GIB)[1])
    assert offload_layers_choice(_cfg(offload_layers=9), 4)[0] is None  # more than there are: all
    assert offload_layers_choice(_cfg(offload_layers=1), 4)[0] == 1


def test_fsdp_shards_the_weights_and_leaves_room_for_activations():
    cfg = _cfg("qwen3-8b", seq=65536)
    one = estimate_memory(cfg, Knobs(checkpointing="full", loss="fused_linear_ce"))
    four = estimate_memory(cfg, Knobs(checkpointing="full", loss="fused_linear_ce", param_shards=4))
    assert four.weights < one.weights / 3 and four.param_shards == 4
    assert four.activations == one.activations
    with pytest.raises(ValueError, match="param_shards"):
        estimate_memory(cfg, Knobs(checkpointing="full", loss="fused_linear_ce", param_shards=0))


def test_tiled_auto_accounts_for_fsdp_sharding():
    """A card too small for the weights and the MLP's activations: one process tiles; with the
    weights sharded over 8 processes the same run fits untiled."""
    cfg = _cfg("qwen3-8b", seq=65536, activation_checkpointing="full")
    est = estimate_memory(cfg, Knobs(checkpointing="full", loss="fused_linear_ce"))
    tiled = estimate_memory(cfg, Knobs(checkpointing="full", loss="fused_linear_ce", tiled_mlp="auto"))
    assert tiled.total < est.total
    # a budget that the tiled run fits, the untiled not, on one process
    budget = int((tiled.total + est.total) / 2 / 0.9)
    assert decide_memory(cfg, "cuda", budget, host_budget=256 * GIB).shards > 0
    sharded = estimate_memory(cfg, Knobs(checkpointing="full", loss="fused_linear_ce", param_shards=8))
    assert sharded.total <= budget * 0.9
    assert decide_memory(cfg, "cuda", budget, host_budget=256 * GIB, param_shards=8).shards == 0


def test_longest_sequence_respects_the_host():
    cfg = _cfg("qwen3-8b", seq=4096)
    unlimited = longest_sequence(cfg, Knobs("offload", "fused_linear_ce", tiled_mlp="auto"), 80 * GIB, multiple=4096)
    host = longest_sequence(
        cfg, Knobs("offload", "fused_linear_ce", tiled_mlp="auto", host_budget=128 * GIB), 80 * GIB, multiple=4096
    )
    all_offloaded = longest_sequence(
        cfg,
        Knobs("offload", "fused_linear_ce", tiled_mlp="auto", host_budget=128 * GIB, offload_layers=36),
        80 * GIB,
        multiple=4096,
    )
    assert unlimited > host > all_offloaded > 0
    at = estimate_memory(
        cfg, Knobs(checkpointing="offload", loss="fused_linear_ce", sequence_len=host, tiled_mlp="auto", host_budget=128 * GIB)
    )
    assert at.total <= 80 * GIB and at.host_total <= 128 * GIB and at.offloaded_layers < 36


def test_longest_table_orders_the_switches():
    rows = longest_table(_cfg("qwen3-8b"), 80 * GIB, 128 * GIB)
    assert len(rows) == 4 * 2 * 2 + 2 * 3  # and full / offload with tiled layers, alone and in runs of 2 and 3
    by = {(r.checkpointing, r.tiled, r.loss): r.longest for r in rows if not r.layers_tiled}
    layered = {r.checkpointing: r for r in rows if r.layers_tiled and r.run_layers == 1}
    in_runs = {(r.checkpointing, r.run_layers): r for r in rows if r.run_layers > 1}
    for (policy, _), row in in_runs.items():  # one input per run instead of per layer: further still
        assert row.longest > layered[policy].longest and row.at_longest.run_layers == row.run_layers
    assert set(layered) == {"full", "offload"}
    for policy, row in layered.items():  # chunked layers rebuild less: they reach further
        assert row.longest > by[(policy, True, "fused_linear_ce")] and row.at_longest.tiled_layers >= 2
    for tiled in (False, True):
        for loss in ("standard", "fused_linear_ce"):
            assert by[("none", tiled, loss)] <= by[("full", tiled, loss)] <= by[("offload", tiled, loss)]
    assert by[("full", False, "standard")] < by[("full", False, "fused_linear_ce")]
    assert by[("offload", False, "fused_linear_ce")] < by[("offload", True, "fused_linear_ce")]
    best = best_row(rows)
    assert (best.checkpointing, best.tiled, best.loss, best.layers_tiled) == ("offload", True, "fused_linear_ce", True)
    assert best.run_layers > 1
    assert best.at_longest.total <= 80 * GIB and best.at_longest.host_total <= 128 * GIB
    text = "\n".join(render_longest(rows, 80 * GIB, 128 * GIB, "--host-memory"))
    assert "furthest" in text and "layers offloaded" in text and f"{best.longest:,}" in text
    cpu = longest_table(_cfg(), 8 * GIB, None, device="cpu", losses=("standard",))
    assert {r.checkpointing for r in cpu} == {"none", "selective", "full"}


def test_plan_cli_at_a_given_length_and_host(capsys, monkeypatch, hub_standins):
    """examples/long-context.yml names Qwen/Qwen3-8B: its config.json comes from a stand-in hub
    cache (tests/conftest.py), as a user's would from theirs."""
    from pathlib import Path

    from hone.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["plan", "examples/long-context.yml", "--gpu-memory", "80GiB", "--host-memory", "128GiB"]
    assert main([*args, "--seq-len", "524288", "--wide"]) == 0  # --wide: the table of every combination
    out = capsys.readouterr().out
    assert "1 x 524288 tokens" in out and "Longest sequence that fits 80.0 GiB of GPU and 128 GiB host" in out
    assert "layers offloaded" in out and "/36" in out and "furthest:" in out
    assert main([*args, "--seq-len", "524288"]) == 0  # by default its furthest row
    out = capsys.readouterr().out
    assert "Longest sequence with any switch: " in out and "Longest sequence that fits" not in out
    assert main([*args[:-1], "lots"]) != 0
    assert "--host-memory: 'lots' is not a memory size" in capsys.readouterr().err
    assert main([*args, "--seq-len", "2"]) != 0
    assert "--seq-len 2" in capsys.readouterr().err


def test_tiled_layers_rebuild_one_chunk_plus_the_key_value_state():
    cfg = _cfg("qwen3-8b", seq=524288)
    est = {
        k: estimate_memory(
            cfg, Knobs(checkpointing="offload", loss="fused_linear_ce", tiled_mlp="auto", tiled_layers=k, host_budget=128 * GIB)
        )
        for k in (0, 4, 16, "auto")
    }
    assert est[0].tiled_layers == 0 and est[4].tiled_layers == 4 and est["auto"].tiled_layers == auto_layer_chunks(524288) == 16
    assert est[0].recompute > est[4].recompute > est[16].recompute > tiled_layer_state_bytes(model_facts(cfg), 524288)
    assert est[16].total < est[4].total < est[0].total
    # the state: keys and values (bf16), their float32 gradient sums, the prefix copy and its
    # gradient per group of 4 query heads sharing a key head, plus their running sum
    kv = 8 * 128
    assert tiled_layer_state_bytes(model_facts(cfg), 1000) == 1000 * 2 * kv * (2 + 4 + 2 + 5 * 2)
    # a tiled layer is a checkpoint: other policies are estimated whole
    for policy in ("none", "selective"):
        assert (
            estimate_memory(
                cfg, Knobs(checkpointing=policy, loss="fused_linear_ce", tiled_layers=8, sequence_len=4096)
            ).tiled_layers
            == 0
        )


def _tiled_layers_decision(cfg, card_gib: float):
    import torch

    from hone.transforms.base import RunFacts
    from hone.transforms.planner import decisions

    facts = RunFacts(torch.device("cuda"), memory_bytes=int(card_gib * GIB), host_memory_bytes=125 * GIB)
    return next((on, why) for name, _, on, why in decisions(cfg, facts) if name == "tiled_layers")


def test_tiled_layers_auto_chunks_only_what_does_not_fit_whole():
    def long_cfg(**memory):
        return parse_config(
            {
                "model": {"preset": "qwen3-8b", "dtype": "bfloat16"},
                "data": {
                    "datasets": [{"path": "unused.jsonl", "type": "pretokenized"}],
                    "sequence_len": 262144,
                    "allow_longer_than_model": True,
                },
                "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": QKVO},
                "memory": {"activation_checkpointing": "offload", "tiled_mlp": "off", **memory},
            }
        )

    # 256K of qwen3-8b, eager layers: ~76 GiB whole, ~41 GiB chunked (offload, fused loss)
    on, why = _tiled_layers_decision(long_cfg(tiled_layers="auto"), 50)
    assert on and "8 chunks" in why and "does not fit" in why
    on, why = _tiled_layers_decision(long_cfg(tiled_layers="auto"), 100)
    assert not on and "fits with whole layers" in why
    on, why = _tiled_layers_decision(long_cfg(tiled_layers="auto"), 30)  # not even chunked
    assert not on and "does not fit chunked either" in why
    on, why = _tiled_layers_decision(long_cfg(tiled_layers="auto", activation_checkpointing="none"), 50)
    assert not on and "checkpointing none" in why
    on, why = _tiled_layers_decision(long_cfg(tiled_layers=4), 80)  # a count is taken as written
    assert on and why == "memory.tiled_layers: 4"


def _long_lora(seq: int, **memory):
    return parse_config(
        {
            "model": {"preset": "qwen3-8b", "dtype": "bfloat16"},
            "data": {
                "datasets": [{"path": "unused.jsonl", "type": "pretokenized"}],
                "sequence_len": seq,
                "allow_longer_than_model": True,
            },
            "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": QKVO},
            "memory": memory,
        }
    )


def _decided(cfg, card_gib: float = 80, host_gib: float = 128):
    import torch

    from hone.transforms.base import RunFacts
    from hone.transforms.decide import decide

    facts = RunFacts(torch.device("cuda"), memory_bytes=int(card_gib * GIB), host_memory_bytes=int(host_gib * GIB))
    return decide(cfg, facts), facts


def test_512k_of_qwen3_8b_lora_fits_one_80_gib_card_in_runs_of_two():
    """docs/long-context.md: the 36 layer inputs of 4 GiB each fit neither the card nor a 128 GiB
    host; one per run of two (18, 72 GiB, all on the host) does, with tiled layers and MLP."""
    from hone.transforms.memory.decide import fits_within

    cfg = _long_lora(524288)
    decided, facts = _decided(cfg)
    assert decided.checkpointing == "offload" and decided.run_layers == 2
    assert decided.tiled_layers_chunks >= 2 and decided.tiled_mlp_shards >= 2
    assert decided.offload_layers is None  # every run's first input but run 0's (a leaf under LoRA) on the host
    assert "checkpoint_run_layers: auto: 2" in decided.run_layers_why and "what fits" in decided.run_layers_why
    knobs = Knobs(
        "offload", "fused_linear_ce", tiled_mlp=decided.tiled_mlp_shards, tiled_layers=decided.tiled_layers_chunks,
        host_budget=128 * GIB,
    )  # fmt: skip
    alone = estimate_memory(cfg, knobs)
    runs = estimate_memory(cfg, replace(knobs, run_layers=2))
    assert not fits_within(alone, 80 * GIB, 128 * GIB) and fits_within(runs, 80 * GIB, 128 * GIB)
    assert runs.offloaded_layers == 17 and runs.host == 17 * 4 * GIB and runs.rebuilt_inputs == 4 * GIB
    assert runs.total < alone.total and runs.host < alone.host


def test_auto_keeps_one_input_per_layer_wherever_that_fits():
    decided, _ = _decided(_long_lora(262144))
    assert decided.run_layers == 1 and "fits with one input per layer" in decided.run_layers_why
    decided, _ = _decided(_long_lora(8192, activation_checkpointing="none"))
    assert decided.run_layers == 1 and "checkpointing none" in decided.run_layers_why
    decided, _ = _decided(_long_lora(8192, activation_checkpointing="full", checkpoint_run_layers=3))
    assert decided.run_layers == 3 and decided.run_layers_why == "memory.checkpoint_run_layers: 3"
    decided, _ = _decided(_long_lora(4 * 524288))  # 2M tokens: not even in runs
    assert decided.run_layers == 1 and "does not fit in runs of up to" in decided.run_layers_why


def test_runs_keep_one_input_per_run_and_rebuild_the_inner_ones():
    cfg = _cfg(seq=8192, layers=5)
    one_input = 2 * 8192 * 64
    full = estimate_memory(cfg, Knobs("full", "fused_linear_ce"))
    for k, runs in ((2, 3), (3, 2)):
        est = estimate_memory(cfg, Knobs("full", "fused_linear_ce", run_layers=k))
        assert est.run_layers == k and est.rebuilt_inputs == (k - 1) * one_input
        # (5 - runs) inputs fewer kept, (k - 1) rebuilt while the backward walks a run
        assert est.activations <= full.activations - (5 - runs - (k - 1)) * one_input < full.activations
    # offload: the split counts runs, and the offloaded ones are runs' inputs
    off = estimate_memory(cfg, Knobs("offload", "fused_linear_ce", run_layers=2, offload_layers=1))
    assert off.offloaded_layers == 1 and off.host == pinned_block(one_input)
    # selective keeps more than the inputs: runs do not apply
    assert estimate_memory(cfg, Knobs("selective", "fused_linear_ce", run_layers=2)).run_layers == 1
