"""Peer baseline for DPO: TRL's DPOTrainer with a PEFT LoRA, as a TRL user would run it.

The protocol of /work/shared/bench/peer_hf_peft.py (docs: benchmarks/README.md): a random-init
model of a real architecture built from its config (no weights, no downloads), synthetic data,
one setting per process, the median step time after warm-up and the peak of
``torch.cuda.max_memory_allocated``. Prints one line ``RESULT {json}`` and appends it to
``$OUT/peer.jsonl`` when OUT is set.

The data: ``--pairs`` pairs of a prompt of ``--prompt-len`` tokens and a chosen and a rejected
completion of ``--completion-len`` tokens each (the completion's last token is EOS, which TRL
appends), random ids. TRL tokenizes text itself, so the pairs are written as words of a
word-level tokenizer built here (one word = one token, no BOS): the sequences TRL trains are
exactly ``prompt-len + completion-len`` tokens, two per pair (chosen, rejected), unpadded.
The reference is TRL's default under PEFT: the same model with the adapter disabled, a
second forward each step (``--precompute-ref 1``: TRL's precomputed reference log-probs).

  python benchmarks/peer/trl_dpo.py --arch qwen3-8b --gc 1 --compile 0        # on a GPU
  python benchmarks/peer/trl_dpo.py --arch tiny --steps 3 --warmup 1          # CPU smoke test

Settings a TRL user has on one GPU, for the sweep to its best: gradient checkpointing
(``--gc``), ``torch.compile`` through the Trainer (``--compile``), the precomputed reference.
TRL 1.16 turns ``padding_free`` off with a warning (not available since its DPO refactor), and
``use_liger_kernel`` needs Liger (not installed on the bench machine); neither is offered. The
LM head: TRL 1.16 computes the per-token log-probabilities in tiles through its fused LM head
(``add_fused_lm_head``), never materialising [tokens x vocab] logits.

FLOP model (for the MFU column, vs 989 TFLOP/s bf16 dense of an H100 SXM), per token of the two
sequences: policy forward + input-gradient backward 4 * N + reference forward 2 * N (LoRA: no
base weight gradients), attention 6 * L * s * d_attn (policy) + 2 * L * s * d_attn (reference),
with s = prompt-len + completion-len; N as in peer_hf_peft.py (embedding excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

ARCH: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=262144,
        rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    "tiny": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}  # fmt: skip

#: Ids of the word-level tokenizer's special tokens; every other id is the word ``t<id>``.
PAD, EOS, UNK = 0, 1, 2
FIRST_WORD = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="qwen3-8b", choices=sorted(ARCH))
    p.add_argument("--layers", type=int, default=0, help="override depth (0 = the architecture's)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per pair")
    p.add_argument("--completion-len", type=int, default=768, help="tokens of each completion (EOS included)")
    p.add_argument("--mbs", type=int, default=1, help="pairs per micro-batch (per_device_train_batch_size)")
    p.add_argument("--pairs", type=int, default=0, help="distinct pairs (0 = one per step)")
    p.add_argument("--steps", type=int, default=12, help="timed steps")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--gc", type=int, default=1, help="gradient checkpointing (non-reentrant)")
    p.add_argument("--compile", type=int, default=0, help="torch.compile through the Trainer (torch_compile=True)")
    p.add_argument("--precompute-ref", type=int, default=0, help="TRL's precompute_ref_log_probs")
    p.add_argument("--loss", default="sigmoid", choices=["sigmoid", "ipo"], help="DPOConfig.loss_type")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=0.0, help="lora_alpha (0 = 2 x rank)")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--cpu", type=int, default=-1, help="1: run on the CPU in float32 (-1: when CUDA is missing)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="auto: bf16 on a GPU, fp32 on CPU")
    a = p.parse_args(argv)
    if a.prompt_len < 1 or a.completion_len < 2:
        p.error("--prompt-len must be >= 1 and --completion-len >= 2 (a word and EOS)")
    if a.prompt_len + a.completion_len > ARCH[a.arch]["max_position_embeddings"]:
        p.error(f"--prompt-len + --completion-len is beyond {a.arch}'s max_position_embeddings")
    return a


def synth_pairs(count: int, prompt_len: int, completion_len: int, vocab_size: int, seed: int) -> list[dict[str, list[int]]]:
    """``count`` pairs of random word ids: a prompt of ``prompt_len``, a chosen and a rejected
    completion of ``completion_len - 1`` (TRL appends EOS), chosen != rejected."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(FIRST_WORD, vocab_size) for _ in range(prompt_len)]
        chosen = [rng.randrange(FIRST_WORD, vocab_size) for _ in range(completion_len - 1)]
        rejected = [rng.randrange(FIRST_WORD, vocab_size) for _ in range(completion_len - 1)]
        if rejected == chosen:
            rejected[0] = FIRST_WORD + (rejected[0] - FIRST_WORD + 1) % (vocab_size - FIRST_WORD)
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def as_text(pair: dict[str, list[int]]) -> dict[str, str]:
    """A pair as the text TRL tokenizes: words ``t<id>``; completions start with the space that
    separates them from the prompt, so the prompt's tokens are a prefix of prompt + completion."""
    words = {key: " ".join(f"t{i}" for i in ids) for key, ids in pair.items()}
    return {"prompt": words["prompt"], "chosen": " " + words["chosen"], "rejected": " " + words["rejected"]}


def word_tokenizer(vocab_size: int) -> Any:
    """A fast tokenizer with one token per word ``t<id>`` (ids FIRST_WORD..vocab_size-1), pad,
    EOS and unk; no BOS and no post-processor, so a text of n words is n ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK}
    vocab.update({f"t{i}": i for i in range(FIRST_WORD, vocab_size)})
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def flops_per_token(cfg: Any, n_params: int, seq: int) -> float:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d_attn = cfg.num_attention_heads * head_dim
    n = n_params - cfg.vocab_size * cfg.hidden_size  # the input embedding is a gather
    return 6 * n + 8 * cfg.num_hidden_layers * seq * d_attn


def arch_config(a: argparse.Namespace) -> Any:
    """The transformers config of ``--arch`` (and ``--layers``)."""
    from transformers import AutoConfig

    spec = dict(ARCH[a.arch])
    model_type = spec.pop("model_type")
    if a.layers:
        spec["num_hidden_layers"] = a.layers
    return AutoConfig.for_model(model_type, **spec)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    res = run_dpo(arch_config(a), a)
    res["arch"] = a.arch
    del res["step_times_s"]
    print("RESULT " + json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "peer.jsonl"), "a") as f:
            f.write(json.dumps(res) + "\n")
    return res


def run_dpo(cfg: Any, a: argparse.Namespace, on_step: Callable[[int, float, float | None], None] | None = None) -> dict[str, Any]:
    """Train ``a.warmup + a.steps`` DPO steps of a random-init model of ``cfg`` (a transformers
    config) and return the measurements, ``step_times_s`` (every step's seconds) included;
    ``on_step(step, seconds, loss)`` after each step (``hone bench``'s ``reference: trl-dpo``
    rows run the peer through this, with hone's preset config). The loss is known only at the
    last step (TRL logs once); the others get None."""
    import peft
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cpu = a.cpu == 1 or (a.cpu == -1 and not torch.cuda.is_available())
    device = "cpu" if cpu else "cuda"
    dtype = {"auto": torch.float32 if cpu else torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    n_params = sum(t.numel() for t in model.parameters())
    lora = LoraConfig(
        r=a.rank,
        lora_alpha=a.alpha or 2 * a.rank,
        lora_dropout=0.0,
        target_modules=a.targets.split(","),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)

    total = a.warmup + a.steps
    pairs = synth_pairs(a.pairs or total * a.mbs * a.accum, a.prompt_len, a.completion_len, cfg.vocab_size, seed=1)
    dataset = Dataset.from_list([as_text(p) for p in pairs])
    tokenizer = word_tokenizer(cfg.vocab_size)
    args = DPOConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "trl-dpo-peer"),
        per_device_train_batch_size=a.mbs,
        gradient_accumulation_steps=a.accum,
        max_steps=total,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        optim="adamw_torch_fused" if not cpu else "adamw_torch",
        max_grad_norm=1.0,
        bf16=dtype == torch.bfloat16 and not cpu,
        use_cpu=cpu,
        gradient_checkpointing=bool(a.gc),
        gradient_checkpointing_kwargs={"use_reentrant": False},
        torch_compile=bool(a.compile),
        beta=a.beta,
        loss_type=[a.loss],
        max_length=a.prompt_len + a.completion_len,
        precompute_ref_log_probs=bool(a.precompute_ref),
        logging_strategy="steps",
        logging_steps=total,  # one log, after the last timed step
        save_strategy="no",
        report_to="none",
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=0,
    )

    class StepTimer(TrainerCallback):
        """Wall time between the ends of consecutive optimizer steps (the first: from the start
        of training), each after a device synchronisation."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = 0.0

        def _now(self) -> float:
            if not cpu:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            if not cpu:
                torch.cuda.reset_peak_memory_stats()
            self.last = self._now()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            now = self._now()
            self.times.append(now - self.last)
            self.last = now
            if on_step is not None and len(self.times) < total:  # the last step reports with its loss, below
                on_step(len(self.times) - 1, self.times[-1], None)

    timer = StepTimer()
    trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
    sample = trainer.train_dataset[0]
    lengths = [len(sample["prompt_ids"]), len(sample["chosen_ids"]), len(sample["rejected_ids"])]
    if lengths != [a.prompt_len, a.completion_len, a.completion_len]:
        raise RuntimeError(f"TRL tokenized a pair to {lengths} tokens (prompt, chosen, rejected), expected "
                           f"{[a.prompt_len, a.completion_len, a.completion_len]}")  # fmt: skip
    trainer.train()
    timed = timer.times[a.warmup :]
    if len(timed) < a.steps:
        raise RuntimeError(f"{len(timer.times)} steps timed, expected {total}")
    med = statistics.median(timed)
    seq = a.prompt_len + a.completion_len
    tokens = 2 * seq * a.mbs * a.accum
    logged = next((h for h in reversed(trainer.state.log_history) if "loss" in h), {})
    if on_step is not None:
        on_step(total - 1, timer.times[-1], logged.get("loss"))
    res = dict(
        peer="trl-dpo", layers=cfg.num_hidden_layers, prompt_len=a.prompt_len,
        completion_len=a.completion_len, tokens_per_pair=a.prompt_len + 2 * a.completion_len, mbs=a.mbs, accum=a.accum, gc=a.gc,
        compile=a.compile, precompute_ref=a.precompute_ref, loss_type=a.loss, beta=a.beta,
        median_ms=round(med * 1000, 1), min_ms=round(min(timed) * 1000, 1), max_ms=round(max(timed) * 1000, 1),
        first_step_s=round(timer.times[0], 1), pairs_s=round(a.mbs * a.accum / med, 3), tok_s=round(tokens / med),
        peak_alloc_gb=None if cpu else round(torch.cuda.max_memory_allocated() / 2**30, 2),
        mfu_pct=round(flops_per_token(cfg, n_params, seq) * tokens / med / 989e12 * 100, 1),
        loss=logged.get("loss"), margin=logged.get("rewards/margins"),
        device="cpu" if cpu else torch.cuda.get_device_name(), torch=torch.__version__,
        transformers=transformers.__version__, peft=peft.__version__, trl=trl.__version__,
        step_times_s=timer.times,
    )  # fmt: skip
    return res


if __name__ == "__main__":
    main()
