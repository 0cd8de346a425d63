"""speccompile: turn a Hugging Face causal LM into a lossless self-speculative model."""

__version__ = "0.1.0"
