"""Linear cross-entropy: ``sum_i CE(hidden_i @ weight.T, target_i)`` without the logits.

The standard loss builds the ``[tokens x vocab]`` logits and upcasts them to float32: at
Qwen's 151,936-word vocabulary and 24K tokens that is 14.6 GiB of float32 alone, plus the bf16
copy and its gradient. :func:`fused_linear_cross_entropy` walks the tokens in chunks and, for
each chunk, computes the logits (same rounding as the reference: the matmul in the inputs'
dtype, then float32), the logsumexp and the loss, and *at once* the gradient of the chunk's
logits, ``softmax - onehot``, which it turns into the chunk's share of the gradients of the
hidden states and of the head before moving on. Only ``[chunk x vocab]`` logits ever exist.
The backward has nothing left to do but scale the stored gradients by the incoming gradient
(a scalar: the loss is a sum). This is the technique of Liger-Kernel's fused linear
cross-entropy; Apple's Cut Cross-Entropy goes further by recomputing in the backward.

The whole computation is one ``torch.library`` custom op (``hone::fused_linear_cross_entropy``)
with a fake implementation and an autograd formula, so ``torch.compile(fullgraph=True)``
traces a model's loss through it without a graph break; its inside stays eager (a Python loop
over chunks, each a few large kernels).

The per-chunk softmax step has three implementations (``impl``):

- ``"torch"``: plain PyTorch ops, in place on a float32 copy of the chunk's logits.
- ``"compiled"``: the same function compiled by Inductor (fuses the upcast, logsumexp, exp
  and downcast into a couple of kernels); compiled lazily on first use.
- ``"triton"``: :mod:`hone.kernels.cross_entropy_triton`, in place on the chunk's logits in
  their own dtype (no float32 copy), CUDA only.

``"auto"`` is ``"triton"`` on CUDA and ``"torch"`` elsewhere: on an H100 (scripts/bench_fused_ce.py,
Qwen3-8B head, frozen, bf16) the Triton step makes the fused loss as fast as the compiled
reference (8.1 vs 7.8 ms at 2K tokens, 32.1 vs 30.6 at 8K, 95.9 vs 96.1 at 24K) in a tenth of
its memory (239 / 287 / 576 MiB vs 610 / 2,438 / 7,314 MiB), while the eager torch step is
1.8x slower and the Inductor-compiled one 10% slower (benchmarks/2026-11-26-h100-fused-ce.md).

The value is the loss **sum** in float32; hone divides by the accumulation window's trained
tokens itself (:mod:`hone.runtime.loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from hone.errors import HoneError
from hone.kernels.cross_entropy_triton import cross_entropy_softmax_grad_, triton_available

Impl = Literal["auto", "torch", "compiled", "triton"]
IMPLS: tuple[str, ...] = ("auto", "torch", "compiled", "triton")

# The float32 logits of one chunk stay within this budget. 512 MiB keeps a bf16 chunk's
# transient memory near 0.7-0.9 GiB (torch step: the float32 logits plus the gradient in bf16,
# briefly the matmul's bf16 output too; Triton step: only the bf16 logits, overwritten by their
# gradient), small beside an 8B model's activations, while a chunk is still hundreds of tokens:
# every matmul ([chunk x H] @ [H x V]) stays large enough to fill an H100.
DEFAULT_LOGITS_BUDGET_BYTES = 512 * 2**20
# Chunks are a multiple of this many tokens: tensor-core tiles are 16-aligned and cuBLAS's
# large tiles are 128 rows, so a multiple of 128 avoids a ragged tile in every chunk.
CHUNK_MULTIPLE = 128


class KernelUnavailableError(HoneError):
    """The requested kernel implementation cannot run here (e.g. Triton without CUDA)."""


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """The plain-PyTorch loss the fused op must equal: ``hidden [N, H] @ weight[V, H].T`` in the
    inputs' dtype, upcast to float32, summed cross entropy over targets != ``ignore_index``."""
    logits = hidden @ weight.T
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def default_chunk_tokens(n_tokens: int, vocab: int, budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES) -> int:
    """Tokens per chunk so that one chunk's float32 logits fit ``budget_bytes``: a multiple of
    :data:`CHUNK_MULTIPLE` (at least one, even past the budget), and no more than the tokens
    there are (rounded up to a multiple of 16). Qwen3 (V=151,936): 768 tokens; Llama 3
    (V=128,256): 1024."""
    per_budget = max(1, budget_bytes // (4 * vocab) // CHUNK_MULTIPLE) * CHUNK_MULTIPLE
    all_tokens = max(16, -(-n_tokens // 16) * 16)
    return min(per_budget, all_tokens)


def _softmax_grad_torch(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of the rows' losses w.r.t. ``logits``, in ``logits``' dtype; float32 per-row
    losses). Consumes ``logits`` (a fresh matmul output): works in place on its float32 upcast,
    which for float32 inputs is ``logits`` itself."""
    dtype = logits.dtype
    x = logits.float()
    del logits  # the caller passes a temporary: its [C, V] buffer is freed here, not after the step
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    lse = torch.logsumexp(x, dim=-1)
    target_logit = x.gather(1, safe.unsqueeze(1)).squeeze(1)
    losses = torch.where(valid, lse - target_logit, 0.0)
    grad = x.sub_(lse.unsqueeze(1)).exp_()
    grad.scatter_add_(1, safe.unsqueeze(1), torch.full_like(target_logit, -1.0).unsqueeze(1))
    grad.mul_(valid.unsqueeze(1))
    return grad.to(dtype), losses


_compiled_softmax_grad = None


def _softmax_grad_compiled(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_softmax_grad_torch` compiled by Inductor (once per process, on first use)."""
    global _compiled_softmax_grad
    if _compiled_softmax_grad is None:
        # Default dynamism: the first chunk shape compiles static, a second (the ragged last
        # chunk, or another batch size) recompiles once with a dynamic row count.
        _compiled_softmax_grad = torch.compile(_softmax_grad_torch)
    return _compiled_softmax_grad(logits, targets, ignore_index)


def _softmax_grad_triton(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    losses = cross_entropy_softmax_grad_(logits, targets, ignore_index, 0)
    return logits, losses


_STEPS = {"torch": _softmax_grad_torch, "compiled": _softmax_grad_compiled, "triton": _softmax_grad_triton}

# addmm with a float32 output from bf16/fp16 inputs exists on CUDA only; remembered per process
# if the running torch turns it down, to fall back to a matmul then a float32 add.
_addmm_out_dtype_ok = True


def accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """``grad_weight += grad_logits.T @ hidden`` with a float32 ``grad_weight``."""
    global _addmm_out_dtype_ok
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.T, hidden)
        return
    if grad_logits.is_cuda and _addmm_out_dtype_ok:
        try:
            torch.addmm(grad_weight, grad_logits.T, hidden, out_dtype=torch.float32, out=grad_weight)
            return
        except (RuntimeError, NotImplementedError, TypeError):
            _addmm_out_dtype_ok = False
    grad_weight.add_(grad_logits.T @ hidden)


@torch.library.custom_op("hone::fused_linear_cross_entropy", mutates_args=())
def _fused_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_tokens: int,
    impl: str,
    need_hidden_grad: bool,
    need_weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum float32 [], d loss/d hidden [N, H] in hidden's dtype or empty, d loss/d weight
    [V, H] in float32 or empty): the forward and both gradients, chunk by chunk. The head's
    gradient stays float32 until the backward scales it, so it is rounded once."""
    grad_hidden = hidden.new_empty(hidden.shape) if need_hidden_grad else hidden.new_empty(0)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None

    def take_grad(start: int, h: torch.Tensor, grad_logits: torch.Tensor) -> None:
        if need_hidden_grad:
            torch.mm(grad_logits, weight, out=grad_hidden[start : start + h.shape[0]])
        if grad_weight is not None:
            accumulate_weight_grad(grad_weight, grad_logits, h)

    # The reference's rounding: the matmul in the inputs' dtype
    grads = take_grad if need_hidden_grad or need_weight_grad else None
    loss = chunked_cross_entropy(hidden, targets, ignore_index, chunk_tokens, impl, lambda h: h @ weight.T, grads)
    if grad_weight is None:
        grad_weight = weight.new_empty(0, dtype=torch.float32)
    return loss, grad_hidden, grad_weight


def chunked_cross_entropy(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_tokens: int,
    impl: str,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    take_grad: Callable[[int, torch.Tensor, torch.Tensor], None] | None,
) -> torch.Tensor:
    """The float32 loss sum over ``chunk_tokens`` rows of ``hidden`` at a time: ``logits_of(h)``
    gives a chunk's logits (a fresh tensor the softmax step may free or overwrite), and
    ``take_grad(start, h, grad_logits)``, if given, turns the chunk's logit gradient into what
    the caller keeps before the next chunk's logits exist. One loop for every head (the plain
    matmul here, the float8 one of :mod:`hone.kernels.cross_entropy_fp8`)."""
    step = _STEPS[impl]
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        grad_logits, losses = step(logits_of(h), targets[start : start + chunk_tokens], ignore_index)
        loss += losses.sum()
        if take_grad is not None:
            take_grad(start, h, grad_logits)
        del grad_logits
    return loss


@_fused_op.register_fake
def _(hidden, weight, targets, ignore_index, chunk_tokens, impl, need_hidden_grad, need_weight_grad):
    loss = hidden.new_empty((), dtype=torch.float32)
    grad_hidden = hidden.new_empty(hidden.shape) if need_hidden_grad else hidden.new_empty(0)
    grad_weight = weight.new_empty(weight.shape if need_weight_grad else (0,), dtype=torch.float32)
    return loss, grad_hidden, grad_weight


# The backward scales a stored gradient a block of rows this large at a time.
_SCALE_BLOCK_BYTES = 64 * 2**20


def scaled_gradient(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad * scale`` with the product in float32, rounded once to ``dtype``. Multiplying a
    bf16 tensor by the 0-dim float32 ``scale`` would first round the scale (e.g. 1/tokens) to
    bf16, a bias of up to 0.4% on every element; row blocks keep the float32 temporaries small."""
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    rows = max(1, _SCALE_BLOCK_BYTES // (4 * max(1, grad.shape[1])))
    for start in range(0, grad.shape[0], rows):
        torch.mul(grad[start : start + rows].float(), scale, out=out[start : start + rows])
    return out


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, _, _, _, _, need_hidden_grad, need_weight_grad = inputs
    _, grad_hidden, grad_weight = output
    ctx.need_hidden_grad = need_hidden_grad
    ctx.need_weight_grad = need_weight_grad
    ctx.hidden_dtype = hidden.dtype
    ctx.weight_dtype = weight.dtype
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.mark_non_differentiable(grad_hidden, grad_weight)


def _backward(ctx, grad_loss, _grad_hidden_out, _grad_weight_out):
    grad_hidden, grad_weight = ctx.saved_tensors
    scale = grad_loss.float()
    d_hidden = scaled_gradient(grad_hidden, scale, ctx.hidden_dtype) if ctx.need_hidden_grad else None
    d_weight = scaled_gradient(grad_weight, scale, ctx.weight_dtype) if ctx.need_weight_grad else None
    return d_hidden, d_weight, None, None, None, None, None, None


_fused_op.register_autograd(_backward, setup_context=_setup_context)


def check_shapes(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, impl: str) -> None:
    """Refuse an unknown ``impl`` and operands that are not ``hidden [N, H]``, ``weight [V, H]``,
    ``targets [N]``."""
    if impl not in IMPLS:
        raise KernelUnavailableError(f"fused cross-entropy impl {impl!r} is not one of {', '.join(IMPLS)}")
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], targets [N]; "
            f"got {tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.shape[0] != targets.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shapes do not match: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )


def resolve_impl(hidden: torch.Tensor, impl: str, kernel: str = "fused cross-entropy") -> str:
    """``auto`` made concrete: Triton on CUDA where it is installed, else torch; an explicit
    ``triton`` where it cannot run is refused, naming ``kernel``."""
    if impl == "auto":
        impl = "triton" if hidden.is_cuda and triton_available(hidden.device) else "torch"
    if impl == "triton" and not triton_available(hidden.device):
        raise KernelUnavailableError(
            f"{kernel} impl 'triton' needs triton and a CUDA device (tensors are on {hidden.device}); use 'torch'"
        )
    return impl


def resolve_impl_and_chunk(hidden: torch.Tensor, vocab: int, impl: str, chunk_tokens: int | None) -> tuple[str, int]:
    """:func:`resolve_impl` and the chunk size (:func:`default_chunk_tokens` unless given, at least 1)."""
    impl = resolve_impl(hidden, impl)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(hidden.shape[0], vocab)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    return impl, chunk_tokens


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Float32 sum of cross entropies of ``hidden [N, H] @ weight [V, H].T`` against ``targets
    [N]`` (positions equal to ``ignore_index`` excluded), equal to
    :func:`linear_cross_entropy_reference` without materialising the ``[N, V]`` logits.

    Differentiable w.r.t. ``hidden`` and ``weight``; the gradient of each is computed (in the
    forward, chunk by chunk) only if it requires grad and grad mode is on, so a frozen head
    (LoRA) costs no ``[V, H]`` gradient and evaluation under ``no_grad`` costs no gradient at
    all. Under ``torch.autocast`` both operands are cast to the autocast dtype first, as the
    reference's matmul is. ``chunk_tokens`` defaults to :func:`default_chunk_tokens`.
    """
    check_shapes(hidden, weight, targets, impl)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # As the reference's matmul would under autocast: both operands in the autocast dtype
        # (differentiably, so a float32 head still gets its gradient), then no autocast inside.
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return fused_linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, ignore_index, chunk_tokens, impl)
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype, as the reference's matmul does"
        )
    impl, chunk_tokens = resolve_impl_and_chunk(hidden, weight.shape[0], impl, chunk_tokens)
    grad_on = torch.is_grad_enabled()
    loss, _, _ = _fused_op(
        hidden,
        weight,
        targets,
        ignore_index,
        chunk_tokens,
        impl,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
    )
    return loss
