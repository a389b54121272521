"""Builders for hone's tests: a tokenizer trained in memory, tiny models (saved or not), random
token rows and documents, packed-parity helpers, and a valid config for loop tests.

Tests never download; these give them real (if small) tokenizers, models and data in well
under a second, all drawn from seeds. One module in the package (not a conftest) so unit,
integration and GPU tests, and benchmarks' smoke tests, share them.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from hone.config.adapter import AdapterConfig
from hone.config.model import PresetName
from hone.config.root import HoneConfig
from hone.data.collate import collate_packed
from hone.models.adapters import apply_adapter
from hone.models.presets import build_preset_config
from hone.runtime.loss import forward_logits

if TYPE_CHECKING:
    from datasets import Dataset

    from hone.runtime.world import World
    from hone.transforms.base import RunHooks


def _seeded_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A float32 model of ``config`` whose random weights depend on ``seed`` only."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ---------------------------------------------------------------- tokenizer and models

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A lemon is yellow and a lime is green.",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\n### Input:\n### Response:\n",
    "Fine-tuning adapts a pretrained language model to a new task with a little data.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000, red green blue; what? why! (yes) [no] {maybe}",
]


def tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with pad/bos/eos tokens and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model(preset: PresetName, tokenizer, seed: int = 0, **overrides) -> PreTrainedModel:
    """A float32 model of a tiny preset with random weights drawn from ``seed``."""
    config = build_preset_config(preset, overrides, len(tokenizer))
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    return _seeded_model(config, seed)


def save_tiny_model(path: Path, preset: PresetName, tokenizer, seed: int = 0, **overrides) -> Path:
    """Write a tiny model and its tokenizer as a save_pretrained directory (safetensors)."""
    model = tiny_model(preset, tokenizer, seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def with_random_lora(model: PreTrainedModel, seed: int, rank: int = 4):
    """``model`` with LoRA on every linear layer, its B matrices random instead of PEFT's zeros
    (zero B makes every A gradient zero, and a gradient test of zeros cannot fail)."""
    model = apply_adapter(model, AdapterConfig(type="lora", lora_r=rank, lora_target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.1
    return model


def greedy_by_hand(model, tokenizer, text: str, steps: int, add_special_tokens: bool = True) -> str:
    """The reference for hone's generation: tokenize ``text``, then append the argmax token
    ``steps`` times (stopping at EOS) with one full forward each, no cache; the new text."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens).input_ids
    start = ids.shape[1]
    with torch.no_grad():
        for _ in range(steps):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            if next_id.item() == tokenizer.eos_token_id:
                break
    return tokenizer.decode(ids[0, start:], skip_special_tokens=True)


def sdpa_llama(tokenizer, adapter: str, *, seed: int, layers: int, hidden: int, seq: int) -> PreTrainedModel:
    """A small sdpa Llama for the GPU checkpointing tests (MLP 2x hidden, heads of 32), with
    random-B LoRA on every linear (``adapter: lora``, seeds ``seed + 1`` / ``seed + 2``) or none."""
    model = tiny_model(
        "tiny-llama",
        tokenizer,
        seed=seed,
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        head_dim=32,
        max_position_embeddings=seq,
    )
    model.config._attn_implementation = "sdpa"
    if adapter == "lora":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            model = with_random_lora(model, seed=seed + 2)
    return model


# ---------------------------------------------------------------- the training loop's builders

VOCAB = 97


def tiny_llama(
    seed: int = 0, *, vocab: int = VOCAB, dropout: float = 0.0, freeze_embeddings: bool = True, head_dim: int = 8
) -> PreTrainedModel:
    """A 2-layer float32 Llama with random weights drawn from ``seed``.

    ``freeze_embeddings`` leaves the input embedding frozen, so the trainable set is a strict
    subset of the weights (as with adapters) and checkpoints must restore only that subset.
    """
    # the tiny-llama preset, narrower still: loop tests build hundreds of these
    overrides = dict(
        hidden_size=32, intermediate_size=64, head_dim=head_dim, max_position_embeddings=128, attention_dropout=dropout
    )
    config = build_preset_config("tiny-llama", overrides, vocab)
    config.pad_token_id = 0
    model = _seeded_model(config, seed)
    model.config._attn_implementation = "eager"
    if freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def random_rows(
    n: int,
    *,
    seed: int,
    vocab: int = VOCAB,
    min_len: int = 5,
    max_len: int = 24,
    prompt_frac: float = 0.3,
    as_list: bool = False,
) -> "Dataset | list[dict[str, list[int]]]":
    """``n`` rows of random tokens with unequal lengths; a random-length prompt prefix is
    masked (-100) as an instruction dataset's would be. A ``datasets.Dataset``, or a plain
    list of row dicts with ``as_list`` (the loop accepts both)."""
    gen = torch.Generator().manual_seed(seed)
    ids, labels = [], []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        row = torch.randint(1, vocab, (length,), generator=gen).tolist()
        prompt = int(torch.randint(0, max(1, int(length * prompt_frac)) + 1, (1,), generator=gen))
        ids.append(row)
        labels.append([-100] * prompt + row[prompt:])
    if as_list:
        return [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]  # noqa: E741
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": ids, "labels": labels})


def random_pairs(n: int, seed: int, vocab: int = VOCAB, shortest_prompt: int = 2) -> list[dict[str, list[int]]]:
    """``n`` preference pairs of random ids (as a ``preference`` split's rows): prompts of
    ``shortest_prompt``-9 tokens, completions of 1-8, a pair's two never equal."""
    import random

    gen = random.Random(seed)

    def ids(low: int, high: int) -> list[int]:
        return [gen.randrange(1, vocab) for _ in range(gen.randint(low, high))]

    pairs = []
    for _ in range(n):
        chosen, rejected = ids(1, 8), ids(1, 8)
        while rejected == chosen:
            rejected = ids(1, 8)
        pairs.append({"prompt_ids": ids(shortest_prompt, 9), "chosen_ids": chosen, "rejected_ids": rejected})
    return pairs


def random_documents(lengths: Sequence[int], seed: int) -> list[dict[str, list[int]]]:
    """Documents of random token ids with ``lengths``, labelled as prepared rows are (a
    document's first token has nothing before it to be predicted from)."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for length in lengths:
        ids = torch.randint(7, 300, (length,), generator=gen).tolist()
        docs.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return docs


def packed_document_logits(
    model: torch.nn.Module,
    docs: Sequence[dict[str, list[int]]],
    bins: Sequence[Sequence[int]],
    width: int,
    autocast_dtype: torch.dtype | None = None,
) -> dict[int, torch.Tensor]:
    """Each document's logits from one packed forward (``bins[r]``: the documents of row ``r``)
    through the loop's own forward, so the mask or boundaries training hands the model are
    what a parity test checks."""
    device = next(model.parameters()).device
    batch = collate_packed([[docs[i] for i in b] for b in bins], width, pad_id=0).to(device)
    out = forward_logits(model, batch, autocast_dtype)
    pieces = {}
    for row, b in enumerate(bins):
        at = 0
        for i in b:
            n = len(docs[i]["input_ids"])
            pieces[i] = out[row, at : at + n]
            at += n
    return pieces


def document_logits_alone(model: torch.nn.Module, doc: dict[str, list[int]]) -> torch.Tensor:
    """One document's logits on its own. The explicit all-ones mask sends hone's varlen sdpa
    down transformers' sdpa path, so a parity test's reference is never the code under test."""
    ids = torch.tensor([doc["input_ids"]], device=next(model.parameters()).device)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]


def tiny_config(output_dir: Path, **sections: dict[str, Any]) -> HoneConfig:
    """A valid config for loop tests: fp32, no adapter, plain console output, tiny intervals.

    ``sections`` override keys per section, e.g. ``training={"max_steps": 3}``.
    """
    raw: dict[str, Any] = {
        "model": {"preset": "tiny-llama", "dtype": "float32"},
        "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": 64},
        "adapter": {"type": "none"},
        "training": {"output_dir": str(output_dir), "max_steps": 4, "micro_batch_size": 2, "seed": 7},
        "optimizer": {"learning_rate": 1e-2, "lr_scheduler": "constant", "fused": False},
        "logging": {"tensorboard": False, "plot": False, "progress_bar": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
        if section == "training" and "num_epochs" in values:
            raw["training"].pop("max_steps", None)
    return HoneConfig.model_validate(raw)


def tiny_lora_run(data: Path, output_dir: Path, **sections: dict[str, Any]) -> tuple[list[tuple[float, float]], dict[str, Any]]:
    """Train a tiny fp32 Qwen3 with LoRA on every linear (sdpa, 2 steps of 2 rows of 32 tokens,
    full checkpointing) through ``run_training`` on the CPU, as ``hone train`` would; returns
    each step's ``(loss, grad_norm)`` and the run's ``optimizations.json``. ``sections`` add keys
    per section (e.g. ``memory={"tiled_mlp": 3}``): two runs that differ in one optimization
    must train alike."""
    import io
    import json

    from rich.console import Console

    from hone.train.run import run_training

    raw: dict[str, Any] = {
        "model": {"preset": "tiny-qwen3", "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {
            "datasets": [{"path": str(data), "type": "pretokenized"}],
            "sequence_len": 32,
            "dataset_prepared_path": str(output_dir.parent / "cache"),
        },
        "adapter": {"type": "lora", "lora_r": 4, "lora_target_modules": "all-linear"},
        "training": {"max_steps": 2, "micro_batch_size": 2, "seed": 3, "output_dir": str(output_dir)},
        "optimizer": {"learning_rate": 2e-2, "adam_epsilon": 1e-3, "lr_scheduler": "constant"},
        "memory": {"activation_checkpointing": "full"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    steps: list[tuple[float, float]] = []
    run_training(
        HoneConfig.model_validate(raw),
        device="cpu",
        console=Console(file=io.StringIO(), width=300),
        step_callback=lambda m: steps.append((m.loss, m.grad_norm)),
    )
    return steps, json.loads((output_dir / "optimizations.json").read_text())


def hook_count(model: torch.nn.Module) -> int:
    """Forward, forward-pre and backward hooks on every module of ``model``: a transform that
    wraps layers must leave as many behind as it found."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


@contextmanager
def counting_grad_accumulations(model: torch.nn.Module) -> Iterator[dict[str, int]]:
    """Within the block, how many times each trainable parameter of ``model`` has its gradient
    accumulated (by name): once per backward, whatever a transform splits the work into."""
    counts: dict[str, int] = {}
    handles = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: counts.__setitem__(n, counts.get(n, 0) + 1))
        for n, p in model.named_parameters()
        if p.requires_grad
    ]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def run_hooks(model: torch.nn.Module, loss: str = "standard", device: str = "cpu"):
    """The hooks the plan gives the loop for ``model`` (loss function, attention layout), drawn
    up through the planner as a run would, with ``performance.loss: loss``."""
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    cfg = tiny_config(Path("unused"), performance={"loss": loss})
    facts = RunFacts(torch.device(device))
    return plan_optimizations(cfg, facts).hooks(model, cfg, facts)


def plan_hooks(
    model: torch.nn.Module, cfg: HoneConfig, device: str | torch.device = "cpu", world: "World | None" = None
) -> "RunHooks":
    """The hooks the plan of ``cfg`` gives ``train_loop`` for ``model`` (taken as it is: no
    ``model`` hook of the plan is applied), drawn up for ``device`` and ``world`` (default: the
    process group joined, if any) as a run would."""
    from hone.runtime.world import current_world
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    facts = RunFacts(torch.device(device), world=world or current_world())
    return plan_optimizations(cfg, facts).hooks(model, cfg, facts)


def offload_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and trainable gradients of one micro-batch (``labels = ids``), through the offload
    seam as the loop calls it, so every checkpointing policy (offload's side streams included)
    is compared on the same path. On CUDA the host waits for the device before the gradients
    are copied."""
    from hone.transforms.checkpointing import offload_step_context

    model.zero_grad(set_to_none=True)
    with offload_step_context(model):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


class OneProjection(torch.nn.Module):
    """A model of one linear layer named ``proj``, for PEFT to wrap (``target_modules=["proj"]``)
    when a test needs a single LoRA layer around a given base layer."""

    def __init__(self, proj: torch.nn.Module) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of ``ids`` as its own labels: the loss and every trainable
    parameter's gradient, in float32 (for comparing runs of different dtypes or layouts)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def norm_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms): how far a gradient is from its reference."""
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
