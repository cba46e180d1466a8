"""The debug patch set's `[orch-eagle3-debug]` lines as a per-run table (the EAGLE-3 plugin's own): its own
logging code (taken from the diff) run with torch on the CPU, on a real sshd host, watched, stored and shown
by `orch status`."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from orchtest import FAST, Orch

from orchestrator.logparse import LogParser
from playbooks.eagle3_debug import Eagle3Debug, parse

TESTS = Path(__file__).parent
JOB = TESTS / "jobs" / "eagle3_debug_job.py"
DIFF = TESTS.parent / "playbooks" / "patches" / "sglang-eagle3-hidden-debug" / "02-logits_processor-concat.diff"
LINE = ("[2026-01-02 03:04:05 TP0] [orch-eagle3-debug] target.capture layer_input=30 call=3 part=1/1 "
        "shape=(7, 7168) dtype=torch.bfloat16 absmean=0.01234 sample=[0.1, -0.2]")


def test_lines_parse_into_records():
    assert parse(LINE) == {"stage": "target.capture", "layer": 30, "call": 3, "part": 1, "parts": 1,
                           "shape": "(7, 7168)", "dtype": "bfloat16", "absmean": 0.01234}
    none = parse("[orch-eagle3-debug] logits.aux_in call=0 part=3/3 None")
    assert none is not None and none["shape"] == "None" and none["absmean"] is None and none["part"] == 3
    assert parse(LINE.replace("absmean=0.01234", "absmean=nan"))["absmean"] != 0  # nan is kept: it is the finding
    assert parse("[orch-eagle3-debug] target.final_hidden call=0") is None  # cut mid-line
    assert parse("Decode batch, #running-req: 1") is None
    p = LogParser(engine="sglang", readers=Eagle3Debug.readers)
    p.feed((LINE + "\n").encode() * 2)
    assert [(table, r["call"], r["line"]) for table, r in p.take_rows()] == [("eagle3_debug", 3, 1), ("eagle3_debug", 3, 2)]
    assert p.take_rows() == []
    plain = LogParser(engine="sglang")  # the parser itself knows no plugin's lines
    plain.feed((LINE + "\n").encode())
    assert plain.take_rows() == []


def test_status_shows_the_debug_table(tmp_path, ssh_fleet):
    orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(test1={"workdir": str(tmp_path / "r1")}))
    cmd = " ".join(shlex.quote(a) for a in (sys.executable, str(JOB), str(DIFF)))
    res = orch("run", "command", "--host", "test1", "--set", f"cmd={cmd}", "--set", "engine=sglang", *FAST)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    table = doc["eagle3_debug"]
    assert [(r["stage"], r["layer"], r["part"]) for r in table] == [
        ("target.capture", 2, "1/1"), ("target.capture", 30, "1/1"), ("target.capture", 58, "1/1"),
        ("target.final_hidden", None, "1/1"), ("logits.aux_in", None, "1/3"), ("logits.aux_in", None, "2/3"),
        ("logits.aux_in", None, "3/3"), ("draft.input_hidden", None, "1/1")]
    by = {(r["stage"], r["layer"], r["part"]): r for r in table}
    assert by[("target.capture", 30, "1/1")]["dtype"] == "bfloat16" and by[("target.capture", 30, "1/1")]["calls"] == 2
    assert by[("logits.aux_in", None, "1/3")]["absmean"] == 1.0 and by[("logits.aux_in", None, "2/3")]["absmean"] == 0
    assert by[("logits.aux_in", None, "3/3")]["shape"] == "None"
    draft = by[("draft.input_hidden", None, "1/1")]
    assert (draft["shape"], draft["dtype"], draft["absmean"], draft["call"]) == ("(7, 48)", "float16", 0.5, 1)
    assert doc["metrics"]["accept_rate"] == 0.47  # the engine's lines are read as before
    text = orch("status", "1", check=0).stdout
    rows = [line.split() for line in text.splitlines()]
    assert ["stage", "layer", "part", "shape", "dtype", "mean", "|x|", "calls"] in rows
    assert ["draft.input_hidden", "1/1", "(7,", "48)", "float16", "0.5", "2"] in rows
    assert json.loads(orch("status", "--json", check=0).stdout)[0]["id"] == 1  # the list stays light
