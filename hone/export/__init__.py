"""After training: load a run for inference, generate text, merge a LoRA adapter.

Import-free like :mod:`hone.models`: ``from hone.export.generate import generate``.
"""
