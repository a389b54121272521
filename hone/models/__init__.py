"""Models: architecture presets, loading from local directories, adapters, saving.

Kept import-free on purpose: ``hone.models.tokenizer`` is imported by light commands
(``hone preprocess``) that should not pay for building model machinery they never use.
Import the submodules directly (``from hone.models.loader import load_model``).
"""
