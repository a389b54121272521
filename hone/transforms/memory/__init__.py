"""Peak GPU memory of a training step, estimated from the config alone (no weight is read).

Why: ``hone plan`` shows what fits before a model is loaded, and ``activation_checkpointing:
auto`` picks the fastest policy whose estimate fits the card. The estimate is a sum of parts a
user can act on (weights, trainable state, optimizer, activations, loss, workspace), and its
largest part is the activations: what autograd keeps per decoder layer until the backward.

Where each part is counted
--------------------------
* :mod:`.knobs`: what an estimate is asked about (policy, loss, the step's shape, the memory
  switches), one :class:`~.knobs.Knobs`; :mod:`.step` resolves it against the config once.
* :mod:`.facts`: the model, built once on the ``meta`` device with its adapter (parameter
  counts, dtypes, the linear layers of every decoder layer).
* :mod:`.layers`: the bytes autograd keeps per decoder layer, op by op.
* :mod:`.terms`: one module per transform that changes the step's memory (checkpointing,
  offload, tiled MLP, tiled layers, FSDP, fp8, loss): a new transform adds its term there and
  calls it from :func:`.estimate.estimate_memory`.
* :mod:`.estimate`: the training state, the phases of a step and its peak.
* :mod:`.longest`: the longest sequence that fits; :mod:`.decide`: what the config asks for and
  the ``auto`` decisions made from the estimate (tiled MLP, tiled layers, the loss) within the
  margin they keep (:func:`.decide.auto_limit`).

Calibrated against ``torch.cuda.max_memory_allocated`` of ``hone bench`` rows on an H100 (see
docs/plan.md); the peaks of the qwen3-8b and llama3-8b rows are within a few percent.
"""
