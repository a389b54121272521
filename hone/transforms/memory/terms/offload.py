"""The ``offload`` checkpointing policy's host side: how many layers' inputs go to pinned host
memory, in which blocks, and what the process holds besides.

``offload`` moves the layers' inputs to pinned host memory (reported as ``host``, in power-of-two
blocks as torch's pinned allocator rounds them), all of them or, when the host cannot hold them
(``memory.offload_layers``, :func:`offload_split`), the first ones, keeping the others on the
GPU. ``host_total`` adds the process's own resident memory (:func:`host_process_bytes`).
"""

from typing import Literal

from hone.transforms.memory.step import Step
from hone.units import GIB

#: Host memory of a training process that offloads nothing (resident set): the torch/CUDA
#: libraries and the CUDA context's host side, Python, the tokenizer and the data. Set from
#: ``hone bench`` rows' peak RSS at short lengths on an H100 machine (1.9 GiB at 2K tokens).
HOST_BASE_BYTES = 2 * GIB

#: Beyond that and the pinned blocks, an ``offload`` run's resident memory grows by about this
#: many layer inputs (``tokens x hidden`` in the compute dtype): calibrated on qwen3-8b
#: ``offload`` rows on an H100 machine (peak RSS 4.2, 21.3 and 79.9 GiB at 8K, 64K and 256K
#: tokens, of which 2.2, 17.5 and 70 GiB pinned blocks).
HOST_INPUTS_BEYOND_PINNED = 4

#: The same with tiled layers, whose backward rebuilds a layer one chunk at a time: half a layer
#: input, calibrated on the two tiled ``offload`` rows measured on an H100 machine (qwen3-8b, peak
#: RSS 73.1 GiB at 256K tokens in 8 chunks with 70 GiB pinned; 70.0 GiB at 512K in 16 chunks,
#: runs of two, with 68 GiB pinned). How many inputs may go to the host (:func:`offload_split`)
#: still reserves the untiled figure: one 512K row is too little to give that margin away.
HOST_INPUTS_BEYOND_PINNED_TILED = 0.5


def host_process_bytes(input_bytes: int, tiled_layers: bool = False) -> int:
    """The process's host memory besides its pinned blocks, for layer inputs of ``input_bytes``
    (``tiled_layers``: the layers are computed in chunks)."""
    beyond = HOST_INPUTS_BEYOND_PINNED_TILED if tiled_layers else HOST_INPUTS_BEYOND_PINNED
    return HOST_BASE_BYTES + int(beyond * input_bytes)


#: The share of the host's memory an offload split may not use (the page cache, other
#: processes, and the allocator's rounding beyond what :func:`pinned_block` counts).
HOST_MARGIN = 0.1


def pinned_block(nbytes: int) -> int:
    """Bytes torch's pinned-memory allocator takes for an ``nbytes`` request: it rounds every
    block up to a power of two (``CachingHostAllocator``), so a layer input of 4.5 GiB costs 8 GiB
    of host memory: the split must count blocks, not tensors."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def offload_split(layers: int, input_bytes: int, asked: int | Literal["auto"], host_budget: int | None) -> int:
    """How many layers' inputs the ``offload`` policy moves to the host: ``asked`` when it is a
    count (at most ``layers``); for ``auto`` every layer's when ``host_budget`` (bytes of host
    memory; None: unlimited) holds them, else as many pinned blocks as fit it less
    :data:`HOST_MARGIN` and the process's own (:func:`host_process_bytes`). The others stay on
    the GPU."""
    if asked != "auto":
        return max(0, min(int(asked), layers))
    block = pinned_block(input_bytes)
    if host_budget is None or block == 0:
        return layers
    room = int(host_budget * (1 - HOST_MARGIN)) - host_process_bytes(input_bytes)
    return max(0, min(layers, room // block))


def host_bytes(step: Step, offloaded: int) -> tuple[int, int]:
    """The term: (pinned blocks, the process's host memory with them) of ``step`` when
    ``offloaded`` layers' inputs are on the host."""
    pinned = offloaded * pinned_block(step.input_bytes)
    process = host_process_bytes(step.input_bytes if step.policy == "offload" else 0, tiled_layers=step.chunks > 0)
    return pinned, process + pinned
