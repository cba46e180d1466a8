"""The playbooks orch ships: one module each, holding its Spec and its steps (found by orchestrator.runflow.registry);
and `eagle3_debug`, the tables that a patch set's lines fill (found by orchestrator.store.runtables)."""
