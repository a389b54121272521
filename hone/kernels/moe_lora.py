"""Routed experts with LoRA through grouped GEMMs: sort once, one kernel per projection.

:func:`moe_experts` equals :func:`hone.kernels.moe_lora_reference.moe_experts_reference`
(forward and every gradient) with no per-expert Python loop and no host sync:

1. **Route.** The ``T*k`` token-expert pairs are sorted by expert (``torch.sort``, stable);
   rows per expert come from a ``scatter_add`` of ones and their running sum ``ends [E]``
   stays on the device (``bincount`` would size its output from the data, a sync).
2. **gate_up.** :func:`moe_lora_linear` reads each pair's token straight from ``hidden``
   through the sorted token index (no ``[S, H]`` gathered copy), computes the rank-r
   ``xa = x A^T`` for all experts in one launch, then ``x W + bias + s xa B^T`` in one more.
3. **Activation** in PyTorch (SiLU-gated or gpt_oss' clamped SwiGLU, both layouts' gate/up
   split): elementwise, which Inductor fuses into one kernel under regional compile. Fusing
   it into the gate_up epilogue would save one ``[S, 2I]`` round trip in the forward but the
   backward needs the pre-activation anyway, so it would be written regardless.
4. **down** as step 2, on the sorted rows.
5. **Combine.** Each token's ``k`` rows, weighted by the routing weights and summed in float32
   (a gather through the inverse permutation and a sum: deterministic, and differentiable
   w.r.t. the routing weights, which the router's gradient needs).

:func:`moe_lora_linear` is the ``torch.library`` custom op ``hone::moe_lora_linear`` with a
fake implementation and an autograd formula; its backward is grouped products too:
``dxa = s dY B`` (one launch), ``dX = dY W^T + dxa A`` (one launch, the LoRA term in the
epilogue again), ``dA_e = dxa_e^T x_e`` and ``dB_e = s dY_e^T xa_e`` over rank-sized
intermediates, ``dW_e = x_e^T dY_e`` only when the weights train (full fine-tune) and the
bias gradient as a segment sum. The Triton launches are ops of their own
(``hone::moe_grouped_mm``, ``hone::moe_grouped_wgrad``), so ``torch.compile(fullgraph=True)``
traces the forward and the backward without looking inside a kernel.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import register_flop_formula

from hone.kernels.moe_lora_reference import ExpertsLayout, LoraFactors, gated_activation
from hone.kernels.moe_lora_triton import INTERPRET, grouped_mm_kernel, grouped_wgrad_kernel, rows_bucket, triton
from hone.kernels.triton_support import triton_available

__all__ = ["combine", "expert_of_rows", "moe_experts", "moe_lora_linear", "moe_triton_available", "route"]


def moe_triton_available(device: torch.device | str) -> bool:
    """Whether the grouped kernels can run on ``device`` (:func:`~hone.kernels.triton_support.triton_available`)."""
    return triton_available(device)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(CAST_F32, PRECISION): float32 inputs multiply in IEEE float32, not TF32, so the fp32
    path is exact enough to compare with the reference; the interpreter multiplies in float32."""
    return INTERPRET, "ieee" if dtype == torch.float32 else "tf32"


def _check_available(t: torch.Tensor, op: str) -> None:
    if not moe_triton_available(t.device):
        raise RuntimeError(f"hone::{op} needs triton and a CUDA tensor (or TRITON_INTERPRET=1); got a {t.device} tensor")


# ---------------------------------------------------------------------------------------------
# Primitive launches (no autograd): forward grouped GEMM and grouped weight-gradient GEMM.


@dataclass(frozen=True)
class MxWeight:
    """An MXFP4 expert weight ``W [E, out, in]`` as :func:`mm_launch` reads it: ``blocks`` its
    contiguous bytes viewed ``[E, out, in / 2]``, ``scales`` ``[E, out, in / 32]`` (unit last
    stride), and which product the launch computes: ``x W_e^T`` (``k_is_in``: K = in, N = out,
    the forward) or ``dY W_e`` (K = out, N = in, the input gradient)."""

    blocks: torch.Tensor
    scales: torch.Tensor
    k_is_in: bool

    def k_n(self) -> tuple[int, int, int]:
        """(experts, K, N) of the launch."""
        num_experts, n_out, half_in = self.blocks.shape
        return (num_experts, 2 * half_in, n_out) if self.k_is_in else (num_experts, n_out, 2 * half_in)


@torch.library.custom_op("hone::moe_grouped_mm", mutates_args=())
def grouped_mm(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    ends: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    xa: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """``y [S, N]``: for the sorted rows of each expert ``e``, ``x[rows] @ weight[e] (+ bias[e])
    (+ scaling * xa @ lora_b[e].T)``. ``weight`` is ``[E, K, N]`` with any strides (a transposed
    view costs nothing), ``lora_b`` ``[E, N, r]``, ``xa`` ``[S, r]``; ``rows`` None reads ``x``'s
    rows in order (then ``S = x.shape[0]``). Rows outside ``0:ends[-1]`` are left unwritten."""
    _check_available(x, "moe_grouped_mm")
    num_experts, _, n_dim = weight.shape
    s = rows.shape[0] if rows is not None else x.shape[0]
    y = torch.empty(s, n_dim, dtype=x.dtype, device=x.device)
    if s == 0 or n_dim == 0:
        return y
    grid, args, kwargs = mm_launch(x, rows, ends, weight, bias, xa, lora_b, scaling, y, s)
    grouped_mm_kernel[grid](*args, **kwargs)
    return y


def mm_launch(
    x, rows, ends, weight, bias, xa, lora_b, scaling: float, y: torch.Tensor, s: int, mxfp4: MxWeight | None = None
) -> tuple:
    """(grid, args, kwargs) of one :func:`grouped_mm` launch writing ``y``, a contiguous
    ``[s, N]`` (its strides are taken as such, so :func:`precompile_projection` can pass any
    tensor of its dtype); shared by the launch and the precompile, so both specialise alike.
    With ``mxfp4`` the weight is MXFP4 (``weight`` is then ignored, see :class:`MxWeight`)."""
    if mxfp4 is not None:
        weight = mxfp4.blocks  # [E, out, in / 2] bytes
    num_experts, k_dim, n_dim = weight.shape if mxfp4 is None else mxfp4.k_n()
    has_lora = xa is not None and lora_b is not None
    rank = xa.shape[1] if has_lora else 0
    dummy = ends  # any tensor: the kernel never reads a pointer whose flag is off
    cast_f32, precision = _launch_flags(x.dtype)
    grid = lambda meta: (triton.cdiv(s, meta["BLOCK_M"]) + num_experts, triton.cdiv(n_dim, meta["BLOCK_N"]))  # noqa: E731
    args = (
        x,
        x.stride(0),
        x.stride(1),
        rows if rows is not None else dummy,
        ends,
        num_experts,
        weight,
        weight.stride(0),
        weight.stride(1),  # MXFP4: the out rows' byte stride, whether out is K or N
        weight.stride(2) if mxfp4 is None else weight.stride(1),
        bias if bias is not None else dummy,
        bias.stride(0) if bias is not None else 0,
        bias.stride(1) if bias is not None else 0,
        xa if has_lora else dummy,
        xa.stride(0) if has_lora else 0,
        xa.stride(1) if has_lora else 0,
        lora_b if has_lora else dummy,
        lora_b.stride(0) if has_lora else 0,
        lora_b.stride(1) if has_lora else 0,
        lora_b.stride(2) if has_lora else 0,
        float(scaling),
        y,
        n_dim,
        1,
        n_dim,
        k_dim,
        rank,
        rows_bucket(s, num_experts),
    )
    kwargs = dict(
        GATHER=rows is not None,
        HAS_BIAS=bias is not None,
        HAS_LORA=has_lora,
        E_P2=_next_pow2(num_experts),
        BLOCK_R=max(16, _next_pow2(rank)),
        CAST_F32=cast_f32,
        PRECISION=precision,
        ws_ptr=dummy if mxfp4 is None else mxfp4.scales,
        stride_wse=0 if mxfp4 is None else mxfp4.scales.stride(0),
        stride_wso=0 if mxfp4 is None else mxfp4.scales.stride(1),
        W_MXFP4=mxfp4 is not None,
        MX_K_IS_IN=mxfp4 is None or mxfp4.k_is_in,
    )
    return grid, args, kwargs


@grouped_mm.register_fake
def _(x, rows, ends, weight, bias, xa, lora_b, scaling):
    s = rows.shape[0] if rows is not None else x.shape[0]
    return x.new_empty(s, weight.shape[2])


@torch.library.custom_op("hone::moe_grouped_wgrad", mutates_args=())
def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    rows: torch.Tensor | None,
    gather_a: bool,
    gather_b: bool,
    ends: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``out [E, M, N]`` with ``out[e] = scale * a_e^T @ b_e``, ``a_e`` / ``b_e`` the rows of
    expert ``e`` of ``a [*, M]`` and ``b [*, N]`` (read through ``rows`` where ``gather_*``),
    accumulated in float32 and rounded once to ``out_dtype``; zeros for an empty expert."""
    _check_available(a, "moe_grouped_wgrad")
    num_experts = ends.shape[0]
    out = torch.empty(num_experts, a.shape[1], b.shape[1], dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    s = rows.shape[0] if rows is not None else a.shape[0]
    grid, args, kwargs = _wgrad_launch(a, b, rows, gather_a, gather_b, ends, scale, out, s)
    grouped_wgrad_kernel[grid](*args, **kwargs)
    return out


def _wgrad_launch(a, b, rows, gather_a: bool, gather_b: bool, ends, scale: float, out: torch.Tensor, s: int) -> tuple:
    """(grid, args, kwargs) of one :func:`grouped_wgrad` launch writing ``out``, a contiguous
    ``[E, M, N]`` (strides taken as such), over ``s`` sorted rows (see :func:`mm_launch`)."""
    num_experts = ends.shape[0]
    m_dim, n_dim = a.shape[1], b.shape[1]
    cast_f32, precision = _launch_flags(a.dtype)
    grid = lambda meta: (num_experts, triton.cdiv(m_dim, meta["BLOCK_M"]), triton.cdiv(n_dim, meta["BLOCK_N"]))  # noqa: E731
    args = (
        a,
        a.stride(0),
        a.stride(1),
        b,
        b.stride(0),
        b.stride(1),
        rows if rows is not None else ends,
        ends,
        out,
        m_dim * n_dim,
        n_dim,
        1,
        m_dim,
        n_dim,
        float(scale),
        rows_bucket(s, num_experts),
    )
    return grid, args, dict(GATHER_A=gather_a, GATHER_B=gather_b, CAST_F32=cast_f32, PRECISION=precision)


@grouped_wgrad.register_fake
def _(a, b, rows, gather_a, gather_b, ends, scale, out_dtype):
    return a.new_empty(ends.shape[0], a.shape[1], b.shape[1], dtype=out_dtype)


# ---------------------------------------------------------------------------------------------
# Compiling every kernel variant of a projection at once, in parallel.

PRECOMPILE_ENV = "HONE_MOE_PRECOMPILE"
_precompiled: set[tuple] = set()


def _precompile_key(x, rows, ends, weight, transposed, bias, lora_a, lora_b) -> tuple:
    """What decides which kernel variants a projection launches (shapes, strides, dtypes, flags:
    Triton specialises on dtypes, on strides equal to 1 or divisible by 16, and on constexprs)."""

    def t(v):
        return None if v is None else (v.dtype, tuple(v.shape[1:]), v.stride())

    s = rows.shape[0] if rows is not None else x.shape[0]
    return (
        x.device,
        t(x),
        rows is None,
        ends.shape[0],
        rows_bucket(s, ends.shape[0]),
        t(weight),
        transposed,
        t(bias),
        t(lora_a),
        t(lora_b),
        weight.requires_grad,
    )


def precompile_projection(x, rows, ends, weight, transposed: bool, bias, lora_a, lora_b, scaling: float) -> bool:
    """Compile, in parallel, every grouped-kernel variant one projection's forward and backward
    launch (``x A^T``, the base GEMM, ``dY B``, ``dX``, ``dA``, ``dB``, and ``dW`` when the weight
    requires grad) with the tile each launch will take, through Triton's ``AsyncCompileMode``
    and a thread pool. Without it each variant compiles when first launched, one after the
    other, in the first step (about a dozen compiles for a LoRA step; Triton's compiler spends
    most of its time outside Python, so threads overlap). The launch arguments come from the
    same helpers as the real launches (:func:`mm_launch`, :func:`_wgrad_launch`), with one-row
    stand-ins for tensors that do not exist yet (the kernels specialise on strides, dtypes and
    alignment, not on sizes), so the real launches find their kernels compiled. Returns whether
    it compiled; a failure here is ignored (the launch compiles, and reports, as before)."""
    if INTERPRET or not x.is_cuda or os.environ.get(PRECOMPILE_ENV, "1") == "0" or not hasattr(triton, "AsyncCompileMode"):
        return False
    key = _precompile_key(x, rows, ends, weight, transposed, bias, lora_a, lora_b)
    if key in _precompiled:
        return False
    _precompiled.add(key)
    try:
        _compile_variants(x, rows, ends, weight, transposed, bias, lora_a, lora_b, scaling)
    except Exception as exc:  # noqa: BLE001 - only a head start; the launches compile what is missing
        warnings.warn(
            f"hone: compiling the MoE kernels ahead failed ({type(exc).__name__}: {exc}); they compile when launched",
            stacklevel=2,
        )
    return True


def _compile_variants(x, rows, ends, weight, transposed, bias, lora_a, lora_b, scaling) -> None:
    from concurrent.futures import ThreadPoolExecutor

    s = rows.shape[0] if rows is not None else x.shape[0]
    w_in_out = weight if transposed else weight.transpose(1, 2)
    n_in, n_out = w_in_out.shape[1], w_in_out.shape[2]
    has_lora = lora_a is not None and lora_b is not None

    def stand_in(cols: int, dtype: torch.dtype = x.dtype) -> torch.Tensor:
        return torch.empty(1, cols, dtype=dtype, device=x.device)

    def out(dtype: torch.dtype) -> torch.Tensor:  # a wgrad output: strides come from its shape
        return torch.empty(1, dtype=dtype, device=x.device)

    mm, wgrad = [], []
    xa = dxa = None
    dy = stand_in(n_out)
    if has_lora:
        xa, dxa = stand_in(lora_a.shape[1]), stand_in(lora_a.shape[1])
        mm.append(mm_launch(x, rows, ends, lora_a.transpose(1, 2), None, None, None, 0.0, xa, s))
        mm.append(mm_launch(dy, None, ends, lora_b, None, None, None, 0.0, dxa, s))
    mm.append(mm_launch(x, rows, ends, w_in_out, bias, xa, lora_b if has_lora else None, scaling, stand_in(n_out), s))
    a_t = lora_a.transpose(1, 2) if has_lora else None
    mm.append(mm_launch(dy, None, ends, w_in_out.transpose(1, 2), None, dxa, a_t, 1.0, stand_in(n_in), s))
    if has_lora:
        wgrad.append(_wgrad_launch(dxa, x, rows, False, rows is not None, ends, 1.0, out(lora_a.dtype), s))
        wgrad.append(_wgrad_launch(dy, xa, None, False, False, ends, scaling, out(lora_b.dtype), s))
    if weight.requires_grad:
        if transposed:
            wgrad.append(_wgrad_launch(x, dy, rows, rows is not None, False, ends, 1.0, out(weight.dtype), s))
        else:
            wgrad.append(_wgrad_launch(dy, x, rows, False, rows is not None, ends, 1.0, out(weight.dtype), s))
    workers = max(1, min(8, os.cpu_count() or 1))
    with (
        ThreadPoolExecutor(workers, thread_name_prefix="hone-moe-compile") as pool,
        triton.AsyncCompileMode(pool, ignore_errors=True),
    ):
        for kernel, launches in ((grouped_mm_kernel, mm), (grouped_wgrad_kernel, wgrad)):
            for grid, args, kwargs in launches:
                kernel.warmup(*args, grid=grid, **kwargs)


# ---------------------------------------------------------------------------------------------
# One expert projection with LoRA, differentiable.


@torch.library.custom_op("hone::moe_lora_linear", mutates_args=())
def _moe_lora_linear(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    ends: torch.Tensor,
    weight: torch.Tensor,
    transposed: bool,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scaling: float,
    readers: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [S, out], xa [S, r] or empty): see :func:`moe_lora_linear`. ``xa`` is returned (not
    differentiable) so the backward reuses it for ``dB`` instead of recomputing ``x A^T``."""
    precompile_projection(x, rows, ends, weight, transposed, bias, lora_a, lora_b, scaling)
    w_in_out = weight if transposed else weight.transpose(1, 2)
    if lora_a is None or lora_b is None:
        return grouped_mm(x, rows, ends, w_in_out, bias, None, None, 0.0), x.new_empty(0)
    xa = grouped_mm(x, rows, ends, lora_a.transpose(1, 2), None, None, None, 0.0)
    return grouped_mm(x, rows, ends, w_in_out, bias, xa, lora_b, scaling), xa


@_moe_lora_linear.register_fake
def _(x, rows, ends, weight, transposed, bias, lora_a, lora_b, scaling, readers):
    s = rows.shape[0] if rows is not None else x.shape[0]
    n_out = weight.shape[2] if transposed else weight.shape[1]
    y = x.new_empty(s, n_out)
    xa = x.new_empty(s, lora_a.shape[1]) if lora_a is not None and lora_b is not None else x.new_empty(0)
    return y, xa


def _setup_context(ctx, inputs, output) -> None:
    x, rows, ends, weight, transposed, bias, lora_a, lora_b, scaling, readers = inputs
    _, xa = output
    ctx.transposed = transposed
    ctx.scaling = scaling
    ctx.x_shape = x.shape
    ctx.has_rows = rows is not None
    ctx.has_bias = bias is not None
    ctx.has_lora = lora_a is not None and lora_b is not None
    ctx.mark_non_differentiable(xa)
    ctx.save_for_backward(x, rows, ends, weight, lora_a, lora_b, xa, readers)


def expert_of_rows(ends: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The expert of each sorted row, on the device (no sync)."""
    return torch.searchsorted(ends, torch.arange(n_rows, device=ends.device, dtype=ends.dtype), right=True)


def with_zero_row(t: torch.Tensor) -> torch.Tensor:
    """``[t; 0]``: a 2-D tensor with one zero row appended, the row that sentinel indices
    (one past the last real row) read."""
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


def gather_rows_sum(sorted_rows: torch.Tensor, readers: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[X, H]`` float32: row ``i`` is the sum over ``j`` (in order) of ``sorted_rows[readers[i, j]]``
    (times ``weights[i, j]`` where given, float32 ``[X, k]``), index ``S`` (one past the last
    sorted row) reading zero. The transpose of ``x[rows]`` as a gather: no float32 buffer to
    zero, no atomics (the same sum on every run), and sorted rows that no input row names (an
    expert-parallel caller's capacity rows past the real pairs, left unwritten by the kernels)
    are never read. Written out of place (torch 2.11's Dynamo differentiates a Function output
    filled in place as zero: hone/parallel/exchange.py)."""
    padded = with_zero_row(sorted_rows)

    def term(j: int) -> torch.Tensor:
        row = padded[readers[:, j]].float()
        return row if weights is None else weights[:, j : j + 1] * row

    out = term(0)
    for j in range(1, readers.shape[1]):
        out = out + term(j)
    return out


def projection_backward(
    ctx, dy: torch.Tensor, x, rows, ends, lora_a, lora_b, xa, bias_dtype: torch.dtype, input_grad, readers=None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dX, dA, dB, dbias) of an expert projection op whose inputs are ``(x, rows, ends, <weight>,
    <weight>, bias, lora_a, lora_b, scaling)`` (the bf16 op and :mod:`hone.kernels.moe_mxfp4`'s):
    every gradient but the weight's, which never reads ``W``, so both ops share it.
    ``input_grad(dxa, a_t)`` gives the rows' ``dY W_e^T`` with ``dxa a_t`` in the epilogue;
    ``readers``: see :func:`moe_lora_linear`."""
    need = ctx.needs_input_grad
    need_a, need_b = (need[6], need[7]) if ctx.has_lora else (False, False)
    d_x = d_a = d_b = d_bias = None
    dxa = None
    if ctx.has_lora and (need[0] or need_a):
        # dxa = s * dY B_e  ([S, out] @ [out, r]); B_e is lora_b[e] seen as [E, out (K), r (N)].
        dxa = grouped_mm(dy, None, ends, lora_b, None, None, None, 0.0) * ctx.scaling
    if need[0]:
        # dX = dY W_e^T + dxa A_e: the base kernel with A as the epilogue's "B".
        dx_rows = input_grad(dxa, None if dxa is None else lora_a.transpose(1, 2))
        if ctx.has_rows and readers is not None:
            d_x = gather_rows_sum(dx_rows, readers).to(dy.dtype)
        elif ctx.has_rows:
            # Each token's k rows summed back (float32 accumulate, then x's dtype).
            d_x = torch.zeros(ctx.x_shape, dtype=torch.float32, device=dy.device)
            d_x.index_add_(0, rows, dx_rows.float())
            d_x = d_x.to(dy.dtype)
        else:
            d_x = dx_rows
    if need_a:
        d_a = grouped_wgrad(dxa, x, rows, False, ctx.has_rows, ends, 1.0, lora_a.dtype)
    if need_b:
        d_b = grouped_wgrad(dy, xa, None, False, False, ends, ctx.scaling, lora_b.dtype)
    if need[5] and ctx.has_bias:
        # One bucket more than experts: rows past ends[-1] (an expert-parallel caller's sentinel
        # rows, which the kernels leave unwritten) land there and are dropped.
        d_bias = torch.zeros(ends.shape[0] + 1, dy.shape[1], dtype=torch.float32, device=dy.device)
        d_bias.index_add_(0, expert_of_rows(ends, dy.shape[0]), dy.float())
        d_bias = d_bias[: ends.shape[0]].to(bias_dtype)
    return d_x, d_a, d_b, d_bias


def _backward(ctx, grad_y, _grad_xa):
    x, rows, ends, weight, lora_a, lora_b, xa, readers = ctx.saved_tensors
    dy = grad_y.contiguous()
    w_in_out = weight if ctx.transposed else weight.transpose(1, 2)

    def input_grad(dxa, a_t):  # the same kernel, W read transposed
        return grouped_mm(dy, None, ends, w_in_out.transpose(1, 2), None, dxa, a_t, 1.0)

    d_x, d_a, d_b, d_bias = projection_backward(ctx, dy, x, rows, ends, lora_a, lora_b, xa, weight.dtype, input_grad, readers)
    d_w = None
    if ctx.needs_input_grad[3]:
        # Written straight in the parameter's layout: [E, in, out] = x^T dY, [E, out, in] = dY^T x.
        if ctx.transposed:
            d_w = grouped_wgrad(x, dy, rows, ctx.has_rows, False, ends, 1.0, weight.dtype)
        else:
            d_w = grouped_wgrad(dy, x, rows, False, ctx.has_rows, ends, 1.0, weight.dtype)
    return d_x, None, None, d_w, None, d_bias, d_a, d_b, None, None


_moe_lora_linear.register_autograd(_backward, setup_context=_setup_context)


def projection_flops(rows: int, k_in: int, n_out: int, rank: int = 0) -> int:
    """Multiply-adds x 2 of ``rows`` through a ``k_in -> n_out`` projection with a rank-``rank``
    LoRA beside it: what a grouped projection op costs the compiler's recompute planner."""
    return 2 * rows * (k_in * n_out + rank * (k_in + n_out))


@register_flop_formula(torch.ops.hone.moe_lora_linear)
def _moe_lora_linear_flops(x, rows, ends, weight, transposed, bias, lora_a, lora_b, scaling, readers, **kwargs) -> int:
    """The op's FLOPs from its arguments' shapes (rows: capacity rows included, an upper bound).
    Without a formula torch's flop counter counts an opaque op as 0, and Inductor's memory-budget
    partitioner, which weighs what to recompute by counted FLOPs, took the grouped GEMMs for free
    and recomputed them in the backward first (:func:`hone.transforms.checkpointing.memory_budget_context`)."""
    n_rows = rows[0] if rows is not None else x[0]
    k_in, n_out = (weight[1], weight[2]) if transposed else (weight[2], weight[1])
    rank = lora_a[1] if lora_a is not None and lora_b is not None else 0
    return projection_flops(n_rows, k_in, n_out, rank)


def moe_lora_linear(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    ends: torch.Tensor,
    weight: torch.Tensor,
    transposed: bool,
    bias: torch.Tensor | None = None,
    lora: LoraFactors | None = None,
    scaling: float = 1.0,
    readers: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert projection for rows sorted by expert: ``y [S, out]`` with, for the rows of
    expert ``e`` (``ends[e-1]:ends[e]``), ``y = x[rows] W_e (+ bias_e) + s (x[rows] A_e^T) B_e^T``.

    ``weight`` is the experts' 3-D parameter as stored (``[E, out, in]``, or ``[E, in, out]``
    when ``transposed``), ``lora`` its factors ``(A [E, r, in], B [E, out, r])`` (PEFT's
    per-expert view, any strides), ``rows`` an optional int64 index into ``x`` (None: ``x`` is
    already in sorted order). Every floating input is cast to the weight's dtype first
    (differentiably: float32 LoRA factors get float32 gradients). Differentiable w.r.t. ``x``,
    ``weight``, ``bias`` and both factors; only what requires grad is computed.

    ``readers`` (with ``rows``): ``[X, k]`` int64, for each row of ``x`` the sorted rows that read
    it (``S``: none). The backward then gathers ``dX`` (:func:`gather_rows_sum`) instead of
    adding every sorted row's gradient into a float32 buffer atomically; callers whose ``rows``
    name one padding row many times (expert parallelism's capacity rows) need it to keep those
    rows out of the sum.
    """
    dtype = weight.dtype
    lora_a = lora_b = None
    if lora is not None:
        lora_a, lora_b = lora[0].to(dtype), lora[1].to(dtype)
    bias = None if bias is None else bias.to(dtype)
    y, _ = _moe_lora_linear(x.to(dtype), rows, ends, weight, transposed, bias, lora_a, lora_b, float(scaling), readers)
    return y


def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, ends): the flattened token-expert pairs sorted by expert (``perm[i]`` is the pair
    at sorted row ``i``; pair ``p`` is token ``p // k``'s ``p % k``-th choice) and the running
    row count per expert, int32 ``[E]``. All on the device, no host sync."""
    ids = top_k_index.reshape(-1)
    _, perm = torch.sort(ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, ids.long(), torch.ones_like(ids, dtype=torch.int32))
    return perm, torch.cumsum(counts, 0, dtype=torch.int32)


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    layout: ExpertsLayout,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_lora: LoraFactors | None = None,
    down_lora: LoraFactors | None = None,
    scaling: float = 1.0,
    down_scaling: float | None = None,
) -> torch.Tensor:
    """Routed experts ``[T, H]`` through the grouped kernels; same arguments and result as
    :func:`hone.kernels.moe_lora_reference.moe_experts_reference` (see the module docstring
    for the steps). ``down_scaling`` is the down projection's LoRA scaling where it differs
    from gate_up's ``scaling``. Output in ``hidden``'s dtype."""
    k = top_k_index.shape[1]
    perm, ends = route(top_k_index, gate_up_proj.shape[0])
    token_of_row = perm // k
    gate_up = moe_lora_linear(hidden, token_of_row, ends, gate_up_proj, layout.transposed, gate_up_bias, gate_up_lora, scaling)
    h = gated_activation(gate_up, layout)
    y = moe_lora_linear(
        h, None, ends, down_proj, layout.transposed, down_bias, down_lora, scaling if down_scaling is None else down_scaling
    )
    return combine(y, perm, top_k_weights).to(hidden.dtype)


def combine(y: torch.Tensor, perm: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` float32: each token's ``k`` expert rows of ``y [T*k, H]`` (sorted as :func:`route`
    sorts them), weighted by ``top_k_weights [T, k]`` and summed in float32 (a gather through the
    inverse permutation: deterministic, and differentiable w.r.t. the routing weights)."""
    n_tokens, k = top_k_weights.shape
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
    per_choice = y[inverse].view(n_tokens, k, y.shape[1]).float()
    return (per_choice * top_k_weights.float().unsqueeze(-1)).sum(dim=1)
