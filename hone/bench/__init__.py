"""``hone bench``: time hone against a plain transformers + PEFT reference on the same shapes."""
