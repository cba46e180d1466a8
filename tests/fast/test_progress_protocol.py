"""`orch-progress DONE/TOTAL [LABEL]`: any job's own progress bar, read by the parser, with a rate and an ETA
from when it moved (the watcher's clock), as any bar has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from recording import FakeExecutor, new_run

from orchestrator.cli import render
from orchestrator.host.launch import JobState
from orchestrator.logparse import LogParser
from orchestrator.logparse.protocol import protocol_progress
from orchestrator.logparse.tqdm import paced
from orchestrator.runflow.recorder import Recorder, WatchOptions
from orchestrator.store import Store


@pytest.mark.parametrize("line, expected", [
    ("orch-progress 3/10 shards", ("shards", 3.0, 10.0)),
    ("2026-12-02 10:00:00 INFO train: orch-progress 120/5000 optimizer steps", ("optimizer steps", 120.0, 5000.0)),
    ("orch-progress 7", ("progress", 7.0, None)),
    ("orch-progress 2.5/4", ("progress", 2.5, 4.0)),
    ("orch-progress 5/0 nothing to do", None),  # no total of zero: no percent of it
    ("orch-progress three/ten", None),
    ("echo orch-progressive 3/4", None),
    ("orch-metric loss=0.3", None),
])
def test_the_line_protocol(line: str, expected: tuple[str, float, float | None] | None) -> None:
    assert protocol_progress(line) == expected


def test_a_jobs_own_progress_is_the_runs_bar_and_its_phase_running() -> None:
    parser = LogParser()
    parser.feed(b"setting up\n")
    assert parser.phase == "starting" and parser.progress is None
    parser.feed(b"orch-progress 3/12 files\n")
    bar = parser.progress
    assert parser.phase == "running" and bar is not None
    assert (bar.label, bar.done, bar.total, bar.percent) == ("files", 3.0, 12.0, 25.0)
    parser.feed(b"orch-progress 12/12 files\n")
    assert parser.progress is not None and parser.progress.percent == 100.0
    again = LogParser.from_dict(parser.to_dict())  # resumable like any bar
    assert again.progress == parser.progress


def test_a_huge_label_is_bounded() -> None:
    found = protocol_progress("orch-progress 1/2 " + "x" * 10_000)
    assert found is None or len(found[0]) <= 200


@pytest.mark.parametrize("prefix", ["step 3 ", "epoch 1 step 3 ", "[rank0]: step 3 | "])
def test_a_metric_line_after_a_trainers_words_gives_each_sample_once(prefix: str) -> None:
    parser = LogParser()
    line = f"{prefix}orch-metric loss=1.5 lr=0.1\n".encode()
    found = [(m.name, m.value) for m in parser.feed(line * 2) + parser.finish()]
    assert found == [("loss", 1.5), ("lr", 0.1)] * 2


class Tick:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_jobs_own_bar_gets_a_rate_and_an_eta_from_when_it_moved(tmp_path: Path) -> None:
    store = Store(tmp_path / "orch.db")
    run_id = new_run(store, tmp_path)
    clock = Tick()
    w = Recorder(store, run_id, FakeExecutor(), WatchOptions(poll_min=30, poll_max=600), clock=clock)  # type: ignore[arg-type]

    def push(data: bytes, after_s: float) -> dict[str, Any]:
        clock.now += after_s
        w.stage(JobState(alive=True, exit_code=None, size=w.offset + len(data), offset=w.offset, data=data,
                         started_at=999_000.0, ended_at=None))
        w.commit()
        w.settle()
        bar = store.get_run(run_id).progress
        assert bar is not None
        return bar

    first = push(b"orch-progress 10/100 steps\n", 1)
    assert first["rate_per_s"] is None and first["eta_s"] is None  # one sighting: no rate yet
    second = push(b"orch-progress 30/100 steps\n", 10)  # 20 steps in 10 s
    assert second["rate_per_s"] == pytest.approx(2.0) and second["eta_s"] == pytest.approx(35.0)
    still = push(b"", 5)  # nothing new: the rate and ETA as they were when it last moved
    assert (still["rate_per_s"], still["eta_s"]) == (second["rate_per_s"], second["eta_s"])
    third = push(b"orch-progress 70/100 steps\n", 5)  # 40 in 10 s since it last moved: smoothed towards 4/s
    assert 2.0 < third["rate_per_s"] < 4.0 and third["eta_s"] == pytest.approx(30 / third["rate_per_s"], rel=1e-3)
    assert w.wait.finish_at == pytest.approx(clock.now + third["eta_s"])  # the wait never sleeps past it
    line = render.progress_line(third, "running")
    assert "/s" in line and "eta" in line
    other = push(b"orch-progress 1/5 evals\n", 1)  # another bar: its own rate, once it moves
    assert other["rate_per_s"] is None


def test_a_bar_that_prints_its_rate_keeps_it() -> None:
    bar = {"label": "x", "done": 5.0, "total": 10.0, "rate_per_s": 9.0, "eta_s": 1.0}
    assert paced(bar, {**bar, "done": 1.0, "rate_per_s": 1.0}, 0.0, 10.0) == bar
