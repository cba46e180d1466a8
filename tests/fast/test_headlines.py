"""The numbers a person reads first, in process: each playbook's headlines lead in `orch status` (its JSON, the
table, the end-of-run summary), the sweep tables and the dashboard; the status table fits the terminal without
breaking a word, takes --columns, and calls a run ended on purpose `stopped` wherever it is shown or filtered."""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from starlette.datastructures import QueryParams

from orchestrator import sweep
from orchestrator.cli import render, status
from orchestrator.config import metricinfo
from orchestrator.config.hosts import Host
from orchestrator.config.workspace import Workspace
from orchestrator.errors import UsageError
from orchestrator.host.launch import RunPaths
from orchestrator.playbook import Entry, RunContext, Usage
from orchestrator.runflow import registry
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import RunRecord, Status
from orchestrator.sweep import db as sweep_db
from orchestrator.sweep.record import PointStatus
from orchestrator.ui import pages, report
from orchestrator.ui import table as runs_table
from playbooks.command import Command
from playbooks.extract_hidden_states import ExtractHiddenStates, ExtractSpec

Orch = Callable[..., tuple[int, str, str]]
HOSTS = ""
# what a benchmark's result block gives, in the order the block prints it
BENCH = [("completed", 200.0), ("failed", 0.0), ("max_concurrency", 8.0), ("duration_s", 21.3),
         ("total_input_tokens", 204800.0), ("request_throughput", 9.4), ("output_throughput", 94.2),
         ("mean_ttft_ms", 40.1), ("median_ttft_ms", 38.5), ("p99_ttft_ms", 120.7), ("median_itl_ms", 10.2),
         ("p99_itl_ms", 31.0), ("accept_len", 3.4)]
HEADLINES = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "accept_len"]


@pytest.fixture
def orch(records_orch: Orch) -> Orch:
    return records_orch


@pytest.fixture
def store(records_store: Store) -> Store:
    return records_store


def ended(store: Store, playbook: str, end: Status, reason: str = "", metrics: list[tuple[str, float]] = (),
          **fields: Any) -> int:
    run_id = store.create_run(playbook, "local", {})
    for s in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, s)
    store.update_run(run_id, started_at=time.time() - 65, **fields)
    store.add_metrics(run_id, [(n, v, None) for n, v in metrics], time.time())
    transition(store, run_id, end, reason, ended_at=time.time())
    return run_id


def test_a_benchmarks_headlines_lead_its_metrics_everywhere(orch: Orch, store: Store) -> None:
    run_id = ended(store, "bench-serving", Status.SUCCEEDED, metrics=BENCH)
    doc = json.loads(orch("status", str(run_id), "--json")[1])
    assert list(doc["metrics"])[:6] == HEADLINES and list(doc["metric_summaries"])[:6] == HEADLINES
    assert doc["headlines"][:6] == HEADLINES
    assert list(doc["metrics"])[6:] == sorted(list(doc["metrics"])[6:])  # then the rest by name
    header, row = [line.split("\t") for line in orch("status")[1].splitlines()]
    assert dict(zip(header, row))["metrics"] == "output_throughput=94.2 median_ttft_ms=38.5 p99_ttft_ms=120.7"
    shown = orch("status", str(run_id))[1]
    assert shown.index("output_throughput =") < shown.index("completed =")
    summary = "\n".join(render.summary_lines({**doc, "outputs": {"remote_dir": None, "manifest": None},
                                              "next": []}))
    assert "metrics: output_throughput=94.2 median_ttft_ms=38.5 p99_ttft_ms=120.7 median_itl_ms=10.2 " \
           "p99_itl_ms=31 accept_len=3.4" in summary  # every headline, before any count
    page = runs_table.page(store, runs_table.RunFilters())
    assert list(page["runs"][0]["metrics"]) == HEADLINES[:3]


def test_a_training_run_leads_with_its_loss_an_extraction_with_its_pace(orch: Orch, store: Store) -> None:
    train = ended(store, "train-draft", Status.SUCCEEDED,
                  metrics=[("checkpoints", 3), ("epoch", 2), ("lr", 3e-5), ("train/full_acc_0", 0.5),
                           ("train/loss", 1.25)])
    extract = ended(store, "extract-hidden-states", Status.SUCCEEDED,
                    metrics=[("samples", 32), ("samples_per_s", 8.5), ("tokens", 1600), ("tokens_per_s", 400)])
    docs = {d["id"]: d for d in json.loads(orch("status", "--json")[1])}
    assert next(iter(docs[train]["metrics"])) == "train/loss"
    assert next(iter(docs[extract]["metrics"])) == "samples_per_s"


def screen_of(monkeypatch: pytest.MonkeyPatch, width: int) -> io.StringIO:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, color_system=None, width=width, highlight=False)
    monkeypatch.setattr(render, "out", console)
    monkeypatch.setattr(status, "out", console)
    return screen


@pytest.mark.parametrize("width", [80, 100, 132])
def test_the_table_fits_the_terminal_and_never_breaks_a_word(orch: Orch, store: Store,
                                                            monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    ended(store, "bench-serving", Status.SUCCEEDED, metrics=BENCH, name="eagle3-topk4-steps5-baseline")
    ended(store, "extract-hidden-states", Status.FAILED, reason="exit code 1: " + "a long reason " * 10)
    ended(store, "serve-eagle3", Status.CANCELLED, reason="stopped by user")
    ended(store, "command", Status.CANCELLED, reason="cancelled by user")
    loading = store.create_run("serve-vllm", "local", {})
    for s in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, loading, s)
    store.update_run(loading, phase="loading", progress={"label": "Loading safetensors checkpoint shards",
                                                          "done": 32.0, "total": 64.0})
    screen = screen_of(monkeypatch, width)
    assert orch("status")[0] == 0
    lines = screen.getvalue().splitlines()
    assert lines and all(len(line) <= width for line in lines)
    assert len(lines) == 6  # a header and one line per run: nothing wrapped
    assert "32/64" in lines[1]  # a bar shortened keeps its counts
    words = " ".join(lines).split()
    for word in ("succeeded", "failed", "stopped", "cancelled", "bench-serving", "output_throughput=94.2"):
        assert word in words
    assert not any(w in words for w in ("succeed", "ed", "bench-servi", "ng"))
    for shortened in (w for w in words if w.endswith("…")):  # a value cut after a word or separator
        assert re.fullmatch(r"[^…]*[,;=/_-]?…", shortened)


def test_columns_are_chosen_and_a_bad_choice_is_refused(orch: Orch, store: Store,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = ended(store, "bench-serving", Status.SUCCEEDED, metrics=BENCH)
    piped = orch("status", "--columns", "id,status,metrics")[1].splitlines()
    assert piped[0].split("\t") == ["id", "status", "metrics"]
    assert piped[1].split("\t")[:2] == [str(run_id), "succeeded"]
    code, out, err = orch("status", "--columns", "id,colour")
    assert code == 2 and out == "" and "unknown column 'colour'" in err and len(err.strip().splitlines()) == 1
    screen = screen_of(monkeypatch, 80)
    orch("status", "--columns", "metrics,id")
    assert screen.getvalue().splitlines()[0].split() == ["metrics", "id"]


def test_stopped_is_one_word_everywhere(orch: Orch, store: Store) -> None:
    stopped = ended(store, "serve-vllm", Status.CANCELLED, reason="stopped by user")
    replaced = ended(store, "serve-vllm", Status.CANCELLED, reason="replaced by run 9")
    cancelled = ended(store, "command", Status.CANCELLED, reason="cancelled by user")
    done = ended(store, "command", Status.SUCCEEDED)

    def ids(*args: str) -> list[int]:
        code, out, _ = orch("status", *args, "--json")
        assert code == 0
        return sorted(d["id"] for d in json.loads(out))

    assert ids("--status", "stopped") == [stopped, replaced]
    assert ids("--status", "cancelled") == [cancelled]
    assert ids("--status", "stopped", "--status", "succeeded") == [stopped, replaced, done]
    code, _, err = orch("status", "--status", "halted")
    assert code == 2 and "'halted' is not one of" in err
    # the dashboard: the same words in its table, its filter and its choices
    page = runs_table.page(store, runs_table.Filters.parse(QueryParams("status=stopped")))
    assert [(r["id"], r["shown_status"]) for r in page["runs"]] == [(replaced, "stopped"), (stopped, "stopped")]
    rows = {r["id"]: r["shown_status"] for r in runs_table.page(store, runs_table.RunFilters())["runs"]}
    assert rows[cancelled] == "cancelled" and rows[done] == "succeeded"
    assert "stopped" in runs_table.facets(store)["statuses"]


def a_bench_sweep(root: Path) -> tuple[Store, int]:
    """A sweep of bench-serving over max_concurrency: three succeeded points, each with its result block."""
    ws = Workspace(root=root, hosts_file=root / "hosts.toml")
    store = Store(ws.db_path)
    (root / "b.toml").write_text('name = "conc"\nplaybook = "bench-serving"\nhosts = ["local"]\n'
                                 '[spec]\nurl = "http://127.0.0.1:30000"\n[matrix]\nmax_concurrency = [1, 8, 16]\n')
    sweep_id = sweep_db.register(store, sweep.plan(ws, store, root / "b.toml"))
    for pt, (conc, tput, ttft) in zip(sweep_db.points(store, sweep_id), [(1, 30.0, 20.0), (8, 94.2, 38.5),
                                                                         (16, 90.1, 80.0)]):
        run_id = store.create_run("bench-serving", "local", {"url": "http://127.0.0.1:30000", "max_concurrency": conc})
        store.update_run(run_id, sweep_id=sweep_id, point=pt.key)
        for to in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING, Status.SUCCEEDED):
            transition(store, run_id, to)
        store.add_metrics(run_id, [("completed", 200 - conc, None), ("max_concurrency", conc, None),
                                   ("output_throughput", tput, None), ("median_ttft_ms", ttft, None)], ts=1.0)
        assert sweep_db.start_point(store, sweep_id, pt.index)
        sweep_db.settle_point(store, sweep_id, pt.index, PointStatus.SUCCEEDED, run_id=run_id)
    return store, sweep_id


def test_sweeps_lead_with_headlines_and_never_judge_a_count(orch: Orch, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store, sweep_id = a_bench_sweep(tmp_path)
    lines = orch("sweep", "status", str(sweep_id))[1].splitlines()
    header = lines[1].split("\t")
    first = dict(zip(header, lines[2].split("\t")))
    assert first["metrics"].startswith("output_throughput=30 median_ttft_ms=20 ")
    page = pages.sweep_page(store, sweep_id)
    assert page["metrics"][:2] == ["output_throughput", "median_ttft_ms"] and page["objective"] == "output_throughput"
    assert page["direction"]["completed"] is None and page["direction"]["max_concurrency"] is None
    assert page["best"]["completed"] is None and page["best"]["max_concurrency"] is None  # no star on a count
    assert page["best"]["output_throughput"] == 1 and page["best"]["median_ttft_ms"] == 0
    # the report draws what can be judged, headlines first; a count is no objective
    titles: list[str] = []
    monkeypatch.setattr(report, "_bar_charts", lambda points, names, *a: titles.extend(names) or "metrics.png")
    report.sweep_report(store, sweep_id, tmp_path / "report")
    assert titles == ["output_throughput", "median_ttft_ms"]
    with pytest.raises(UsageError, match="a count or a setting"):
        report.sweep_report(store, sweep_id, tmp_path / "report", metric="completed")


class Files:
    """A host's files as an extraction leaves them, for `finish` to read (nothing else is asked)."""

    def __init__(self, files: dict[str, str]):
        self.files = files

    def read_text(self, path: str, limit: int = 1 << 20) -> str | None:
        return self.files.get(path)

    def list_dir(self, path: str) -> list[Entry] | None:
        return [Entry(f"hs_{i}.safetensors", "file", 10) for i in range(6)]

    def usage(self, path: str) -> Usage | None:
        return Usage(6, 60, 1)


@pytest.mark.parametrize("backend", ["hf", "speculators"])
def test_an_extraction_records_its_pace_in_samples_per_s(backend: str) -> None:
    pb = ExtractHiddenStates()
    spec = ExtractSpec.model_validate({"backend": backend, "model": "/m", "dataset": "/d"} if backend == "speculators" else {})
    manifest = {"samples": 32, "tokens": 1600, "tokens_per_s": 400.0, "seconds": 4.0}
    files = Files({"/w/runs/1/hidden_states/manifest.json": json.dumps(manifest)})
    job = RunContext(1, spec, Host(name="local"), RunPaths("/w/runs/1"), files, lambda i: None,  # type: ignore[arg-type]
                     lambda kind, message: None)
    run = RunRecord(id=1, playbook="extract-hidden-states", host="local", status=Status.SUCCEEDED, spec={},
              created_at=0.0, started_at=100.0, ended_at=103.0)
    metrics = dict(pb.finish(job, run).metrics)
    assert metrics["samples_per_s"] == (8.0 if backend == "hf" else 2.0)  # 32 in 4 s; 6 files in the job's 3 s


def test_a_plugin_playbooks_headlines_lead_once_it_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    class Scored(Command):
        name = "scored"
        headlines = ("score", "wall_s")

    monkeypatch.setitem(registry.BUILTIN_PLAYBOOKS, "scored", "x:y")  # as an installed plugin is found
    monkeypatch.setattr(registry, "_load", lambda target: Scored)
    registry.playbook("scored")
    assert metricinfo.order(["a", "wall_s", "score"], "scored") == ["score", "wall_s", "a"]


def test_compare_lists_the_headlines_first(orch: Orch, store: Store) -> None:
    a = ended(store, "bench-serving", Status.SUCCEEDED, metrics=BENCH)
    b = ended(store, "bench-serving", Status.SUCCEEDED, metrics=BENCH)
    doc = json.loads(orch("compare", str(a), str(b), "--json")[1])
    assert list(doc["metrics"])[:6] == HEADLINES
