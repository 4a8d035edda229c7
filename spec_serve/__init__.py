"""spec-serve: frozen-target supervision for speculative-decoding draft training.

Importing this package is cheap: it never imports vllm or sglang, and the
heavy modules (broker, worker, client) are imported by their users.
"""

__version__ = "0.1.0"
