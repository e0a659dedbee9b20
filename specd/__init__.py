"""specd: a local code-completion daemon with lossless speculative decoding."""

__version__ = "0.1.0"
