"""Build the tiny tokenizer bundled in ``hone/assets/tokenizer`` (the outputs are committed).

Presets and tests need a tokenizer without a model hub, so hone ships its own: a byte-level
BPE (every byte sequence is encodable, nothing maps to ``<unk>``) with a 2048-token vocabulary,
trained on the sample datasets in ``examples/data`` plus generated English-like text, so the
sample task tokenizes compactly while arbitrary text still works.

Special tokens (ids 0-3, in this order):

- ``<|begin_of_text|>`` (bos): added in front of every encoded text by the post-processor
  (``add_special_tokens=True``) and written by the chat template itself.
- ``<|im_start|>``: opens a chat turn.
- ``<|im_end|>`` (eos): closes a chat turn; also the end-of-sequence token appended to alpaca
  and completion rows, so generation stops the same way in every format.
- ``<|pad|>``: padding, distinct from eos so padding can never be mistaken for a trained stop.

Deterministic: the corpus is generated from a fixed seed and BPE training breaks ties by pair
order, so rerunning the script rewrites identical files.

Usage: ``python scripts/build_tokenizer.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "hone" / "assets" / "tokenizer"
SAMPLES = REPO / "examples" / "data"
VOCAB_SIZE = 2048
SEED = 0

BOS, IM_START, EOS, PAD = "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, IM_START, EOS, PAD]

#: ChatML turns; the bos token comes from the template (texts are tokenized without adding
#: special tokens, as ``apply_chat_template`` does). ``add_generation_prompt`` opens an
#: assistant turn.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_WORDS = """
the of and to in is was for on that with as by at from it his her their this an be are or
have has had not but what all were when we there can one which you she he they will would
time people year way day man woman child world life hand part place case week company system
program question work number night point home water room mother area money story fact month
lot right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea kid
body information back parent face others level office door health person art war history
party result change morning reason research girl guy moment air teacher force education
small large good new first last long great little own other old big high different young
important public bad same able early few late hard major better best free sure real open
make know take see come think look want give use find tell ask seem feel try leave call keep
let begin help talk turn start show hear play run move like live believe hold bring happen
write provide sit stand lose pay meet include continue set learn lead understand watch follow
stop create speak read allow add spend grow offer remember love consider appear buy wait
serve die send expect build stay fall cut reach kill remain suggest raise pass sell require
report decide pull quickly slowly never always often sometimes today tomorrow yesterday here
""".split()

_TEMPLATES = [
    "{A} {n1} {v} the {n2}.",
    "The {adj} {n1} {v} {n2} {adv}.",
    "Why does the {n1} {v} the {n2}?",
    "{A} {adj} {n1} and {num} {n2}s.",
    "In {year}, the {n1} was {adj}.",
    '"{A} {n1}," she said, "is {adj}."',
    "We {v} {num} {n2}s; the {n1} {v} {adv}!",
]


def english_like_text(rng: random.Random, n: int) -> Iterator[str]:
    """Sentences from a small grammar over common English words, digits and punctuation, so the
    vocabulary covers ordinary text and not only the sample task."""
    nouns = [w for w in _WORDS if len(w) > 3]
    adjs = ["small", "large", "good", "new", "old", "big", "high", "young", "early", "hard", "real", "open", "red", "blue"]
    verbs = ["makes", "takes", "sees", "finds", "tells", "keeps", "holds", "brings", "writes", "reads", "builds", "follows"]
    advs = ["quickly", "slowly", "never", "always", "often", "today", "here"]
    for _ in range(n):
        template = rng.choice(_TEMPLATES)
        yield template.format(
            A=rng.choice(["A", "The", "This", "Every", "One"]),
            n1=rng.choice(nouns),
            n2=rng.choice(nouns),
            adj=rng.choice(adjs),
            v=rng.choice(verbs),
            adv=rng.choice(advs),
            num=rng.randint(0, 999),
            year=rng.randint(1800, 2030),
        )


def sample_texts() -> Iterator[str]:
    """Every string field of the sample datasets, plus the alpaca prompt's fixed text."""
    for name in ("chat_sample.jsonl", "alpaca_sample.jsonl", "completion_sample.jsonl"):
        with (SAMPLES / name).open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                for message in row.get("messages", []):
                    yield f"{message['role']}\n{message['content']}\n"
                for key in ("instruction", "input", "output", "text"):
                    if row.get(key):
                        yield row[key]
    for _ in range(200):
        yield "### Instruction:\n\n### Input:\n\n### Response:\n"


def corpus() -> list[str]:
    rng = random.Random(SEED)
    return list(sample_texts()) + list(english_like_text(rng, 6000))


def build(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        add_bos_token=True,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    # Write next to the target, then swap in: the asset directory is never half-written.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fast.save_pretrained(str(staging))
        # transformers does not write add_bos_token back; record it so the post-processor is
        # rebuilt the same way if anything ever regenerates it from the config.
        config_file = staging / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        config["add_bos_token"] = True
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            out.rename(old)
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    args = parser.parse_args()
    build(args.out)
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({total} bytes): {', '.join(sorted(p.name for p in args.out.iterdir()))}")


if __name__ == "__main__":
    main()
