"""The playbooks orch ships: one module each, holding its Spec and its steps (found by orchestrator.runflow.registry)."""
