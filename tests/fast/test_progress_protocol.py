"""`orch-progress DONE/TOTAL [LABEL]`: any job's own progress bar, read by the parser."""

from __future__ import annotations

import pytest

from orchestrator.logparse import LogParser
from orchestrator.logparse.protocol import protocol_progress


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
