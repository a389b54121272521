"""``distributed.expert_parallel: auto`` in a 2-rank training run (gloo): on a device budget
that the replicated training state of the tiny Qwen3-MoE does not fit but the split one does,
the plan splits the experts over both ranks, and the run trains exactly as the same config with
``expert_parallel: 2`` written (the same final weights, bit for bit): every transform reads the
decided size, not the config's ``auto``. On the CPU without a budget (the processes share the
host) ``auto`` keeps 1. The rule itself is tested in tests/unit/test_expert_parallel_auto.py."""

import torch
from ep_training import Case, expert_parallel_model, make_config, run, trainable
from fsdp_harness import save, spawn

SEED = 7
CASE = Case("lora", False)


def _budget(cfg) -> int:
    """Bytes between the split and the replicated training state (at the fit fraction)."""
    from hone.transforms.data_parallel import FIT_FRACTION, training_state_bytes
    from hone.transforms.expert_parallel import with_expert_parallel

    replicated = training_state_bytes(with_expert_parallel(cfg, 1), "cpu")
    split = training_state_bytes(with_expert_parallel(cfg, 2), "cpu")
    assert split < replicated
    return int((split + replicated) / 2 / FIT_FRACTION)


def _worker(rank: int, out) -> None:
    from hone.runtime.world import current_world
    from hone.transforms.base import RunFacts
    from hone.transforms.decide import decide

    world = current_world()
    results = {}
    for written in ("auto", 2):
        cfg = make_config(out / str(written), CASE, accumulation=1, expert_parallel=written)
        facts = RunFacts(torch.device("cpu"), world=world, memory_bytes=_budget(cfg))
        decided = decide(cfg, facts)
        model = expert_parallel_model(CASE, SEED, cfg, facts)
        run(model, cfg, world, facts, SEED)
        results[written] = {"decided": (decided.expert_parallel, decided.expert_parallel_why), "weights": trainable(model)}
        if written == "auto":
            results["no budget"] = decide(cfg, RunFacts(torch.device("cpu"), world=world)).expert_parallel
    save(results, out / f"{rank}.pt")


def test_auto_splits_the_experts_and_trains_as_the_written_size(tmp_path):
    for written in ("auto", "2"):
        (tmp_path / written).mkdir()
    spawn(_worker, 2, tmp_path, timeout_s=300)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        size, why = got["auto"]["decided"]
        assert size == 2 and why.startswith("distributed.expert_parallel: auto: 2"), why
        assert got[2]["decided"][0] == 2
        auto, written = got["auto"]["weights"], got[2]["weights"]
        assert auto.keys() == written.keys()
        for name, weight in written.items():
            assert torch.equal(auto[name], weight), (rank, name)
        assert got["no budget"] == 1
