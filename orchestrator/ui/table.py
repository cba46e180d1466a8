"""The runs table: filters and keyset paging done in SQL (store.runtable), so a page costs the same at
100 000 runs as at 10."""

from __future__ import annotations

from typing import Any

from ..config import metricinfo
from ..store import Store, runtable
from ..store import sweeps as stored_sweeps
from ..store.record import STATUS_WORDS
from ..store.runtable import COLUMNS, RunFilters

PAGE_MAX = 200
COUNT_CAP = 10_000  # past this the table says "10000+": an exact count of a text search reads every row
KEY_METRICS = 3
FACET_SWEEPS = 200

__all__ = ["COLUMNS", "Filters", "facets", "page"]


class Filters(RunFilters):
    @classmethod
    def parse(cls, params: Any) -> Filters:
        """From a query string (a Mapping with getlist): unknown statuses and a non-numeric sweep are dropped."""
        known = set(STATUS_WORDS)
        statuses = [s for raw in params.getlist("status") for s in raw.split(",") if s in known]
        sweep = params.get("sweep") or ""
        return cls(statuses=statuses, host=params.get("host") or None, playbook=params.get("playbook") or None,
                   sweep=int(sweep) if sweep.isdigit() and len(sweep) < 19 else None,
                   text=(params.get("q") or "").strip()[:200] or None)


def page(store: Store, filters: RunFilters, limit: int = 50, before: int | None = None,
         after: int | None = None) -> dict[str, Any]:
    """One page of runs, newest first: those older than `before`, or the page just newer than `after`."""
    limit = max(1, min(limit, PAGE_MAX))
    ascending = after is not None and before is None
    rows = runtable.rows(store, filters, limit + 1, before=before, after=after)
    more = len(rows) > limit
    rows = rows[:limit]
    if ascending:
        rows.reverse()
    metrics = store.latest_metrics_of([r["id"] for r in rows])
    for r in rows:
        found = metrics[r["id"]]  # the playbook's headlines first
        r["metrics"] = {k: found[k] for k in metricinfo.order(found, r["playbook"])[:KEY_METRICS]}
    count = runtable.count(store, filters, COUNT_CAP + 1)
    newest = rows[0]["id"] if rows else None
    oldest = rows[-1]["id"] if rows else None
    # where the neighbouring pages start (None: there is none); `more` answers for the way this page went
    older = more if not ascending else oldest is not None and runtable.exists(store, filters, older_than=oldest)
    newer = more if ascending else (before is not None and newest is not None
                                    and runtable.exists(store, filters, newer_than=newest))
    return {"runs": rows, "count": min(count, COUNT_CAP), "count_capped": count > COUNT_CAP,
            "older": oldest if older else None, "newer": newest if newer else None}


def facets(store: Store) -> dict[str, Any]:
    """The choices of the filters: statuses, hosts and playbooks seen, the newest sweeps."""
    return {"statuses": list(STATUS_WORDS), "hosts": runtable.hosts(store),
            "playbooks": runtable.playbooks(store), "sweeps": stored_sweeps.recent(store, FACET_SWEEPS)}
