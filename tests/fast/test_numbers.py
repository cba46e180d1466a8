"""Numbers one can trust, in process: a run's receipt and what differs between two, a metric's noise and the
verdict of a difference against it, repeats as steps, and the validity gate (an invalid run counts nowhere)."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from recording import new_run
from test_cli_loop import Orch, orch
from test_engine_readings import BENCH, push, watched
from test_objective_first import a_sweep

from orchestrator import sweep
from orchestrator.config.workspace import Workspace
from orchestrator.host.hostjobs import checks, gpus
from orchestrator.logparse import LogParser
from orchestrator.store import Store, noise, receipts
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.sweep import db as sweep_db
from orchestrator.sweep.record import PointStatus
from orchestrator.ui import pages, report

__all__ = ["orch"]  # the fixture


# --- noise and verdicts ----------------------------------------------------------------------------------
def test_the_medians_interval_is_the_order_statistics_with_their_exact_coverage() -> None:
    assert noise.median_ci([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, 1 - 2 / 32)  # five: the whole range
    low, high, coverage = noise.median_ci([float(i) for i in range(10)])
    assert (low, high) == (1.0, 8.0) and coverage == pytest.approx(1 - 2 * (1 + 10) / 1024)
    got = noise.noise([10.0, 11.0, 9.0, 10.5, 9.5])
    assert got["median"] == 10.0 and got["min"] == 9.0 and got["max"] == 11.0 and got["spread"] == pytest.approx(0.2)
    assert got["n"] == 5 and (got["ci_low"], got["ci_high"]) == (9.0, 11.0)


def coverage(n: int, j: int) -> float:
    """P(j < B <= n-1-j), B ~ Binomial(n, 1/2), summed term by term: the definition, not the walk."""
    return sum(math.comb(n, k) for k in range(j + 1, n - j)) / 2 ** n


@pytest.mark.parametrize("level", [0.5, 0.9, 0.95, 0.99])
def test_the_medians_interval_is_the_narrowest_with_the_coverage_asked(level: float) -> None:
    for n in range(1, 70):
        low, high, got = noise.median_ci([float(i) for i in range(n)], level)
        j = int(low)
        assert high == n - 1 - j
        if j == 0:  # the whole range: no narrower interval covers enough
            assert n < 4 or coverage(n, 1) < level
        else:
            assert got == pytest.approx(coverage(n, j)) and got >= level
            assert j == n // 2 - 1 or coverage(n, j + 1) < level, (n, j)


def test_a_run_of_thousands_of_samples_has_its_medians_interval() -> None:
    n = 4001  # a server's steady state: the interval is a few sqrt(n) around the middle
    low, high, got = noise.median_ci([float(i) for i in range(n)])
    j = int(low)
    assert high == n - 1 - j and 1900 < j < 2000
    assert got == pytest.approx(coverage(n, j)) and got >= 0.95 > coverage(n, j + 1)


@pytest.mark.parametrize("b, direction, verdict", [
    ([12.0, 12.5, 13.0, 12.2, 12.8], "higher", "better"),  # every repeat above every repeat of the first
    ([12.0, 12.5, 13.0, 12.2, 12.8], "lower", "worse"),  # the same numbers, a latency
    ([10.9, 12.0, 12.5, 12.2, 12.8], "higher", "within_noise"),  # one repeat inside the first run's range
    ([12.0, 12.5], "higher", "incomparable"),  # two samples: the spread is unknown
    ([12.0, 12.5, 13.0, 12.2, 12.8], None, "incomparable"),  # a count: no way is better
])
def test_a_difference_is_judged_against_the_spread_of_both(b: list[float], direction: Any, verdict: str) -> None:
    a = [10.0, 11.0, 9.0, 10.5, 9.5]
    assert noise.verdict(a, b, direction)[0] == verdict


# --- receipts ----------------------------------------------------------------------------------------------
RECEIPT: dict[str, Any] = {
    "orch": "0.1.0", "host": "local", "playbook": "bench-serving", "launched_at": 1.0,
    "engine": {"name": "vllm", "version": "0.32.0", "python": "/e/bin/python"},
    "patches": [], "argv": "python -m vllm bench serve", "dataset": {"name": "random", "num_prompts": 32, "seed": 0},
    "warmup": 1, "repeats": 5, "hardware": {"gpus": [{"index": "0", "name": "NVIDIA H100", "driver_version": "550"}]},
    "server": {"run": 1, "ready_at_launch": True, "receipt": {
        "spec": {"model": "/m", "num_speculative_tokens": 2}, "model": {"path": "/m", "files": {"config.json": "ab"}}}},
}


def changed(**edits: Any) -> dict[str, Any]:
    """The receipt with dotted keys set to new values."""
    r = json.loads(json.dumps(RECEIPT))
    for key, value in edits.items():
        *path, last = key.split("__")
        at = r
        for part in path:
            at = at[part]
        at[last] = value
    return r


def test_differences_name_what_changed_and_what_makes_numbers_incomparable() -> None:
    b = changed(server__receipt__spec__num_speculative_tokens=4, engine__version="0.33.0", launched_at=2.0,
                server__run=7, patches=[{"name": "slow", "set_hash": "h1", "files": {"a.py": "s1"}}])
    got = {d["key"]: d for d in receipts.differences(RECEIPT, b)}
    assert set(got) == {"server.receipt.spec.num_speculative_tokens", "engine.version", "patches.slow.set_hash",
                        "patches.slow.files.a.py", "patches.slow.name"}  # not when, nor which server run
    assert receipts.line(got["server.receipt.spec.num_speculative_tokens"]) == (
        "server.receipt.spec.num_speculative_tokens: 2 -> 4")
    assert all(d["matters"] is None for d in got.values())
    assert receipts.differences(RECEIPT, changed(launched_at=9.0, ended_at=10.0, status="failed")) == []
    matters = {d["key"]: d["matters"] for d in receipts.differences(RECEIPT, changed(
        server__receipt__model__files={"config.json": "cd"}, dataset__name="sharegpt",
        hardware__gpus=[{"index": "0", "name": "NVIDIA H200", "driver_version": "560"}]))}
    assert matters == {"server.receipt.model.files.config.json": "the model", "dataset.name": "the data set",
                       "hardware.gpus.0.name": "the GPUs", "hardware.gpus.0.driver_version": None}


def test_the_launch_request_looks_at_the_host_for_the_receipt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's look: the engine python's distribution versions, the model's config hashes, the CPU when
    there is no nvidia-smi."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here
    (tmp_path / "config.json").write_bytes(b'{"hidden_size": 64}')
    got = gpus.host_facts({"python": sys.executable, "packages": ["pydantic", "no-such-dist"],
                            "files": [str(tmp_path / "config.json"), str(tmp_path / "generation_config.json")]})
    from importlib.metadata import version

    assert got["engine"]["packages"] == {"pydantic": version("pydantic"), "no-such-dist": None}
    assert got["files"] == {str(tmp_path / "config.json"): hashlib.sha256(b'{"hidden_size": 64}').hexdigest(),
                            str(tmp_path / "generation_config.json"): None}
    assert "gpus" not in got and got["cpu"]["count"] >= 1
    bad = gpus.host_facts({"python": str(tmp_path / "nope")})
    assert "error" in bad["engine"]
    assert checks.checked("launch", {"dir": "/x", "script": "", "token": "t", "facts": {"python": "/p"}})["facts"]
    with pytest.raises(ValueError, match="bad facts"):
        checks.checked("launch", {"dir": "/x", "script": "", "token": "t", "facts": {"files": ["relative"]}})


def test_command_lines_are_masked_as_the_environment_is() -> None:
    """A secret flag's value (`--api-key K`, `--hf-token=K`), an assignment, a credential in a URL and a known
    secret's value are masked where they stand; counts, paths to secrets and other words are kept."""
    from orchestrator.secret_env import masked_argv, masked_command

    argv = ["vllm", "serve", "/m", "--api-key", "sk-1", "--hf-token=hf_2", "--max-num-batched-tokens", "512",
            "--ssl-keyfile", "/k.pem", "--db", "https://u:pw@h/x", "--name", "a-sk-1", "HF_TOKEN=hf_3"]
    assert masked_argv(argv) == ["vllm", "serve", "/m", "--api-key", "***", "--hf-token=***",
                                 "--max-num-batched-tokens", "512", "--ssl-keyfile", "/k.pem", "--db", "***",
                                 "--name", "a-sk-1", "HF_TOKEN=***"]
    script = "cd /r\nexport WANDB_API_KEY='a b'\nexec python -m x --url=postgres://me:pw@db/1 --seed 7 --tag 7x\n"
    assert masked_command(script, known=["7x"]) == "cd /r\nexport WANDB_API_KEY=***\nexec python -m x --url=*** --seed 7 --tag ***\n"
    # a secret seen once is masked where the line repeats it; a count after a token-ish flag is no secret
    assert masked_command("x --password 'it is' --again 'it is' it --speculative-num-draft-tokens 4 --tp 4") == (
        "x --password *** --again *** it --speculative-num-draft-tokens 4 --tp 4")
    assert masked_command("python -c 'unbalanced --token x") == "python -c 'unbalanced --token ***"


# --- repeats ---------------------------------------------------------------------------------------------------
def test_each_repeat_is_a_step_of_its_own() -> None:
    from playbooks.bench_serving import BenchServingSpec, repeated

    block = BENCH.replace(b"Failed requests:                         141", b"Failed requests:                         0")
    p = LogParser()
    found = p.feed(b"repeat 1/3\n" + block + b"repeat 2/3\n" + block + b"repeat 3/3\n" + block)
    steps = [m.repeat for m in found if m.name == "completed"]
    assert steps == [1, 2, 3] and p.requests == [3 * 59.0, 0.0]
    argv = ["/e/python", "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--seed", "0"]
    assert repeated(argv, 1, 0) == argv
    assert repeated(argv, 5, 2) == ["/e/python", "repeat_bench.py", "5", "2", *argv[1:]]
    with pytest.raises(ValueError):
        BenchServingSpec(url="http://127.0.0.1:8000", repeats=0)


# --- the validity gate ----------------------------------------------------------------------------------------
def test_failed_requests_above_the_bound_make_a_benchmark_invalid(tmp_path: Path) -> None:
    store, w, _, _ = watched(tmp_path, benchmark=True)
    assert push(w, BENCH, exit_code=0)
    run = store.get_run(w.run_id)
    assert run.status is Status.FAILED and run.invalid == "141 of 200 benchmark requests failed, above max_failed_fraction 0"


def test_a_benchmark_whose_every_request_failed_is_failed_and_invalid(tmp_path: Path) -> None:
    store, w, _, _ = watched(tmp_path, benchmark=True)
    none = BENCH.replace(b"Successful requests:                     59", b"Successful requests:                     0")
    assert push(w, none.replace(b"141", b"200"), exit_code=0)
    run = store.get_run(w.run_id)
    assert run.status is Status.FAILED and run.invalid == "200 of 200 benchmark requests failed, above max_failed_fraction 0"


def test_failed_requests_within_the_bound_stay_valid(tmp_path: Path) -> None:
    store, w, _, _ = watched(tmp_path, benchmark=True, max_failed_fraction=0.75)
    assert push(w, BENCH, exit_code=0)
    assert store.get_run(w.run_id).invalid is None


def test_a_benchmark_that_completed_nothing_is_invalid_but_any_other_job_is_not(tmp_path: Path) -> None:
    store, w, _, _ = watched(tmp_path, benchmark=True)
    assert push(w, b"nothing measured\n", exit_code=0)
    run = store.get_run(w.run_id)
    assert run.status is Status.SUCCEEDED and run.invalid == "no benchmark result: no request completed"
    store, w, _, _ = watched(tmp_path / "job")
    assert push(w, b"nothing measured\n", exit_code=0)
    assert store.get_run(w.run_id).invalid is None


def test_an_invalid_point_is_never_the_best_nor_an_objective(orch: Orch, tmp_path: Path) -> None:
    sweep_id = a_sweep(tmp_path)  # point 1 (run 2) has the best gen_throughput
    store = Store(Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml").db_path)
    store.mark_invalid(2, "141 of 200 benchmark requests failed")
    doc = sweep.document(store, sweep_id)
    assert doc["best"]["run_id"] == 3 and doc["points"][1]["objective"] is None
    assert doc["points"][1]["invalid"] == "141 of 200 benchmark requests failed"
    assert pages.sweep_page(store, sweep_id)["best"]["gen_throughput"] == 2
    points = report.sweep_points(store, sweep_id)
    assert report.best_point(points, "gen_throughput") == 2
    _, out, _ = orch("status", "2", "--json")
    assert json.loads(out)["invalid"] == "141 of 200 benchmark requests failed"
    _, out, _ = orch("sweep", "status", str(sweep_id))
    assert "best: #2" in out and "invalid: 141 of 200 benchmark requests failed" in out
    _, out, _ = orch("compare", "1", "2", "--json")
    assert {m["verdict"] for m in json.loads(out)["metrics"].values()} == {"incomparable"}


# --- compare that judges ----------------------------------------------------------------------------------------
def bench_run(store: Store, tmp: Path, receipt: dict[str, Any], tput: list[float], ttft: list[float]) -> int:
    run_id = new_run(store, tmp)
    store.complete_receipt(run_id, receipt)
    store.add_metrics(run_id, [(n, v, i + 1) for vs, n in ((tput, "output_throughput"), (ttft, "median_ttft_ms"))
                               for i, v in enumerate(vs)], 1.0)
    store.add_metrics(run_id, [("completed", 32.0, i + 1) for i in range(len(tput))], 1.0)
    transition(store, run_id, Status.SUCCEEDED)
    return run_id


def test_compare_names_the_differences_first_then_judges_each_metric(orch: Orch, tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    tput, ttft = [100.0, 103.0, 98.0, 101.0, 99.5], [20.0, 21.0, 19.5, 20.5, 20.2]
    a = bench_run(store, tmp_path, RECEIPT, tput, ttft)
    same = bench_run(store, tmp_path, changed(launched_at=5.0), [v + 1 for v in tput], ttft[::-1])
    slow = bench_run(store, tmp_path, changed(patches=[{"name": "slow-decode", "set_hash": "h", "reverted": True}]),
                     [v * 0.7 for v in tput], [v * 1.5 for v in ttft])
    other = bench_run(store, tmp_path, changed(dataset__name="sharegpt"), tput, ttft)
    store.close()
    got = json.loads(orch("compare", str(a), str(same), "--json")[1])
    assert got["differences"] == []
    assert {n: m["verdict"] for n, m in got["metrics"].items()} == {
        "completed": "within_noise", "median_ttft_ms": "within_noise", "output_throughput": "within_noise"}
    got = json.loads(orch("compare", str(a), str(slow), "--json", "--metric", "output_throughput",
                          "--metric", "median_ttft_ms")[1])
    assert [d["key"] for d in got["differences"]] == ["patches.slow-decode.name", "patches.slow-decode.set_hash"]
    assert list(got["metrics"]) == ["median_ttft_ms", "output_throughput"]
    m = got["metrics"]["output_throughput"]
    assert m["name"] == "output_throughput" and m["verdict"] == "worse" and m["headline"] is False
    assert m["values"] == [99.5, pytest.approx(69.65)] and m["noise"][0]["median"] == 100.0
    assert got["metrics"]["median_ttft_ms"]["verdict"] == "worse"  # a latency that grew
    got = json.loads(orch("compare", str(a), str(other), "--json")[1])
    assert got["metrics"]["output_throughput"]["verdict"] == "incomparable"
    assert got["metrics"]["output_throughput"]["why"][1] == "the data set differs (dataset.name: random -> sharegpt)"
    text = orch("compare", str(a), str(slow))[1]
    assert text.splitlines()[0] == "patches.slow-decode.name: - -> slow-decode"
    assert "69.65 (0.70x) worse" in text
    code, _, err = orch("compare", str(a), str(slow), "--metric", "nope")
    assert code == 2 and "no metric nope" in err


# --- regressions across nights ---------------------------------------------------------------------------------
def night(store: Store, tmp: Path, sweep_id: int, receipt: dict[str, Any], scale: float) -> None:
    """Every point of the sweep run, its gen_throughput measured five times."""
    for pt in sweep_db.points(store, sweep_id):
        run_id = bench_run(store, tmp, receipt, [], [])
        store.update_run(run_id, sweep_id=sweep_id, point=pt.key)
        store.add_metrics(run_id, [("gen_throughput", scale * v, i) for i, v in enumerate([80, 82, 79, 81, 80.5])], 1.0)
        assert sweep_db.start_point(store, sweep_id, pt.index)
        sweep_db.settle_point(store, sweep_id, pt.index, PointStatus.SUCCEEDED, run_id=run_id)


def stored_sweep(store: Store, sweep_id: int) -> dict[str, Any]:
    from orchestrator.store import sweeps as stored_sweeps

    row = stored_sweeps.sweep(store, sweep_id)
    assert row is not None
    return row


def test_a_sweep_run_again_flags_a_regression_beyond_its_spread_and_names_what_changed(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    file = tmp_path / "s.toml"
    file.write_text('name = "nightly"\nplaybook = "command"\nhosts = ["local"]\n'
                    'objective = { metric = "gen_throughput", goal = "max" }\n[spec]\ncmd = "true"\n'
                    '[matrix]\n"env.B" = ["4", "8"]\n')
    ids = []
    for day, scale, receipt in ((1, 1.0, RECEIPT), (2, 1.01, changed(launched_at=7.0)),
                                (3, 0.8, changed(patches=[{"name": "slow-decode", "set_hash": "h"}]))):
        sweep_id = sweep_db.register(store, sweep.plan(ws, store, file, instance=f"2026-12-0{day}"))  # a night each
        night(store, tmp_path, sweep_id, receipt, scale)
        ids.append(sweep_id)
    from orchestrator.sweep import status

    assert status.regressions(store, ids[1]) == []  # the same receipt, within the noise
    found = status.regressions(store, ids[2])
    assert [(r["index"], r["verdict"], r["metric"]) for r in found] == [(0, "worse", "gen_throughput"),
                                                                         (1, "worse", "gen_throughput")]
    assert found[0]["changed"] == ["patches.slow-decode.name: - -> slow-decode",
                                   "patches.slow-decode.set_hash: - -> h"]
    line = status.regression_line(found)
    assert line is not None and "\n" not in line
    # against the last night (the one before it is no longer the point's latest)
    assert line == ("2 regressions beyond the noise: #0 env.B=4 gen_throughput 81.31 -> 64.4, #1 env.B=8 "
                    "gen_throughput 81.31 -> 64.4; changed: patches.slow-decode.name: - -> slow-decode, "
                    "patches.slow-decode.set_hash: - -> h")
    # once the night's sweep has ended: its document, its end's line and its notification say it
    from orchestrator.sweep import notification
    from orchestrator.sweep.record import SweepStatus

    for to in (SweepStatus.RUNNING, SweepStatus.SUCCEEDED):
        sweep_db.transition_sweep(store, ids[2], to)
    doc = sweep.document(store, ids[2])
    assert doc["regressions"] == found and doc["regression_line"] == line
    assert sweep.best_line(doc).splitlines()[1] == line
    sent = notification.payload(ids[2], doc)
    assert sent["text"].count("\n") == 0 and sent["regressions"] == found
    assert "; 2 regressions beyond the noise: #0 env.B=4 gen_throughput 81.31 -> 64.4" in sent["text"]
    # the report's trend: each night's value of each point with its noise band
    trend = report.nights(store, stored_sweep(store, ids[2]), report.Objective.of_metric("gen_throughput"))
    assert [n["bands"][next(iter(n["bands"]))] for n in trend] == [
        [79.0, 82.0], [pytest.approx(79.79), pytest.approx(82.82)], [pytest.approx(63.2), pytest.approx(65.6)]]


def test_the_repeats_run_in_one_process_and_the_warm_ups_out_of_the_log(tmp_path: Path) -> None:
    import subprocess

    runner = Path(__file__).parents[2] / "playbooks" / "jobs" / "repeat_bench.py"
    (tmp_path / "bench.py").write_text("import sys, os\nprint('measured', sys.argv[1:], os.getpid())\n")
    out = subprocess.run([sys.executable, str(runner), "3", "2", "bench.py", "--x"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["warm-up 1/2", "warm-up 2/2"] and lines[2::2] == ["repeat 1/3", "repeat 2/3", "repeat 3/3"]
    assert len({line for line in lines[3::2]}) == 1 and "['--x']" in lines[3]  # one process, the same arguments
    assert (tmp_path / "warmup.log").read_text().count("measured") == 2
    (tmp_path / "bench.py").write_text("import sys\nprint('down')\nsys.exit(3)\n")
    out = subprocess.run([sys.executable, str(runner), "3", "0", "bench.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 3 and out.stdout.splitlines() == ["repeat 1/3", "down"]
