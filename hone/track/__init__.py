"""Run tracking: ``metrics.jsonl``, TensorBoard events, ``loss.png`` and console progress."""
