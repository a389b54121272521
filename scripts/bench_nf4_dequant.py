"""Micro-benchmark: NF4 dequantization and 4-bit linear layers on one GPU, hone vs torchao vs
bitsandbytes, at Qwen3-8B's linear shapes (bf16 compute).

Not a test. For each projection shape it times (CUDA events, warm-up, median of ``--repeats``):

- ``dequant``: the 4-bit weight to bf16 alone: hone's Triton op (``hone::nf4_dequantize``),
  torchao's ``NF4Tensor.get_original_weight`` (eager PyTorch), bitsandbytes'
  ``dequantize_4bit`` (CUDA kernel);
- ``fwd``: ``x @ W.T`` for ``--tokens`` rows (hone's ``NF4Linear``, torchao's ``linear_nf4``,
  bitsandbytes' ``Linear4bit``), beside the plain bf16 matmul;
- ``fwd+bwd``: the same plus the input gradient (the frozen base's share of a LoRA backward).

and prints a markdown table, with ``exact`` saying whether hone's dequantized weight equals
torchao's bit for bit. Each variant runs in its own try/except: an error is a row.

    PYTHONPATH=$PWD python scripts/bench_nf4_dequant.py               # ~1 min on an H100
    PYTHONPATH=$PWD python scripts/bench_nf4_dequant.py --tokens 4096 --repeats 50
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

#: (name, out_features, in_features) of Qwen3-8B's linear layers.
SHAPES = [("q_proj/o_proj", 4096, 4096), ("k_proj/v_proj", 1024, 4096), ("gate/up_proj", 12288, 4096), ("down_proj", 4096, 12288)]


def _time(fn: Callable[[], object], repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fwd_bwd(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    grad = torch.randn(x.shape[0], 1, device=x.device, dtype=x.dtype)

    def step():
        x.grad = None
        out = layer(x)
        out.backward(grad.expand_as(out))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

    from hone.models.nf4 import NF4Linear

    device = torch.device("cuda")
    dtype = torch.bfloat16
    rows = []
    for name, out_f, in_f in SHAPES:
        torch.manual_seed(0)
        linear = torch.nn.Linear(in_f, out_f, bias=False, device=device, dtype=dtype).requires_grad_(False)
        hone_layer = NF4Linear.from_linear(linear, device)
        ao_weight = to_nf4(linear.weight.detach(), 64, 256)
        bnb_layer = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=dtype, compress_statistics=True, quant_type="nf4")
        bnb_layer.weight = bnb.nn.Params4bit(
            linear.weight.detach().cpu(), requires_grad=False, compress_statistics=True, quant_type="nf4"
        )
        bnb_layer = bnb_layer.to(device)
        exact = torch.equal(hone_layer.dequantize(), ao_weight.get_original_weight())
        x = torch.randn(args.tokens, in_f, device=device, dtype=dtype, requires_grad=True)
        variants: dict[str, dict[str, Callable[[], object]]] = {
            "bf16 nn.Linear": {"fwd": lambda: linear(x), "fwd+bwd": _fwd_bwd(linear, x)},
            "hone (Triton op)": {
                "dequant": hone_layer.dequantize,
                "fwd": lambda: hone_layer(x),
                "fwd+bwd": _fwd_bwd(hone_layer, x),
            },
            "torchao NF4Tensor": {
                "dequant": ao_weight.get_original_weight,
                "fwd": lambda: linear_nf4(x, ao_weight),
                "fwd+bwd": _fwd_bwd(lambda t: linear_nf4(t, ao_weight), x),
            },
            "bitsandbytes Linear4bit": {
                "dequant": lambda: bnbf.dequantize_4bit(bnb_layer.weight.data, bnb_layer.weight.quant_state),
                "fwd": lambda: bnb_layer(x),
                "fwd+bwd": _fwd_bwd(bnb_layer, x),
            },
        }
        for variant, fns in variants.items():
            row = {"shape": f"{name} {out_f}x{in_f}", "variant": variant}
            for what in ("dequant", "fwd", "fwd+bwd"):
                if what not in fns:
                    row[what] = "-"
                    continue
                try:
                    with torch.no_grad() if what != "fwd+bwd" else torch.enable_grad():
                        row[what] = f"{_time(fns[what], args.repeats):.3f}"
                except Exception as exc:  # noqa: BLE001 - a row, not the end of the run
                    row[what] = f"error: {type(exc).__name__}: {str(exc)[:60]}"
            row["exact"] = ("yes" if exact else "NO") if variant.startswith("hone") else ""
            rows.append(row)
        del hone_layer, ao_weight, bnb_layer, linear, x
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, bf16, {args.tokens} tokens, median of {args.repeats} (ms)\n")
    print("| shape | variant | dequant | fwd | fwd+bwd | bit-exact vs torchao |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {r['dequant']} | {r['fwd']} | {r['fwd+bwd']} | {r['exact']} |")


if __name__ == "__main__":
    main()
