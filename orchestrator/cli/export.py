"""orch export: the workspace's runs where teams already look (MLflow), SQLite staying the truth."""

from __future__ import annotations

import typer

from .app import app, parse_run_id, read_store, workspace
from .render import emit_json, err, out

export_app = typer.Typer(help="Copy runs and their metrics to another tool: mlflow.", no_args_is_help=True)
app.add_typer(export_app, name="export")


@export_app.command("mlflow")
def export_mlflow(
    run_ids: list[str] = typer.Argument(None, metavar="ID", help="the runs (default: every run)"),
    tracking_uri: str | None = typer.Option(None, "--tracking-uri", metavar="URI",
                                            help="an MLflow tracking URI (default: the workspace's mlruns/)"),
    experiment: str = typer.Option("orch", "--experiment", metavar="NAME", help="the MLflow experiment"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Runs, their records and metrics to an MLflow tracking store: one MLflow run per run, each metric's
    samples as its steps; again, only what is new (needs the `mlflow` extra: mlflow-skinny)."""
    from ..ui import tracking

    ids = [parse_run_id(i) for i in run_ids or []]
    ws = workspace()
    store = read_store(ws)
    runs = tracking.runs_of(store, ids)  # an unknown id: exit 2 before anything is written
    uri = tracking_uri or tracking.default_uri(ws.root)

    def told(e: tracking.Exported) -> None:
        if not as_json:
            what = "exported" if e.created else ("updated" if e.samples or e.record else "unchanged")
            out.print(f"run {e.run}: {what} (MLflow run {e.mlflow_run}, {e.samples} new samples)", markup=False)

    done = tracking.export(store, runs, uri, experiment, told)
    if as_json:
        emit_json({"tracking_uri": uri, "experiment": experiment, "runs": [e.to_dict() for e in done]})
    else:
        err.print(f"{len(done)} runs in {uri} (experiment {experiment})", markup=False)
