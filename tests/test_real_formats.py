"""The project's own transcripts in the engines' real formats (tests/logs), each read as an expert reads its
end: engine, phase, failed, error kind and class, metrics and progress (tests/logs/labels.json).

Most mirror a public thread where users pasted such output (`mirrors` names the entry of the reference
catalogue); `also` lists readings that are equally right where a transcript is ambiguous.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from orchtest import Orch

from orchestrator.logparse import LogParser, inspect_file
from orchestrator.logparse.hints import SIGNATURES

LOGS = Path(__file__).parent / "logs"
LABELS: list[dict[str, Any]] = json.loads((LOGS / "labels.json").read_text())


def reading(got: dict[str, Any]) -> dict[str, Any]:
    """inspect-log's summary in the label's terms."""
    err = got["error"]
    progress = got["progress"]
    return {
        "engine": got["engine"],
        "phase": got["phase"],
        "failed": got["phase"] == "failed",
        "error_kind": err["kind"] if err else "none",
        "exception": err["exception"] if err else None,
        "metrics": got["metrics"],
        "progress": {"done": progress["done"], "total": progress["total"]} if progress else None,
    }


def mismatches(label: dict[str, Any], got: dict[str, Any]) -> list[str]:
    read = reading(got)
    wrong = []
    for key in ("engine", "phase", "failed", "error_kind", "exception", "progress"):
        allowed = [label[key], *label["also"].get(key, [])]
        if read[key] not in allowed:
            wrong.append(f"{key}: {read[key]!r}, expected {label[key]!r}")
    for name, value in label["metrics"].items():
        if read["metrics"].get(name) != pytest.approx(value):
            wrong.append(f"metric {name}: {read['metrics'].get(name)!r}, expected {value!r}")
    if label.get("hint"):  # the diagnosis signature the failure fits
        advice = next(s.hint for s in SIGNATURES if s.name == label["hint"])
        hint = (got["error"] or {}).get("hint") or ""
        if not hint.startswith(advice):
            wrong.append(f"hint: {hint!r}, expected the {label['hint']!r} advice")
    return wrong


@pytest.mark.parametrize("label", LABELS, ids=[x["file"] for x in LABELS])
def test_transcript_reads_as_labelled(label: dict[str, Any]) -> None:
    got = inspect_file(LOGS / label["file"], chunk_size=251)
    assert mismatches(label, got) == []


@pytest.mark.parametrize("label", LABELS, ids=[x["file"] for x in LABELS])
def test_transcript_read_in_any_chunks_and_resumed(label: dict[str, Any]) -> None:
    data = (LOGS / label["file"]).read_bytes()
    whole = LogParser()
    whole.feed(data)
    whole.finish()
    for size in (1, 13, 4096):
        p = LogParser()
        for i in range(0, len(data), size):
            if i == len(data) // 2:  # what a watcher stores between polls, read back
                p = LogParser.from_dict(json.loads(json.dumps(p.to_dict())))
            p.feed(data[i:i + size])
        p.finish()
        # as JSON: a NaN the log printed (kept, as it is) equals nothing, not even itself
        assert json.dumps(p.to_dict(), sort_keys=True) == json.dumps(whole.to_dict(), sort_keys=True), size


def test_error_line_points_at_the_exception() -> None:
    p = LogParser()
    p.feed((LOGS / "vllm_0_6_worker_nccl.log").read_bytes())
    assert p.error is not None
    # the exception line, not the source line `raise RuntimeError(f"NCCL error: ...")` quoted before it
    assert p.error.message.startswith("NCCL error: unhandled cuda error")
    assert p.error.context[-1].endswith("RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO "
                                        "for details)")


def test_chained_traceback_keeps_root_cause_and_final_error() -> None:
    got = inspect_file(LOGS / "chained_traceback.log")
    err = got["error"]
    assert err["exception"] == "FileNotFoundError" and "model-00007-of-00030" in err["message"]
    assert err["fatal"]  # the final traceback reached the module level uncaught
    p = LogParser()
    p.feed((LOGS / "chained_traceback.log").read_bytes())
    assert p.error is not None and p.error.chain == ["RuntimeError: cannot load shard 7"]


def test_rich_lines_are_unwrapped() -> None:
    p = LogParser()
    p.feed((LOGS / "speculators_rich_abort.log").read_bytes())
    p.finish()
    assert p.error is not None and p.error.fatal
    assert p.error.message == "Aborting: 32 consecutive samples errored out. The vLLM server may be unreachable."
    # 22 physical lines in the file, each counted once
    assert p.lines == len((LOGS / "speculators_rich_abort.log").read_text().splitlines())


def test_killed_without_evidence_is_not_called_the_oom_killer() -> None:
    got = inspect_file(LOGS / "killed_after_attribute_error.log")
    assert got["error"]["kind"] == "python_exception" and got["phase"] == "failed"
    got = inspect_file(LOGS / "transformers_killed_oom_dmesg.log")
    assert got["error"]["kind"] == "killed" and "oom-kill:" in got["error"]["message"]  # the kernel says who


def test_inspect_log_cli_on_a_fatal_rank_error(tmp_path: Path) -> None:
    res = Orch(tmp_path / "ws")("inspect-log", str(LOGS / "rank_prefixed_dist_backend_error.log"), "--json", check=0)
    got = json.loads(res.stdout)
    assert got["phase"] == "failed" and got["error"]["kind"] == "nccl"
    assert got["error"]["exception"] == "torch.distributed.DistBackendError"


def test_accuracy_over_all_transcripts() -> None:
    """Every transcript is read right; the failures, if any, are listed in one message."""
    wrong = {x["file"]: m for x in LABELS if (m := mismatches(x, inspect_file(LOGS / x["file"])))}
    assert wrong == {}, f"{len(LABELS) - len(wrong)}/{len(LABELS)} right"
