"""The preference objectives (DPO, IPO, ORPO) as the run's loss function on packed pairs.

:class:`PairLoss` is a :data:`~hone.runtime.step.LossFn`: from the decoder's last hidden states
of a pair micro-batch (:mod:`hone.data.pairs`) it takes each sequence's summed completion
log-probabilities with :func:`~hone.kernels.sequence_logprobs.sequence_logprobs` (chunk by
chunk, never the ``[tokens x vocab]`` logits) and hands them to the pure objectives of
:mod:`hone.runtime.preference_loss`.

Normalisation over the accumulation window (DESIGN.md, principle 5): a micro-batch returns
**sums**, the vector ``[NLL sum, pair-loss sum, metric sums...]`` (:data:`PAIR_TERMS` loss terms,
then one sum over its pairs per metric); the loop divides the loss terms by the window's
``[NLL tokens, pairs]`` (global over the ranks: :mod:`hone.train.train_step`), so DPO's loss is
the mean over the window's pairs and ORPO's NLL the mean over its chosen tokens, whatever the
``micro_batch x accumulation x ranks`` split. DPO and IPO have no NLL: their first term is 0.

The reference log-probabilities come with the batch (``batch.reference_logps``): computed by
:func:`hone.runtime.step.with_reference` just before the policy's forward, by the same model with
its adapter(s) switched off (``reference_off``), under ``torch.no_grad``; or precomputed once
before the first step (:mod:`hone.train.reference`, inside :meth:`PairLoss.computing_reference`).
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from hone.data.collate import IGNORE_INDEX, MicroBatch
from hone.runtime.preference_loss import dpo, ipo, orpo
from hone.track.preference_metrics import ORPO_METRICS, REWARD_METRICS

#: The loss terms of a pair micro-batch's vector: the NLL token sum and the pair-loss sum.
PAIR_TERMS = 2


def metric_names(objective: str) -> tuple[str, ...]:
    """The metrics summed per micro-batch after the loss terms, in order."""
    return REWARD_METRICS + ORPO_METRICS if objective == "orpo" else REWARD_METRICS


class PairLoss:
    """``loss(hidden [B, T, H], head, batch) -> float32 [PAIR_TERMS + metrics]`` sums of a pair
    micro-batch (module docstring). ``reference_off``: a context manager switching the model's
    adapter(s) off, for DPO and IPO (None for ORPO, which has no reference)."""

    def __init__(
        self,
        objective: str,
        beta: float,
        label_smoothing: float = 0.0,
        reference_off: Callable[[], AbstractContextManager] | None = None,
    ):
        if objective not in ("dpo", "ipo", "orpo"):
            raise ValueError(f"objective {objective!r} is not one of dpo, ipo, orpo")
        self.objective = objective
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.reference_off = reference_off if objective != "orpo" else None
        self.metrics = metric_names(objective)
        self.reference_only = False

    @contextmanager
    def computing_reference(self) -> Iterator[None]:
        """Inside it, a micro-batch's loss is its reference log-probs ``[2P]`` instead (the
        precomputed reference's one pass over the pairs, through the run's own step module)."""
        self.reference_only = True
        try:
            yield
        finally:
            self.reference_only = False

    def segments(self, batch: MicroBatch) -> int:
        """The sequences summed per micro-batch: chosen and rejected completions (and for ORPO
        the chosen prompts)."""
        return (3 if self.objective == "orpo" else 2) * batch.pairs

    def logps(self, hidden: torch.Tensor, head: nn.Module, batch: MicroBatch) -> torch.Tensor:
        """Float32 ``[segments]``: each segment's summed target log-probabilities."""
        from hone.kernels.sequence_logprobs import sequence_logprobs

        assert batch.segments is not None and batch.counted is not None, "a pair micro-batch (hone.data.pairs)"
        weight, bias = head.weight, getattr(head, "bias", None)
        if weight.dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):
            weight = weight.to(hidden.dtype)  # (under autocast the kernel casts both itself)
            bias = bias.to(hidden.dtype) if bias is not None else None
        counted = batch.counted  # only the positions that sum into a sequence go through the head
        return sequence_logprobs(
            hidden.reshape(-1, hidden.shape[-1]).index_select(0, counted),
            weight,
            batch.targets.reshape(-1).index_select(0, counted),
            batch.segments.reshape(-1).index_select(0, counted),
            self.segments(batch),
            bias=bias,
            ignore_index=IGNORE_INDEX,
        )

    def __call__(self, hidden: torch.Tensor, head: nn.Module, batch: MicroBatch) -> torch.Tensor:
        if self.reference_only:
            return self.reference_logps(hidden, head, batch)
        pairs = batch.pairs
        sums = self.logps(hidden, head, batch)
        chosen, rejected = sums[:pairs], sums[pairs : 2 * pairs]
        tokens = batch.completion_tokens
        if self.objective == "orpo":
            assert tokens is not None
            nll_sum = -(chosen.sum() + sums[2 * pairs :].sum())
            result = orpo(chosen, rejected, tokens[:pairs], tokens[pairs:], nll=nll_sum.detach(), beta=self.beta)
        else:
            ref = batch.reference_logps
            if ref is None:
                raise ValueError(f"{self.objective}: the micro-batch has no reference log-probabilities")
            ref_chosen, ref_rejected = ref[:pairs], ref[pairs:]
            nll_sum = sums.new_zeros(())
            if self.objective == "dpo":
                result = dpo(chosen, rejected, ref_chosen, ref_rejected, self.beta, self.label_smoothing)
            else:
                assert tokens is not None
                result = ipo(chosen, rejected, ref_chosen, ref_rejected, tokens[:pairs], tokens[pairs:], self.beta)
        metric_sums = [result.metrics[name] * pairs for name in self.metrics]
        return torch.stack([nll_sum, result.pair_losses.sum(), *metric_sums])

    def reference_logps(self, hidden: torch.Tensor, head: nn.Module, batch: MicroBatch) -> torch.Tensor:
        """Float32 ``[2P]``: the completions' summed log-probs (chosen, then rejected) from the
        reference's hidden states."""
        return self.logps(hidden, head, batch)[: 2 * batch.pairs]


def window_values(sums: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """A window's ``[loss, NLL mean, metric means...]`` from its micro-batches' summed vectors
    and its ``[NLL tokens, pairs]`` divisor (each entry a plain sum over ranks, so an all-reduce
    SUM of every rank's values gives the global ones)."""
    terms = sums[:PAIR_TERMS] / divisor
    return torch.cat([terms.sum().reshape(1), terms[:1], sums[PAIR_TERMS:] / divisor[1]])
