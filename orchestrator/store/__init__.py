"""What orch records, and the one way to it: runs, jobs, sweeps and events in SQLite (`Store`, schema by
sqlite-utils' `Migrations`; the sweep tables in `sweeps`, plugins' tables about runs in `runtables`, the
dashboard's runs table in `runtable`; JSON columns written and read by `encoding` alone), their typed
records and statuses (`record`, `lifecycle`), the JSON shape of each noun (`shapes`), the controllers that
own them (`controller`, `lease`) and what past runs predict (`history`, `summaries`).
No module outside this package speaks SQL."""

from .db import Store, StoreError

__all__ = ["Store", "StoreError"]
