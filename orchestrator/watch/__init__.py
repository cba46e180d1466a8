"""Watching runs: one watcher per host (`hostwatch`), which hands what the host's agent pushes to each run's
recorder (runflow/recorder.py), and the followers of a run's record (`follow`: `orch run`, `orch watch`, a
sweep's lane). Above the run flow: it ends and finishes runs through runflow; nothing below imports it.

The package imports none of its modules: a host's watcher runs as `python -m orchestrator.watch.hostwatch`,
which must find that module not yet imported, or it would run as a second copy of itself.
"""
