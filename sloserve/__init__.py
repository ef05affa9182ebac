"""sloserve: SLO-aware adaptive speculative decoding serving."""

__version__ = "0.1.0"
