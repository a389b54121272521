"""Keep saved activations in host memory between the forward and the backward.

:class:`OffloadActivations` is a pair of ``torch.autograd.graph.saved_tensors_hooks``: when
autograd saves a tensor for the backward, ``pack`` copies it to pinned host memory and hands
autograd a small handle instead, so the device copy can be freed as soon as the forward no longer
needs it; ``unpack`` brings it back when the backward asks for it.

Under full activation checkpointing (the ``offload`` policy) the only tensors saved outside the
checkpointed layers' own recompute hooks are the layers' inputs (torch's non-reentrant
checkpoint saves them with an ordinary ``save_for_backward``; everything inside a layer goes to
the checkpoint's innermost hooks, which take precedence). So with the model's final norm pausing
the offloader (:meth:`OffloadActivations.pause_before`), exactly one tensor per layer, of
``micro-batch x seq x hidden`` elements, goes to the host: the device keeps none of the layers'
activations between the forward and the backward.

On CUDA the copies run on side streams so they overlap compute:

- pack: the device-to-host stream waits for the compute stream (the tensor must be written
  before it is read), copies into pinned memory without blocking, and ``record_stream`` tells
  the caching allocator that the device tensor is in use on that stream, so its memory is not
  handed out again until the copy has finished, even though autograd drops it right away.
- unpack: the backward asks for layer ``k``'s input when it starts recomputing layer ``k``;
  that tensor is normally already on its way (prefetched), and the host-to-device copy of the
  next one needed (layer ``k-1``'s, the previous one packed) is started at once, so it runs while
  layer ``k`` is recomputed and differentiated. The compute stream waits on the copy's event
  before reading, and the device tensor is allocated from the compute stream's pool (not the side
  stream's, which would strand memory in a second pool) and marked with ``record_stream`` for
  the side stream that writes it.

Parameters and frozen weights are never copied (autograd saves many of them, e.g. a linear
layer's weight; they live on the device anyway), nor are tensors below ``min_bytes``, tensors
that do not require grad (masks, RoPE tables: cheap, and shared by every layer) or leaves that
do (with LoRA, the embedding output that feeds layer 0: autograd's gradient accumulator holds it
on the device whatever we do, so a host copy would only cost).
Without CUDA the copy is a plain host copy, so the hook path is testable on any machine.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: Below this a tensor stays where it is: a copy costs more in latency than it saves.
DEFAULT_MIN_BYTES = 1 << 20


@dataclass
class _Saved:
    """One offloaded tensor: its host copy and where it goes back to."""

    host: torch.Tensor
    device: torch.device
    copied: torch.cuda.Event | None = None  # device-to-host copy done
    back: torch.Tensor | None = None  # prefetched device copy, not yet handed to autograd
    arrived: torch.cuda.Event | None = None  # host-to-device copy of ``back`` done
    unpacked: bool = False


@dataclass
class OffloadStats:
    """What went through the hooks in the last micro-batch (for tests and the record)."""

    packed: int = 0
    packed_bytes: int = 0
    kept: int = 0  # seen by the hooks but left on the device (small, a weight, no grad, paused)
    prefetched: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)


class OffloadActivations:
    """Saved-tensor hooks that keep big activations in (pinned) host memory.

    Use :meth:`step_context` around each micro-batch's forward and backward. One instance serves
    a whole run; each step's host copies are released when its context exits (pinned memory goes
    back to torch's host cache, so later steps reuse it without pinning again).
    """

    def __init__(
        self,
        min_bytes: int = DEFAULT_MIN_BYTES,
        use_streams: bool = True,
        model: nn.Module | None = None,
        max_tensors: int | None = None,
    ) -> None:
        """``model``: its parameters are never copied (checked by storage, so views of frozen
        weights are caught too); ``use_streams``: copy on side CUDA streams (else on the
        current stream, still without blocking the host); ``max_tensors``: offload at most this
        many tensors per micro-batch, the first ones saved (None: every one that qualifies).

        Why the first: the backward needs the last-saved tensors first, so those are best kept
        on the device (no copy back to wait for), and by the time it reaches the offloaded ones
        the kept ones have been freed, leaving room for the copies coming back. Under the
        ``offload`` policy one tensor is one layer's input, so this is the host/GPU split of
        ``memory.offload_layers`` when the host cannot hold every layer's."""
        if max_tensors is not None and max_tensors < 0:
            raise ValueError(f"max_tensors must be >= 0 or None, got {max_tensors}")
        self.max_tensors = max_tensors
        self.min_bytes = min_bytes
        self.use_streams = use_streams
        # weakly: a registry keyed by the model holds this offloader, which must not keep it alive
        self._model = weakref.ref(model) if model is not None else None
        self.stats = OffloadStats()
        self._saved: list[_Saved] = []
        self._weights: set[int] = set()
        self._active = False
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None

    # ------------------------------------------------------------------ the seam

    @contextmanager
    def step_context(self) -> Iterator[None]:
        """Offload during one micro-batch's forward and backward."""
        with self.session(), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    @contextmanager
    def session(self) -> Iterator[None]:
        """One micro-batch's bookkeeping without installing the hooks: for saved-tensor hooks
        of another transform that hand some tensors on to :meth:`pack` / :meth:`unpack` (only
        one pair of default hooks is active at a time; layer-run checkpointing chains this one)."""
        self._begin()
        try:
            yield
        finally:
            self._end()

    def pack(self, tensor: torch.Tensor) -> Any:
        """The pack hook: a handle for a tensor moved to the host, or the tensor itself."""
        return self._pack(tensor)

    def unpack(self, handle: Any) -> torch.Tensor:
        """The unpack hook: the tensor :meth:`pack` was given, on its device again."""
        return self._unpack(handle)

    def pause(self) -> None:
        """Stop offloading for the rest of this forward (what is saved after the last layer, the
        head's input and the loss, is needed first by the backward: copying it is pure cost)."""
        self._active = False

    def pause_before(self, module: nn.Module) -> Any:
        """Pause when ``module`` starts its forward (a forward pre-hook; returns its handle)."""
        return module.register_forward_pre_hook(lambda *_: self.pause())

    # ------------------------------------------------------------------ hooks

    def _begin(self) -> None:
        self.stats = OffloadStats()
        self._saved = []
        self._active = True
        model = self._model() if self._model is not None else None
        if model is not None:  # re-read each step: casting or loading may move storages
            self._weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def _end(self) -> None:
        self._active = False
        self._saved = []

    def _offloads(self, tensor: torch.Tensor) -> bool:
        if not self._active or isinstance(tensor, nn.Parameter) or not tensor.requires_grad:
            return False
        if self.max_tensors is not None and self.stats.packed >= self.max_tensors:
            return False
        if tensor.grad_fn is None:  # a leaf: autograd's grad accumulator keeps it alive anyway
            return False
        if not tensor.is_floating_point() or tensor.numel() * tensor.element_size() < self.min_bytes:
            return False
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return False
        return tensor.untyped_storage().data_ptr() not in self._weights

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._offloads(tensor):
            self.stats.kept += 1
            return tensor
        saved = self._to_host(tensor)
        self._saved.append(saved)
        self.stats.packed += 1
        self.stats.packed_bytes += tensor.numel() * tensor.element_size()
        self.stats.shapes.append(tuple(tensor.shape))
        return len(self._saved) - 1

    def _unpack(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        saved = self._saved[handle]
        if saved.back is None:
            self._bring_back(saved)
        tensor = self._hand_over(saved)
        saved.unpacked = True
        ahead = next((s for s in reversed(self._saved[:handle]) if not s.unpacked and s.back is None), None)
        if ahead is not None:  # the backward runs the layers in reverse: the previous one is next
            self._bring_back(ahead)
            self.stats.prefetched += 1
        return tensor

    # ------------------------------------------------------------------ copies

    def _streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._d2h is None or self._d2h.device != device:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)
        return self._d2h, self._h2d  # type: ignore[return-value]

    def _to_host(self, tensor: torch.Tensor) -> _Saved:
        device = tensor.device
        if device.type != "cuda":
            host = torch.empty_like(tensor, device="cpu")
            host.copy_(tensor.detach())
            return _Saved(host, device)
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        if not self.use_streams:
            host.copy_(tensor.detach(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            return _Saved(host, device, copied)
        d2h, _ = self._streams(device)
        d2h.wait_stream(torch.cuda.current_stream(device))  # the tensor's producers are done
        with torch.cuda.stream(d2h):
            host.copy_(tensor.detach(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(d2h)
        tensor.record_stream(d2h)  # its memory is not reused before the copy has read it
        return _Saved(host, device, copied)

    def _bring_back(self, saved: _Saved) -> None:
        """Start copying ``saved`` back to its device (at once, off CUDA)."""
        if saved.device.type != "cuda":
            saved.back = saved.host.to(saved.device, copy=True)
            return
        compute = torch.cuda.current_stream(saved.device)
        back = torch.empty_like(saved.host, device=saved.device)  # from the compute stream's pool
        copy_stream = self._streams(saved.device)[1] if self.use_streams else compute
        copy_stream.wait_stream(compute)  # the block's previous users (on compute) are done
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_event(saved.copied)  # the host copy is complete
            back.copy_(saved.host, non_blocking=True)
            saved.arrived = torch.cuda.Event()
            saved.arrived.record(copy_stream)
        if copy_stream is not compute:
            back.record_stream(copy_stream)
        saved.back = back

    def _hand_over(self, saved: _Saved) -> torch.Tensor:
        """The device copy, safe to read on the current stream; we keep no reference to it."""
        tensor, saved.back = saved.back, None
        assert tensor is not None
        if saved.arrived is not None:
            torch.cuda.current_stream(saved.device).wait_event(saved.arrived)
        return tensor  # autograd puts the saved grad metadata back on it
