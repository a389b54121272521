"""Training: set-up, the loop, one optimizer step and one micro-batch, the training state,
batching, optimizer and schedule, checkpoints and resume (collation is :mod:`hone.data.collate`)."""
