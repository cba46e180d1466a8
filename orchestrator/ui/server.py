"""The dashboard's web app (Starlette) and `orch ui` serving it (uvicorn).

Every page is the same static shell; its script asks the JSON API for data and writes it into the page
as text (never as markup), so a `<script>` in a log line or a spec value shows as itself. The API only
reads the database, which the runs' watchers keep current; the two actions go through the run flow.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import runflow
from ..config.hosts import Inventory
from ..config.workspace import Workspace
from ..errors import NotFound, OrchError, UsageError
from ..store import Store
from ..store.encoding import json_safe
from . import pages, report, table
from .guard import Guard
from .logtail import LogTails

STATIC = Path(__file__).parent / "static"
HOST_TIMEOUT_S = 20.0
# Defence in depth: even markup that got into a page could not run a script or load anything from elsewhere.
HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
                               " connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none';"
                               " form-action 'self'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}


class JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        # JSON has no NaN or infinity (JSON.parse refuses them): such a number is sent as its name, "NaN"
        return json.dumps(json_safe(content), default=str, separators=(",", ":"), allow_nan=False).encode()


class Shield:
    """ASGI middleware: the Host check, the token for the API when it is needed, the safety headers."""

    def __init__(self, app: ASGIApp, guard: Guard):
        self.app, self.guard = app, guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = None
        if not self.guard.host_ok(request.headers):
            refusal = Response("unknown Host", 421)
        elif request.url.path.startswith("/api/") and not self.guard.token_ok(request.headers):
            refusal = JSON({"error": "this dashboard answers only with its token: open the address `orch ui` "
                                     "printed (…/#token=…)"}, 401)

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] += [(k.encode(), v.encode()) for k, v in HEADERS.items()]
            await send(message)

        await (refusal or self.app)(scope, receive, send_with_headers)


class Dashboard:
    """The app's state: the workspace, the guard, a read-only store per worker thread, the log tails."""

    def __init__(self, ws: Workspace, guard: Guard):
        self.ws, self.guard = ws, guard
        Store(ws.db_path).close()  # migrations (the dashboard's indexes among them) before any reader
        self.tails = LogTails(ws)
        self._local = threading.local()

    def store(self) -> Store:
        store = getattr(self._local, "store", None)
        if store is None:
            store = Store(self.ws.db_path)
            store.read_only()  # the pages only read
            self._local.store = store
        return store

    # pages -----------------------------------------------------------------------------------------
    def shell(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    def meta(self, request: Request) -> Response:
        return JSON({"actions": self.guard.allow_actions, "workspace": str(self.ws.root)})

    def runs(self, request: Request) -> Response:
        q = request.query_params
        return JSON(table.page(self.store(), table.Filters.parse(q), limit=_int(q.get("limit"), None) or 50,
                               before=_int(q.get("before"), None), after=_int(q.get("after"), None)))

    def facets(self, request: Request) -> Response:
        return JSON(table.facets(self.store()))

    def run(self, request: Request) -> Response:
        return JSON(pages.run_page(self.ws, self.store(), request.path_params["run_id"]))

    def log(self, request: Request) -> Response:
        run = self.store().get_run(request.path_params["run_id"])
        return JSON(self.tails.tail(self.store(), run, _int(request.query_params.get("lines"), 200) or 200))

    def metrics(self, request: Request) -> Response:
        return JSON(pages.metric_series(self.store(), request.path_params["run_id"]))

    def sweeps(self, request: Request) -> Response:
        return JSON(pages.sweeps_page(self.store()))

    def sweep(self, request: Request) -> Response:
        return JSON(pages.sweep_page(self.store(), request.path_params["sweep_id"],
                                     request.query_params.get("objective")))

    def hosts(self, request: Request) -> Response:
        return JSON(pages.hosts_page(self.ws, self.store()))

    def gpus(self, request: Request) -> Response:
        return JSON(pages.gpus(self.ws, self.store(), _names(request), HOST_TIMEOUT_S))

    def check(self, request: Request) -> Response:
        return JSON(pages.reachability(self.ws, _names(request), HOST_TIMEOUT_S))

    def compare(self, request: Request) -> Response:
        ids = [_int(i, None) for i in request.query_params.get("ids", "").replace(" ", ",").split(",") if i]
        if None in ids:
            raise UsageError("ids: run ids, separated by commas")
        return JSON(report.compare(self.store(), [i for i in ids if i is not None],
                                  request.query_params.get("all") == "1"))

    # actions ---------------------------------------------------------------------------------------
    def act(self, request: Request) -> Response:
        refusal = self.guard.action_refusal(request.headers, request.url.scheme)
        if request.path_params["action"] not in ("cancel", "stop"):
            return JSON({"error": "no such action"}, 404)
        if refusal:
            return JSON({"error": refusal}, 403)
        store = Store(self.ws.db_path)  # a writer of its own: the readers are query-only
        try:
            run = runflow.open_run(self.ws, store, request.path_params["run_id"],
                                   Inventory.load(self.ws.hosts_file, self.ws.root))
            if request.path_params["action"] == "stop":
                outcome = runflow.stop(run)
            else:
                outcome = runflow.cancel(run, "cancelled from the dashboard")
            return JSON({"run": run.run_id, "outcome": outcome})
        finally:
            store.close()


def _int(text: str | None, default: int | None) -> int | None:
    return int(text) if text and text.isdigit() and len(text) < 19 else default


def _names(request: Request) -> list[str]:
    names = request.query_params.getlist("host")
    if not names:
        raise UsageError("which hosts? ?host=NAME")
    return names


async def _orch_error(request: Request, exc: Exception) -> Response:
    status = 404 if isinstance(exc, NotFound) else 400 if isinstance(exc, UsageError) else 409
    return JSON({"error": str(exc)}, status)


def make_app(ws: Workspace, guard: Guard) -> ASGIApp:
    d = Dashboard(ws, guard)
    page = ("/", "/runs/{run_id:int}", "/sweeps", "/sweeps/{sweep_id:int}", "/hosts", "/compare")
    api: list[tuple[str, Callable[[Request], Response]]] = [
        ("/api/meta", d.meta), ("/api/runs", d.runs), ("/api/facets", d.facets),
        ("/api/runs/{run_id:int}", d.run), ("/api/runs/{run_id:int}/log", d.log),
        ("/api/runs/{run_id:int}/metrics", d.metrics), ("/api/sweeps", d.sweeps),
        ("/api/sweeps/{sweep_id:int}", d.sweep), ("/api/hosts", d.hosts), ("/api/hosts/gpus", d.gpus),
        ("/api/hosts/check", d.check), ("/api/compare", d.compare),
    ]
    routes = [Route(p, d.shell) for p in page] + [Route(p, fn) for p, fn in api] + [
        Route("/api/runs/{run_id:int}/{action:str}", d.act, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC)),
    ]
    app = Starlette(routes=routes, exception_handlers={OrchError: _orch_error})
    app.state.dashboard = d
    return Shield(app, guard)


def listen(bind: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is a plain error (and port 0 a free one)."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    return sock


def url(bind: str, port: int, guard: Guard) -> str:
    host = f"[{bind.strip('[]')}]" if ":" in bind else bind
    # the token rides in the fragment: the browser keeps it, no server log or Referer ever sees it
    return f"http://{host}:{port}/#token={guard.token}"


def serve(ws: Workspace, port: int = 8765, bind: str = "127.0.0.1", allow_actions: bool = False,
          token: str | None = None, echo: Callable[[str], None] = print) -> None:
    """`orch ui`: serve the dashboard until interrupted."""
    import os

    import uvicorn

    Guard.make(bind, port, allow_actions, token)  # refuses before anything listens
    # What this process writes (the database, were it new; a stopped run's log tail and outputs) is its
    # owner's alone, as the pages are.
    os.umask(0o077)
    sock = listen(bind, port)
    port = sock.getsockname()[1]  # port 0: the free one the system chose, which the Host check needs
    guard = Guard.make(bind, port, allow_actions, token)
    app = make_app(ws, guard)
    echo(f"orch ui: {url(bind, port, guard)}")
    if allow_actions:
        echo(f"actions (cancel, stop) are on; token: {guard.token}")
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])
