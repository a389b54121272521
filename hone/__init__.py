"""hone: fast, exact, config-driven fine-tuning of Hugging Face causal language models."""

__version__ = "0.1.0"
