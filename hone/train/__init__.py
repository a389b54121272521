"""Training: collation, batching, optimizer and schedule, the loop, checkpoints and resume."""
