"""`orch ui`: a local web dashboard of the workspace — runs, a run, sweeps, hosts, compare — live.

The modules: `table` (the runs table, its SQL in store.runtable), `pages` (the other pages' documents),
`logtail` (log tails fetched without holding up the server), `guard` (what is allowed, for whom), `server`
(the Starlette app and serving it), `report` (compare and a sweep's HTML report, for the CLI too), `tracking`
(`orch export mlflow`: MLflow, the `mlflow` extra, is imported there alone);
`static/` holds the one page shell, its script and its styles.
Starlette and uvicorn are the `ui` extra: nothing outside this package imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.workspace import Workspace


def serve(ws: Workspace, port: int = 8765, bind: str = "127.0.0.1", allow_actions: bool = False,
          token: str | None = None, echo: Callable[[str], None] = print) -> None:
    """Serve the dashboard until interrupted."""
    try:
        from . import server
    except ImportError as exc:
        raise UsageError(f"orch ui needs the web stack ({exc.name}): pip install 'orch[ui]'") from None
    server.serve(ws, port=port, bind=bind, allow_actions=allow_actions, token=token, echo=echo)
