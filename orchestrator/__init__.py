"""orch: run and watch large-model experiments on remote multi-GPU hosts."""

__version__ = "0.1.0"
