"""Triton kernels for routed experts: a grouped GEMM with the LoRA path fused in its epilogue,
and a grouped weight-gradient GEMM. Launched through the ``torch.library`` ops of
:mod:`hone.kernels.moe_lora`; nothing here knows about models.

Rows (token-expert pairs) arrive sorted by expert; ``ends [E]`` (int32, on the device) is the
running count of rows per expert, so expert ``e`` owns rows ``ends[e-1]:ends[e]``. Nothing on
the host knows how many rows each expert has: the forward grid is an upper bound on the
number of ``BLOCK_M`` row tiles, ``cdiv(S, BLOCK_M) + E`` (each expert wastes at most one
partial tile), and every program finds its expert and first row from ``ends`` itself (a
vector cumsum over the experts' tile counts). Programs past the last tile return at once.
This keeps routing free of host syncs and works whatever ``BLOCK_M`` autotuning picks.

:func:`grouped_mm_kernel` computes, for the rows of expert ``e``,

    y = x W_e (+ bias_e) (+ s * xa B_e^T)

with ``x`` read through an optional row index (``x[rows[i]]``: the first projection reads the
token's hidden state directly, no ``[S, H]`` gathered copy), ``W_e`` read through arbitrary
strides (so qwen3_moe's ``[E, out, in]`` and gpt_oss' ``[E, in, out]`` and their transposes
for the backward are the same kernel, no weight copies), and ``xa = x A_e^T`` the rank-``r``
intermediate computed beforehand by the same kernel. Why not compute ``x A^T`` inside the base
GEMM's K loop: every N tile would redo it, ``r / BLOCK_N`` extra work (12% at r=16, BLOCK_N=128)
and ``xa`` has to reach memory anyway because the backward's ``dB = dY^T xa`` needs it; as its
own launch it costs one more read of ``x`` and about ``r / N`` of the base GEMM's FLOPs.

With ``W_MXFP4`` the weight is a frozen MXFP4 ``[E, out, in]`` (:mod:`hone.kernels.mxfp4_dequant`'s
layout: bytes, two inputs each, and one E8M0 scale per 32 inputs): each W tile is loaded as bytes
and scales and decoded in registers (:func:`_mxfp4_halves`; exact in float32 and in bf16), read as
``W^T`` (K = in: the forward, ``MX_K_IS_IN``) or as ``W`` (K = out: the input gradient ``dY W``).
Everything else (rows, experts, LoRA epilogue, bias) is the same kernel (:mod:`hone.kernels.moe_mxfp4`).

:func:`grouped_wgrad_kernel` computes ``out[e] = scale * a_e^T b_e`` over expert ``e``'s rows
(weights, LoRA A and B gradients), one program per (expert, M tile, N tile), its K loop running
over that expert's rows only; an empty expert's block is written as zeros.

Tiles: by default each launch takes one tile chosen from the problem's shape
(:func:`heuristic_tile`), so the first step compiles each kernel variant once and times
nothing; ``HONE_MOE_AUTOTUNE=1`` autotunes instead, over the configs whose tiles fit the problem
(timings kept in Triton's on-disk cache). ``scripts/moe_tiles.py`` compares the two on a GPU.

Under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tests) the dot products run in float32
(the interpreter's dot does not take bfloat16) and one autotune config is tried. The
interpreter also rounds float32 to bfloat16 by truncation (GPUs round to nearest even), twice
the error of a real store: bfloat16 parity is the GPU tests' job (tests/gpu/test_moe_lora_gpu.py).
"""

from __future__ import annotations

import os

from hone.kernels.triton_support import tl, triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


AUTOTUNE_ENV = "HONE_MOE_AUTOTUNE"


def autotuning() -> bool:
    """Whether the kernels autotune (``HONE_MOE_AUTOTUNE=1``) instead of taking the tile
    :func:`heuristic_tile` picks from the problem's shape. Read when a new problem shape is
    first seen, so it can be set any time before the first step. Never under the interpreter."""
    return not INTERPRET and os.environ.get(AUTOTUNE_ENV) == "1"


def _configs(small: list[tuple[int, int, int, int, int]]):
    """Autotune configs (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); exactly one
    under the interpreter, where every extra config is minutes of CPU."""
    if INTERPRET:
        return [_INTERPRET_CONFIG]
    return [_config(tile) for tile in small]


_CONFIG_CACHE: dict[tuple[int, int, int, int, int], object] = {}


def _config(tile: tuple[int, int, int, int, int]):
    """One ``triton.Config`` per tile (the same object each time: the autotuner's cache and the
    launcher compare configs)."""
    if tile not in _CONFIG_CACHE:
        m, n, k, w, s = tile
        _CONFIG_CACHE[tile] = triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    return _CONFIG_CACHE[tile]


# Tiles for H100-class GPUs: 128x128 and 64x128 with BLOCK_K 64 cover the MoE shapes (2I and H
# of 1-4K, rows per expert of tens to thousands); the 64-row tiles waste less on small experts.
_MM_TILES = [
    (128, 128, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (128, 32, 64, 4, 3),  # the rank-r outputs (x A^T, dY B): N = r
]
# MXFP4 weights (forward and input gradient): every program decodes its weight tiles, so tall
# row tiles, which decode each weight tile for more rows, pay off sooner than with bf16 weights.
_MX_TILES = [
    (128, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
    (64, 128, 128, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 64, 128, 4, 3),
]
#: The tile an MXFP4 launch takes when not autotuning: what autotuning chose at gpt-oss-20b's
#: shapes on an H100 (256 rows per expert): the forward (K = in) with a 128x64 tile and long K
#: steps, the input gradient (K = out, two accumulators of half the width) with a 128x256 one.
MX_TILE_K_IN = (128, 64, 128, 4, 3)
MX_TILE_K_OUT = (128, 256, 64, 8, 3)
# Weight gradients: M and N are the weight's dimensions, K the expert's rows (their loop is
# as long as the expert's load, so long K tiles pay off with many rows per expert).
_WGRAD_TILES = [
    (128, 128, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 32, 4, 4),
    (64, 64, 64, 4, 3),
    (128, 128, 32, 8, 4),
    (32, 128, 64, 4, 3),  # dA: M = r
    (16, 128, 64, 4, 3),  # dA at r <= 16
    (128, 32, 64, 4, 3),  # dB: N = r
    (128, 16, 64, 4, 3),  # dB at r <= 16
]

#: Average rows per expert from which the grouped GEMMs take 128-row tiles rather than 64. A
#: row tile never spans two experts, so each expert wastes about half a tile: 64-row tiles
#: waste 25% at 128 rows per expert (qwen3-30b-a3b at seq 2048: 2048 x 8 / 128) and 12.5% at
#: 256 (gpt-oss-20b at seq 2048: 2048 x 4 / 32), 128-row ones twice that; from 512 rows the
#: waste of both is small and the bigger tile's better reuse of the weight tile wins.
BIG_TILE_ROWS = 512


def _fitting(tiles: list, m: int | None, n: int) -> list:
    """The tiles (``(BLOCK_M, BLOCK_N, ...)`` tuples or configs) that overshoot the problem
    least (a 128-wide tile over a rank-16 dimension computes 8x the useful work): all of them
    for full-size problems, the rank-sized ones for LoRA's rank dimension."""

    def dims(tile) -> tuple[int, int]:
        if isinstance(tile, tuple):
            return tile[0], tile[1]
        return tile.kwargs["BLOCK_M"], tile.kwargs["BLOCK_N"]

    def waste(tile) -> float:
        block_m, block_n = dims(tile)
        over_m = 1.0 if m is None else max(1.0, block_m / max(16, _pow2(m)))
        return over_m * max(1.0, block_n / max(16, _pow2(n)))

    least = min(waste(tile) for tile in tiles)
    return [tile for tile in tiles if waste(tile) == least]


def heuristic_tile(kernel: str, m: int | None, n: int, rows_per_expert: int, element_size: int) -> tuple[int, int, int, int, int]:
    """The one tile a kernel launches with when not autotuning, from the problem's shape.

    ``kernel`` is ``"mm"`` (forward and input-gradient GEMMs: ``m`` None, ``n`` the output
    width) or ``"wgrad"`` (``m``, ``n`` the gradient's dimensions). Rank-sized problems get the
    rank-sized tile (what pruning left autotuning anyway: there is only one); full-size grouped
    GEMMs get a 128-wide N tile with 64 rows, or 128 from :data:`BIG_TILE_ROWS` rows per expert
    (``rows_per_expert``: the autotune key's power-of-two bucket); full-size weight gradients
    (full fine-tune) 128x128. Four-byte inputs (float32, IEEE dots) halve ``BLOCK_K``: the same
    tile's operands take twice the shared memory."""
    tiles = _MM_TILES if kernel == "mm" else _WGRAD_TILES
    fitting = _fitting(tiles, m, n)
    tile = fitting[0]
    if kernel == "mm" and len(fitting) > 1:
        want_m = 128 if rows_per_expert >= BIG_TILE_ROWS else 64
        tile = next((t for t in fitting if t[0] == want_m and t[1] == 128), tile)
    if element_size >= 4 and tile[2] > 32:
        tile = (tile[0], tile[1], 32, tile[3], tile[4])
    return tile


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _prune(kernel: str, configs: list, m: int | None, n: int, rows_per_expert: int, element_size: int) -> list:
    """What the autotuner times for a new key: the one heuristic tile (nothing is timed, one
    compile), the least-overshooting configs under ``HONE_MOE_AUTOTUNE=1``, the interpreter's
    single config under ``TRITON_INTERPRET=1``."""
    if INTERPRET:
        return configs
    if autotuning():
        return _fitting(configs, m, n)
    return [_config(heuristic_tile(kernel, m, n, rows_per_expert, element_size))]


def _prune_mm(configs: list, named_args: dict, **kwargs) -> list:
    two_byte = named_args["x_ptr"].element_size() == 2  # float32 takes the bf16 path's halved-K tiles
    if kwargs.get("W_MXFP4", named_args.get("W_MXFP4")) and two_byte and not INTERPRET:
        if autotuning():
            return [c for c in configs if _tile_of(c) in _MX_TILES]
        k_is_in = kwargs.get("MX_K_IS_IN", named_args.get("MX_K_IS_IN"))
        return [_config(MX_TILE_K_IN if k_is_in else MX_TILE_K_OUT)]
    configs = [c for c in configs if _tile_of(c) in _MM_TILES] if not INTERPRET else configs
    return _prune("mm", configs, None, named_args["N"], named_args["ROWS_BUCKET"], named_args["x_ptr"].element_size())


def _tile_of(config) -> tuple[int, int, int, int, int]:
    kw = config.kwargs
    return (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], config.num_warps, config.num_stages)


def _prune_wgrad(configs: list, named_args: dict, **kwargs) -> list:
    return _prune(
        "wgrad", configs, named_args["M"], named_args["N"], named_args["ROWS_BUCKET"], named_args["a_ptr"].element_size()
    )


def _bench(kernel_call, quantiles):
    """Autotuning's timing (``HONE_MOE_AUTOTUNE=1``): a shorter budget than Triton's default
    (25 ms warm-up, 100 ms of repeats per config), still dozens of runs of a ~1 ms kernel."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _autotune_options() -> dict:
    """``cache_results``: autotuned timings kept in Triton's on-disk cache, so a second run with
    warm caches does not time again (where this triton has the option)."""
    import inspect

    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def rows_bucket(rows: int, experts: int) -> int:
    """The autotune key for the experts' load: average rows per expert, rounded up to a power of
    two (the host never sees the per-expert counts; the total is a shape). Tiles are tuned again
    per bucket, not per exact length, so varying batch lengths do not retune every step."""
    return _pow2(max(1, rows // max(1, experts)))


grouped_mm_kernel = None  # defined below when triton is installed
grouped_wgrad_kernel = None


if triton is not None:
    import triton.testing  # noqa: F401 - _bench

    _INTERPRET_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1, num_stages=1)

    @triton.jit
    def _expert_of_tile(pid_m, ends_ptr, num_experts, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
        """(expert, first row, end row) of row tile ``pid_m``; expert == num_experts past the last tile."""
        idx = tl.arange(0, E_P2)
        valid = idx < num_experts
        ends = tl.load(ends_ptr + idx, mask=valid, other=0)
        starts = tl.load(ends_ptr + idx - 1, mask=valid & (idx > 0), other=0)
        tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        tile_ends = tl.cumsum(tiles, 0)
        expert = tl.sum((valid & (tile_ends <= pid_m)).to(tl.int32), 0)
        here = idx == expert
        first_tile = tl.sum(tl.where(here, tile_ends - tiles, 0), 0)
        start = tl.sum(tl.where(here, starts, 0), 0)
        end = tl.sum(tl.where(here, ends, 0), 0)
        return expert, start + (pid_m - first_tile) * BLOCK_M, end

    @triton.jit
    def _mxfp4_halves(
        blocks_ptr,
        scales_ptr,
        stride_bo,
        stride_so,
        outs,
        out_mask,
        in0,
        in_dim,
        K_IS_IN: tl.constexpr,
        BLOCK_IN: tl.constexpr,
        len_outs: tl.constexpr,
    ):
        """One expert's MXFP4 weight ``W [out, in]`` decoded in registers, rows ``outs`` and inputs
        ``in0:in0 + BLOCK_IN``, as two halves: the even inputs (each byte's low nibble) and the odd
        ones (high nibble), each ``[len(outs), BLOCK_IN / 2]`` (transposed to ``[BLOCK_IN / 2,
        len(outs)]`` where K is ``in``). Keeping the halves apart spares the interleave of every
        tile: the caller splits its other operand (K = in) or its accumulator (K = out) instead.

        The decode is bit placement, exact: a code ``s e1 e0 m`` placed as float32 sign, the two
        low exponent bits and the top mantissa bit is its E2M1 value times ``2 ** -126``
        (normal codes and the subnormal 0.5 alike), then scaled by ``2 ** 126`` and the block's
        E8M0 scale (0 is ``2 ** -127``, 255 NaN); every product is a power of two times a value
        of two significant bits, exact in float32 and in bfloat16."""
        pairs = in0 // 2 + tl.arange(0, BLOCK_IN // 2)
        mask = out_mask[:, None] & (pairs < in_dim // 2)[None, :]
        rows = outs.to(tl.int64)[:, None]
        byte = tl.load(blocks_ptr + rows * stride_bo + pairs[None, :], mask=mask, other=0).to(tl.int32)
        # 2 ** 126 times the placed code is its E2M1 value (the scale itself may be up to 2 ** 127)
        low = (((byte & 7) << 22) | ((byte & 8) << 28)).to(tl.float32, bitcast=True) * 8.507059173023462e37
        high = (((byte & 0x70) << 18) | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True) * 8.507059173023462e37
        if BLOCK_IN >= 64:  # whole blocks: one scale decoded per 32 values, broadcast over its 16 bytes
            n_blocks = in0 // 32 + tl.arange(0, BLOCK_IN // 32)
            block_mask = out_mask[:, None] & (n_blocks < in_dim // 32)[None, :]
            s = tl.load(scales_ptr + rows * stride_so + n_blocks[None, :], mask=block_mask, other=127).to(tl.int32)
            scale = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23)).to(tl.float32, bitcast=True)
            low = tl.reshape(tl.reshape(low, (len_outs, BLOCK_IN // 32, 16)) * scale[:, :, None], (len_outs, BLOCK_IN // 2))
            high = tl.reshape(tl.reshape(high, (len_outs, BLOCK_IN // 32, 16)) * scale[:, :, None], (len_outs, BLOCK_IN // 2))
        else:  # the interpreter's small tiles: a scale per byte
            s = tl.load(scales_ptr + rows * stride_so + (pairs // 16)[None, :], mask=mask, other=127).to(tl.int32)
            scale = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23)).to(tl.float32, bitcast=True)
            low = low * scale
            high = high * scale
        if K_IS_IN:
            low = tl.trans(low)
            high = tl.trans(high)
        return low, high

    @triton.jit
    def _mxfp4_k_in_loop(
        acc,
        x_ptr,
        src,
        stride_xm,
        stride_xk,
        row_mask,
        w_base,
        ws_base,
        stride_wn,
        stride_wso,
        cols,
        col_mask,
        K,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """``acc += x W_e^T`` over K = in: each x tile split into its even and odd inputs (a
        register split of neighbouring pairs), one dot per half with the matching decoded half."""
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(
                x_ptr + src[:, None] * stride_xm + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
            w_even, w_odd = _mxfp4_halves(w_base, ws_base, stride_wn, stride_wso, cols, col_mask, k0, K, True, BLOCK_K, BLOCK_N)
            if CAST_F32:
                a_even = a_even.to(tl.float32)
                a_odd = a_odd.to(tl.float32)
            else:
                w_even = w_even.to(x_ptr.dtype.element_ty)
                w_odd = w_odd.to(x_ptr.dtype.element_ty)
            acc = tl.dot(a_even, w_even, acc, input_precision=PRECISION)
            acc = tl.dot(a_odd, w_odd, acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _mxfp4_k_out_loop(
        x_ptr,
        src,
        stride_xm,
        stride_xk,
        row_mask,
        w_base,
        ws_base,
        stride_wk,
        stride_wso,
        N,
        K,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """``dY W_e`` over K = out: one accumulator for the even inputs (output columns) and one for
        the odd, interleaved once at the end rather than every decoded tile."""
        n0 = tl.program_id(1) * BLOCK_N
        acc_even = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
        acc_odd = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(
                x_ptr + src[:, None] * stride_xm + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )
            w_even, w_odd = _mxfp4_halves(w_base, ws_base, stride_wk, stride_wso, ks, k_mask, n0, N, False, BLOCK_N, BLOCK_K)
            if CAST_F32:
                a = a.to(tl.float32)
            else:
                w_even = w_even.to(x_ptr.dtype.element_ty)
                w_odd = w_odd.to(x_ptr.dtype.element_ty)
            acc_even = tl.dot(a, w_even, acc_even, input_precision=PRECISION)
            acc_odd = tl.dot(a, w_odd, acc_odd, input_precision=PRECISION)
        return tl.interleave(acc_even, acc_odd)

    @triton.autotune(
        configs=_configs(_MM_TILES + [t for t in _MX_TILES if t not in _MM_TILES]),
        key=["N", "K", "ROWS_BUCKET", "HAS_LORA", "W_MXFP4"],
        prune_configs_by={"early_config_prune": _prune_mm},
        do_bench=_bench,
        **_autotune_options(),
    )
    @triton.jit(do_not_specialize=["ROWS_BUCKET"])
    def grouped_mm_kernel(
        x_ptr,
        stride_xm,
        stride_xk,
        rows_ptr,
        ends_ptr,
        num_experts,
        w_ptr,
        stride_we,
        stride_wk,
        stride_wn,
        bias_ptr,
        stride_be,
        stride_bn,
        xa_ptr,
        stride_am,
        stride_ar,
        lb_ptr,
        stride_lbe,
        stride_lbn,
        stride_lbr,
        scaling,
        y_ptr,
        stride_ym,
        stride_yn,
        N,
        K,
        R,
        ROWS_BUCKET,
        GATHER: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_LORA: tl.constexpr,
        E_P2: tl.constexpr,
        ws_ptr,
        stride_wse,
        stride_wso,
        W_MXFP4: tl.constexpr,
        MX_K_IS_IN: tl.constexpr,
        BLOCK_R: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        expert, row0, end = _expert_of_tile(tl.program_id(0), ends_ptr, num_experts, E_P2, BLOCK_M)
        if expert >= num_experts:
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        if GATHER:
            src = tl.load(rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_base = w_ptr + expert.to(tl.int64) * stride_we

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if W_MXFP4:
            ws_base = ws_ptr + expert.to(tl.int64) * stride_wse
            if MX_K_IS_IN:
                acc = _mxfp4_k_in_loop(
                    acc,
                    x_ptr,
                    src,
                    stride_xm,
                    stride_xk,
                    row_mask,
                    w_base,
                    ws_base,
                    stride_wn,
                    stride_wso,
                    cols,
                    col_mask,
                    K,
                    CAST_F32,
                    PRECISION,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                )
            else:
                acc = _mxfp4_k_out_loop(
                    x_ptr,
                    src,
                    stride_xm,
                    stride_xk,
                    row_mask,
                    w_base,
                    ws_base,
                    stride_wk,
                    stride_wso,
                    N,
                    K,
                    CAST_F32,
                    PRECISION,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                )
        else:
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < K
                a = tl.load(
                    x_ptr + src[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0,
                )
                if CAST_F32:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)

        if HAS_LORA:
            # Epilogue: + s * xa B_e^T, xa the rows' rank-r intermediate (sorted row order).
            rs = tl.arange(0, BLOCK_R)
            r_mask = rs < R
            xa = tl.load(
                xa_ptr + rows[:, None].to(tl.int64) * stride_am + rs[None, :] * stride_ar,
                mask=row_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            lb = tl.load(
                lb_ptr + expert.to(tl.int64) * stride_lbe + rs[:, None] * stride_lbr + cols[None, :] * stride_lbn,
                mask=r_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if CAST_F32:
                xa = xa.to(tl.float32)
                lb = lb.to(tl.float32)
            acc += scaling * tl.dot(xa, lb, input_precision=PRECISION)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols * stride_bn, mask=col_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        tl.store(
            y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn,
            acc.to(y_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )

    @triton.autotune(
        configs=_configs(_WGRAD_TILES),
        key=["M", "N", "ROWS_BUCKET"],
        prune_configs_by={"early_config_prune": _prune_wgrad},
        do_bench=_bench,
        **_autotune_options(),
    )
    @triton.jit(do_not_specialize=["ROWS_BUCKET"])
    def grouped_wgrad_kernel(
        a_ptr,
        stride_as,
        stride_am,
        b_ptr,
        stride_bs,
        stride_bn,
        rows_ptr,
        ends_ptr,
        out_ptr,
        stride_oe,
        stride_om,
        stride_on,
        M,
        N,
        scale,
        ROWS_BUCKET,
        GATHER_A: tl.constexpr,
        GATHER_B: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        expert = tl.program_id(0)
        end = tl.load(ends_ptr + expert)
        start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
        ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = ms < M
        n_mask = ns < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s0 in range(start, end, BLOCK_K):
            ss = s0 + tl.arange(0, BLOCK_K)
            s_mask = ss < end
            if GATHER_A or GATHER_B:
                gathered = tl.load(rows_ptr + ss, mask=s_mask, other=0).to(tl.int64)
            if GATHER_A:
                sa = gathered
            else:
                sa = ss.to(tl.int64)
            if GATHER_B:
                sb = gathered
            else:
                sb = ss.to(tl.int64)
            at = tl.load(
                a_ptr + sa[None, :] * stride_as + ms[:, None] * stride_am, mask=m_mask[:, None] & s_mask[None, :], other=0.0
            )
            bt = tl.load(
                b_ptr + sb[:, None] * stride_bs + ns[None, :] * stride_bn, mask=s_mask[:, None] & n_mask[None, :], other=0.0
            )
            if CAST_F32:
                at = at.to(tl.float32)
                bt = bt.to(tl.float32)
            acc = tl.dot(at, bt, acc, input_precision=PRECISION)
        tl.store(
            out_ptr + expert.to(tl.int64) * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on,
            (acc * scale).to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )
