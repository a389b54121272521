"""Whether preference pairs compute their prompt once (``training.preference.share_prompt``),
and through which attention, decided once per plan.

A shared-prompt pair (:mod:`hone.data.pairs`) needs attention that lets each completion see the
prompt but not the other completion: a tree, which plain document boundaries cannot say. Three
kernels can: torch's varlen flash kernel through hone's backend, given the rejected branch as a
segment whose keys are the prompt's gathered again (``varlen``); flex attention with a block
mask that skips the blocks nobody attends to (``flex``); sdpa with a dense mask (``mask``).
``auto`` shares wherever one of them runs the model as configured (sdpa or flex_attention, every
layer attending to the whole row, no attention sinks) and picks, for ``sdpa``, the varlen kernel
where it runs (CUDA, bf16/fp16, plain causal layers): in an H200 profile of a qwen3-8b DPO step
(benchmarks/2026-11-28-h200-dpo.md) that kernel's backward took 12 ms on the unshared rows,
compiled flex attention's 40 ms on the shared row's tree mask.
Elsewhere, on a GPU with compiled layers, flex attention (it computes only the blocks the tree
keeps, where sdpa's masked kernel computes every block), else sdpa with the dense mask (flex
attention uncompiled materialises the scores).
"""

from typing import Any, Literal

from hone.config.root import HoneConfig
from hone.models.attention.setup import FLEX_MIN_HEAD_DIM, causal_blockers, varlen_blockers
from hone.models.model_dir import attention_head_dim
from hone.models.precision import precision_for
from hone.transforms.base import RunFacts

#: How a shared-prompt row reaches the attention: torch's varlen kernel with the prompt's keys
#: gathered for each rejected branch, flex attention with a block mask, or sdpa with a dense mask.
PromptKernel = Literal["varlen", "flex", "mask"]

#: The backends a shared-prompt row can run through (both take hone's mask).
SHARING_BACKENDS = ("sdpa", "flex_attention")


def model_config_of(cfg: HoneConfig) -> Any:
    """The model's transformers config, read once per decision (None where it cannot be read
    here: the loader says why; a plan line never fails on it)."""
    from hone.transforms.memory.facts import transformers_config

    try:
        return transformers_config(cfg.model)
    except Exception:  # noqa: BLE001
        return None


def sharing_blockers(cfg: HoneConfig, config: Any = None) -> list[str]:
    """Why this run's pairs cannot share their prompt (empty: they can); ``config``: the model's
    transformers config (:func:`model_config_of`), whose own attention a tree mask may not serve."""
    blockers = []
    name = cfg.model.attn_implementation
    if name not in SHARING_BACKENDS:
        blockers.append(
            f"model.attn_implementation: {name} cannot take the tree mask a shared prompt needs (sdpa or flex_attention can)"
        )
    return blockers + ([f"the model has {what}" for what in causal_blockers(config)] if config is not None else [])


def share_prompt_choice(cfg: HoneConfig, facts: RunFacts, compiles: bool) -> tuple[bool, PromptKernel | None, str]:
    """(shares, kernel, why) of ``training.preference.share_prompt`` on this run (module
    docstring). ``true`` where the pairs cannot share is a problem of the attention transform's
    check (:func:`sharing_problems`), not decided here."""
    t = cfg.training
    key = "training.preference.share_prompt"
    if not t.is_preference:
        return False, None, f"training.objective: {t.objective} trains no pairs"
    if t.preference.share_prompt is False:
        return False, None, f"{key}: false: the prompt computed with each completion"
    config = model_config_of(cfg)
    blockers = sharing_blockers(cfg, config)
    if blockers:
        return False, None, f"{key}: {str(t.preference.share_prompt).lower()}: off, " + "; ".join(blockers)
    # flex attention has no dropout: a model that drops attention probabilities keeps sdpa
    dropout = cfg.model.attn_implementation == "sdpa" and bool(getattr(config, "attention_dropout", 0.0))
    head_dim = None if config is None else attention_head_dim(config)
    narrow = head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
    compiled_gpu = facts.device.type == "cuda" and compiles
    if cfg.model.attn_implementation == "sdpa" and cfg.model.sdpa_varlen is False:
        return True, "mask", f"{key}: each prompt once, sdpa with a tree mask (model.sdpa_varlen: false: always the mask)"
    if cfg.model.attn_implementation == "sdpa" and (cfg.model.sdpa_varlen is True or _varlen_runs(cfg, facts, config)):
        return (
            True,
            "varlen",
            f"{key}: each prompt once, torch's varlen kernel with the prompt's keys gathered for each rejected branch",
        )
    if cfg.model.attn_implementation == "flex_attention" or (compiled_gpu and not dropout and not narrow):
        return True, "flex", f"{key}: each prompt once, flex attention with a tree block mask (compiled)"
    if narrow and compiled_gpu:
        narrow_why = f"heads of {head_dim} < {FLEX_MIN_HEAD_DIM}, too narrow for compiled flex attention"
        return True, "mask", f"{key}: each prompt once, sdpa with a tree mask ({narrow_why})"
    return True, "mask", f"{key}: each prompt once, sdpa with a tree mask"


def _varlen_runs(cfg: HoneConfig, facts: RunFacts, config: Any) -> bool:
    """Whether torch's varlen kernel runs this model here (as the attention transform will find
    once the model is loaded: :func:`~hone.models.attention.setup.varlen_blockers`)."""
    compute = precision_for(cfg.model.dtype, full_finetune=not cfg.adapter.is_lora).compute
    return config is not None and not varlen_blockers(config, facts.device, compute)


def sharing_problems(cfg: HoneConfig) -> list[str]:
    """``share_prompt: true`` where the pairs cannot share: each reason, naming the key."""
    if not cfg.training.is_preference or cfg.training.preference.share_prompt is not True:
        return []
    return [
        f"training.preference.share_prompt: true, but {why}: set share_prompt: auto (the prompt then goes with each "
        "completion), or change what is named"
        for why in sharing_blockers(cfg, model_config_of(cfg))
    ]


def pair_rows_config(cfg: HoneConfig, facts: RunFacts, share_prompt: bool) -> HoneConfig:
    """``cfg`` as the memory decisions see a preference run whose data statistics are known
    (``facts.pair_splits``, the run's; ``hone plan``'s where the data is prepared, else it keeps
    ``cfg``): each pair's two sequences at the length that makes a micro-batch's row as wide as
    its widest possible row (:func:`hone.data.pairs.fixed_pair_rows`: the longest pair, the
    prompt once when shared), instead of two full ``sequence_len`` sequences. On qwen3-8b DPO pairs of 512 + 768 + 768
    tokens at ``sequence_len`` 1280 a row is 2,064 tokens, not 2,560: the estimate was 2 GiB above
    the H200's measured peaks (benchmarks/2026-11-29-h200-dpo-graphs.md). Never longer than
    ``sequence_len``."""
    from hone.data.pairs import fixed_pair_rows

    if not cfg.training.is_preference or not facts.pair_splits:
        return cfg
    pairs = cfg.training.micro_batch_size
    width = fixed_pair_rows(facts.pair_splits, pairs, share_prompt).width
    length = -(-width // (2 * pairs))
    if length >= cfg.data.sequence_len:
        return cfg
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"sequence_len": length})})
