"""What orch records, and the one way to it: runs, jobs, sweeps and events in SQLite (`Store`, schema by
sqlite-utils' `Migrations`), their typed records and statuses (`record`, `lifecycle`), the JSON shape of
each noun (`shapes`), the controllers that own them (`controller`, `lease`) and what past runs predict
(`history`, `summaries`)."""

from .db import Store

__all__ = ["Store"]
