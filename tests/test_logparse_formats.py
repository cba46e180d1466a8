"""The engines' line tables and the diagnosis signatures, against the transcripts under tests/logs: every
table entry is exercised by some transcript, every signature is the diagnosis of some transcript, and the
generic readers read the shapes no table knows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.logparse import KINDS, LogParser, errors, sglang, slurm, speculators, vllm
from orchestrator.logparse.bench import NAMES, name_of
from orchestrator.logparse.hints import FALLBACK, SIGNATURES
from orchestrator.logparse.text import clean
from orchestrator.logparse.trainers import dict_metrics, postfix_metrics, step_metrics

LOGS = Path(__file__).parent / "logs"
LABELS = json.loads((LOGS / "labels.json").read_text())


def _lines() -> list[str]:
    """Every logical line of every transcript, as the parser sees it (prefixes peeled)."""
    found = []
    for path in sorted(LOGS.glob("*.log")):
        for raw in path.read_text(errors="replace").replace("\r\n", "\n").replace("\r", "\n").split("\n"):
            found.append(clean(raw).text)
    return found


LINES = _lines()
TABLES = {"sglang": sglang.FORMATS, "vllm": vllm.FORMATS}
RULES = {"common": errors.COMMON_RULES, "sglang": sglang.RULES, "vllm": vllm.RULES, "speculators": speculators.RULES,
         "slurm": slurm.RULES}


@pytest.mark.parametrize("engine, index", [(e, i) for e, t in TABLES.items() for i in range(len(t))])
def test_every_table_line_has_a_transcript(engine: str, index: int) -> None:
    entry = TABLES[engine][index]
    assert entry.versions and entry.source, "each line says which versions print it and where"
    hits = [t for t in LINES if entry.needle in t and entry.pattern.search(t)]
    assert hits, f"no transcript under tests/logs has a line for {entry.pattern.pattern!r} ({entry.versions})"


@pytest.mark.parametrize("table, index", [(n, i) for n, r in RULES.items() for i in range(len(r))])
def test_every_error_rule_has_a_transcript(table: str, index: int) -> None:
    r = RULES[table][index]
    assert any(r.pattern.search(t) for t in LINES), f"no transcript has a line for {r.pattern.pattern!r}"


def test_screens_let_every_match_through() -> None:
    """The cheap first tests in front of the big alternations never hide a line the patterns match."""
    from orchestrator.logparse import errorfinder, parser, trainers

    screens = [(r.pattern, errorfinder._ANY_RULE) for rules in RULES.values() for r in rules]
    screens += [(r.pattern, errorfinder._ANY_LEVEL) for rules in RULES.values() for r in rules if r.any_level]
    screens += [(sglang.DETECT.pattern, sglang.DETECT), (trainers.DONE, parser._DONE)]
    for pattern, screen in screens:
        for text in LINES:
            if pattern.search(text):
                assert screen.search(text), (pattern.pattern, text)


def test_every_benchmark_label_has_a_transcript() -> None:
    rows = {t.split(":")[0].strip() for t in LINES if ":" in t}
    missing = [label for label in NAMES if label not in rows]
    assert len(missing) <= len(NAMES) // 2, missing  # both engines' spellings: no transcript prints them all
    assert name_of("P99 E2E Latency (ms)") == "p99_e2e_latency_ms" and name_of("Cache hit rate") == "cache_hit_rate"


def test_every_signature_diagnoses_a_transcript() -> None:
    named = {x["hint"] for x in LABELS if x.get("hint")}
    untested = [s.name for s in SIGNATURES if s.name not in named and "." != s.pattern.pattern]
    # signatures matching on phase alone are exercised through their own transcripts too
    untested = [n for n in untested if n not in ("nccl_other",)]
    assert untested == []
    assert len(SIGNATURES) >= 25 and len({s.name for s in SIGNATURES}) == len(SIGNATURES)


def test_every_kind_has_a_hint() -> None:
    assert set(FALLBACK) == set(KINDS)
    p = LogParser()
    p.feed(b"NCCL communicator was aborted on rank 3.\n")
    assert p.error is not None and p.error.kind == "nccl" and p.error.hint is not None
    assert p.error.hint.startswith("an NCCL error: rerun with NCCL_DEBUG=INFO to see")
    assert "(source: " in p.error.hint


def test_hint_survives_the_stored_state() -> None:
    p = LogParser()
    p.feed((LOGS / "sglang_port_in_use.log").read_bytes())
    q = LogParser.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q.error is not None and q.error.hint == p.error.hint and "--port" in (q.error.hint or "")


def test_an_error_recorded_without_a_hint_is_diagnosed_when_shown() -> None:
    from orchestrator.store.shapes import error_hint

    p = LogParser()
    p.feed((LOGS / "sglang_port_in_use.log").read_bytes())
    assert p.error is not None and p.error.hint
    stored = p.error.to_dict()
    assert error_hint(stored) == p.error.hint
    older = {k: v for k, v in stored.items() if k != "hint"}  # as an older orch recorded it
    assert error_hint(older) == p.error.hint
    assert error_hint({"kind": "other", "message": "x"}) == "{} (source: {})".format(*FALLBACK["other"])
    assert error_hint(None) is None and error_hint({}) is None


@pytest.mark.parametrize("line, expected", [
    ("{'loss': 2.5, 'grad_norm': 1.0, 'learning_rate': 3e-05, 'epoch': 0.5}",
     {"loss": 2.5, "grad_norm": 1.0, "learning_rate": 3e-05, "epoch": 0.5, "lr": 3e-05}),
    ('{"loss": "1.25", "epoch": "2"}', {"loss": 1.25, "epoch": 2.0}),
    ("{'model': 'llama', 'tp': 8}", {}),  # a config dict, no trainer's
])
def test_dict_lines(line: str, expected: dict[str, float]) -> None:
    assert dict(dict_metrics(line)) == expected


def test_the_run_summary_is_no_step_loss() -> None:
    got = dict(dict_metrics("{'train_runtime': 10.0, 'train_loss': 1.5, 'epoch': 3.0}"))
    assert got == {"train_runtime": 10.0, "train_loss": 1.5, "epoch": 3.0}


@pytest.mark.parametrize("line, expected", [
    ("step 7 | loss 2.0 | lr 1e-3", {"step": 7, "loss": 2.0, "lr": 1e-3}),
    ("Epoch 1, Step 50, Loss: 4.5, LR: 2e-04", {"epoch": 1, "step": 50, "loss": 4.5, "lr": 2e-4}),
    ("iter 3/10 | total_loss=0.5 | tokens/s: 900", {"iter": 3, "step": 3, "total_loss": 0.5, "loss": 0.5}),
    ("Decode batch, #running-req: 1, #token: 90, token usage: 0.00", {}),  # a server's line, no step
    ("step=7 loss=2.5 lr=1e-4", {"step": 7, "loss": 2.5, "lr": 1e-4}),
    ("step 7 is done", {}),  # one number is no step line
])
def test_step_lines(line: str, expected: dict[str, float]) -> None:
    assert {k: v for k, v in step_metrics(line) if k in expected or not expected} == expected


def test_bar_postfix() -> None:
    assert dict(postfix_metrics(", v_num=3, train_loss=2.61")) == {"v_num": 3, "train_loss": 2.61, "loss": 2.61}
    assert postfix_metrics(", 3.2 tok/s") == []


def test_postfix_metrics_of_bars_redrawn_in_place_at_any_chunking() -> None:
    data = (LOGS / "lightning_postfix_metrics.log").read_bytes()
    whole = LogParser()
    whole.feed(data)
    whole.finish()
    for size in (1, 7, 4096):
        p = LogParser()
        for i in range(0, len(data), size):
            p.feed(data[i:i + size])
        p.finish()
        assert p.metrics == whole.metrics and p.metrics["train_loss"] == 2.612


def test_postfix_samples_are_returned() -> None:
    p = LogParser()
    samples = p.feed((LOGS / "lightning_postfix_metrics.log").read_bytes()) + p.finish()
    assert [s.value for s in samples if s.name == "train_loss"][-1] == 2.612


def test_exit_code_zero_keeps_a_tentative_error_tentative() -> None:
    data = (LOGS / "generic_traceback_cut_at_end.log").read_bytes()
    for code, phase in [(None, "failed"), (1, "failed"), (0, "starting")]:
        p = LogParser()
        p.feed(data)
        p.finish(exit_code=code)
        assert p.phase == phase and p.error is not None and p.error.kind == "python_exception"


@pytest.mark.parametrize("last, phase", [
    ("job exited with code 0", "finished"), ("Exit status: 0", "finished"), ("training done, exit 0", "finished"),
    ("python returned exit code 2", "failed"), ("exit code 10", "failed"), ("exit code 0 of 3 retries left", "running"),
])
def test_exit_words(last: str, phase: str) -> None:
    p = LogParser()
    p.feed(f"step 1 | loss 2.0 | lr 1e-3\n{last}\n".encode())
    p.finish()
    assert p.phase == phase


@pytest.mark.parametrize("label", [
    "Capturing batches (bs=64 avail_mem=20.15 GB)",  # decode graphs, every version
    "Capturing num tokens (num_tokens=512 avail_mem=19.80 GB)",  # piecewise graphs, 0.5.5
    "Compiling num tokens (num_tokens=512)",  # piecewise graphs, 0.5.23
])
def test_sglang_capture_bars_alone_name_the_engine(label: str) -> None:
    p = LogParser()
    p.feed(f"{label}:  50%|█████     | 4/8 [00:02<00:02,  1.90it/s]\n".encode())
    p.finish()
    assert (p.engine, p.phase) == ("sglang", "capturing")


def test_slurm_time_limit_is_a_timeout_and_cancel_is_killed() -> None:
    for text, kind in [
        ("slurmstepd: error: *** JOB 7 ON n1 CANCELLED AT 2026-01-01T00:00:00 DUE TO TIME LIMIT ***\n", "timeout"),
        ("slurmstepd-n1: error: *** JOB 7 ON n1 CANCELLED AT 2026-01-01T00:00:00 DUE TO PREEMPTION ***\n", "killed"),
        ("slurmstepd: error: *** STEP 7.0 ON n1 CANCELLED AT 2026-01-01T00:00:00 ***\n", "killed"),
        ("srun: error: n1: tasks 0-3: Killed\n", "killed"),
    ]:
        p = LogParser()
        p.feed(text.encode())
        p.finish()
        assert (p.engine, p.phase, p.error and p.error.kind) == ("slurm", "failed", kind), text


def test_a_request_traceback_is_survived_only_while_requests_are_answered() -> None:
    data = (LOGS / "sglang_tool_parser_error_keeps_serving.log").read_text()
    cut = data[:data.index('[2026-02-10 16:00:41] INFO')]
    p = LogParser()
    p.feed(cut.encode())
    assert p.error is not None and not p.error.fatal  # tentative until something follows
    p.feed(data[len(cut):].encode())
    p.finish()
    assert p.error is None and p.phase != "failed"
