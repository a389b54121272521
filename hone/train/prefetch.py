"""The loop's windows, each collated and copied to the device one step ahead.

While step N's forward and backward run on the device, the host builds step N+1's window
(reads the rows, collates them, queues their copies to the device through pinned memory and
its attention inputs), so that after step N's one sync the next forward starts without waiting
for the data. Only *when* that work happens changes:

- the data order is the stream's, window after window, exactly as without prefetching;
- a window carries the stream's position after it (:attr:`~hone.train.train_step.Window.position`),
  and the loop saves the position of the window it trained, so a window prefetched but never
  trained (the run stops after step N) is not counted as consumed in a checkpoint;
- nothing here talks to other ranks: the all-reduce of a window's token counts is issued when
  the window is handed out (:meth:`WindowFeed.next`), in step order on every rank;
- an error while prefetching (a bad row, a device out of memory) is raised when that window
  would have been taken, after step N is counted, logged, evaluated and saved, as before.
"""

import torch

from hone.runtime.world import World
from hone.train.batches import Batches, BatchStream
from hone.train.train_step import Window, collate_window, with_global_counts
from hone.transforms.base import RunHooks


class WindowFeed:
    """Hands out the windows of ``stream`` in order; :meth:`prefetch` builds the next one early."""

    def __init__(self, stream: BatchStream, batches: Batches, device: torch.device, hooks: RunHooks, world: World):
        self.stream = stream
        self.batches = batches
        self.device = device
        self.hooks = hooks
        self.world = world
        self._ahead: Window | None = None
        self._error: Exception | None = None

    @property
    def holds_one(self) -> bool:
        """Whether the next window has been prefetched (or failed to be)."""
        return self._ahead is not None or self._error is not None

    def prefetch(self) -> None:
        """Build the next window now (call while the device computes the current step); a
        second call before :meth:`next` does nothing."""
        if self.holds_one:
            return
        try:
            self._ahead = collate_window(self.stream, self.batches, self.device, self.hooks)
        except Exception as exc:  # raised by next(), where taking this window would have raised it
            self._error = exc

    def next(self) -> Window:
        """The next window, ready to train: the prefetched one, else built now."""
        error, self._error = self._error, None
        if error is not None:
            raise error
        window, self._ahead = self._ahead, None
        if window is None:
            window = collate_window(self.stream, self.batches, self.device, self.hooks)
        return with_global_counts(window, self.device, self.world)
