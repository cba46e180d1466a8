"""EAGLE-3 servers end to end: serve-eagle3, bench-serving and `orch stop` over the real sshd fleet.

The SGLang emulator (tests/fakes) stands in for launch_server through the spec's `launcher`, and the
bench_serving emulator for the benchmark; everything else is real: SSH, processes, HTTP, SQLite.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import sqlite3
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from orchtest import FAST, Orch, reached, release
from sshd import free_port

from orchestrator.config.hosts import local_host
from orchestrator.host.health import ask
from orchestrator.host.remote import LocalTransport
from playbooks.bench_serving import module_for
from playbooks.serve_eagle3 import no_graph_flags

pytest_plugins = ["engine_src"]  # engine_source, engine, engine_python: real sglang 0.5.23 source

FAKES = Path(__file__).resolve().parent / "fakes"
EMULATOR = FAKES / "sglang_emulator.py"
BENCH = FAKES / "bench_serving_emulator.py"
DEBUG = "sglang-eagle3-hidden-debug"
NO_GRAPHS = ["--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"]


def serve_sets(port: int, *emulator_flags: str, **fields: object) -> list[str]:
    """`--set`s for a serve-eagle3 run whose launcher is the emulator (3 quick shards, then serving)."""
    extra = ["--shards", "3", "--shard-time", "0.01", "--capture-time", "0.01", *emulator_flags]
    values = {"model": "/models/target", "draft_model": "/models/draft", "port": port,
              "launcher": str(EMULATOR), "extra_args": json.dumps(extra), **fields}
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")] + FAST


def workspace(tmp_path: Path, fleet, **test1: object) -> Orch:
    hosts = {"test1": {"workdir": str(tmp_path / "r1"), **test1}, "test2": {"workdir": str(tmp_path / "r2")}}
    return Orch(tmp_path / "ws", fleet.hosts_toml(**hosts))


@pytest.fixture(autouse=True)
def no_server_left_behind(tmp_path: Path) -> Iterator[None]:
    """A failing test must not leave a server running: kill every process group working under tmp_path."""
    yield
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/cwd").startswith(str(tmp_path)):
                os.killpg(os.getpgid(int(entry)), signal.SIGKILL)
        except OSError:
            continue


def group_alive(pgid: int) -> bool:
    """Whether any process of the group lives (zombies count as gone)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z" and int(stat[2]) == pgid:
                return True
    return False


def http_status(port: int) -> int | None:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def kinds(doc: dict, kind: str) -> list[str]:
    return [e["message"] for e in doc["events"] if e["kind"] == kind]


def printed_rows(log: str) -> dict[str, float]:
    """The result block's rows as the benchmark printed them."""
    block = log.split(" Serving Benchmark Result ", 1)[1]
    rows = {}
    for line in block.splitlines():
        m = re.match(r"^(.{40}) (\S+)\s*$", line)
        if m:
            rows[m.group(1).strip()] = m.group(2)
    return {k: float(v) for k, v in rows.items() if re.fullmatch(r"-?\d+(\.\d+)?", v)}


def stop(orch: Orch, run_id: int, pid: int) -> dict:
    res = orch("stop", str(run_id), "--grace", "3")
    assert res.returncode == 0, res.stderr
    doc = orch.status(run_id)
    assert doc["status"] == "cancelled" and doc["reason"].startswith("stopped by user"), doc["reason"]
    assert not group_alive(pid)
    return doc


def test_until_ready_then_bench_then_stop(tmp_path, ssh_fleet):
    orch = workspace(tmp_path, ssh_fleet)
    port = free_port("127.0.0.1")
    res = orch("run", "serve-eagle3", "--host", "test1", "--until-ready", *serve_sets(port, "--serve-after", "600"))
    assert res.returncode == 0, res.stderr
    server = orch.status(1)
    assert server["status"] == "running" and server["phase"] == "ready", server
    assert "health endpoint answered (HTTP 200)" in kinds(server, "health")
    assert http_status(port) == 200
    assert f"  url: http://127.0.0.1:{port} (on test1)" in res.stderr.splitlines()
    assert table_row(orch, 1)["url"] == f"http://127.0.0.1:{port}"
    job = (Path(server["remote_dir"]) / "job.sh").read_text()
    assert f"--speculative-algorithm EAGLE3 --speculative-draft-model-path /models/draft --tp-size 8 --port {port}" in job

    bench = ["--set", "server=1", "--set", f"launcher={BENCH}", "--set", "num_prompts=20",
             "--set", "max_concurrency=4", "--set", "input_len=128", "--set", "output_len=64", *FAST]
    # a server on another host is bad input
    other = orch("run", "bench-serving", "--host", "test2", *bench)
    assert other.returncode == 2 and "is not on test2" in other.stderr and len(orch.status()) == 1

    res = orch("run", "bench-serving", "--host", "test1", *bench)
    assert res.returncode == 0, res.stderr
    doc = orch.status(2)
    assert doc["status"] == "succeeded" and doc["spec"]["server"] == 1
    log = (Path(doc["remote_dir"]) / "log").read_text()
    assert f"--base-url http://127.0.0.1:{port} --num-prompts 20 --dataset-name random-ids --max-concurrency 4 " \
           "--random-input-len 128 --random-output-len 64" in (Path(doc["remote_dir"]) / "job.sh").read_text()
    rows = printed_rows(log)
    expected = {"output_throughput": "Output token throughput (tok/s):", "request_throughput":
                "Request throughput (req/s):", "total_token_throughput": "Total token throughput (tok/s):",
                "median_ttft_ms": "Median TTFT (ms):", "median_itl_ms": "Median ITL (ms):",
                "accept_len": "Accept length:"}
    assert {k: doc["metrics"][k] for k in expected} == {k: rows[label] for k, label in expected.items()}
    assert doc["metrics"]["output_throughput"] > 0

    doc = stop(orch, 1, server["pid"])
    assert http_status(port) is None
    assert doc["phase"] == "ready"
    row = table_row(orch, 1)
    assert (row["status"], row["reason"], row["url"]) == ("stopped", doc["reason"], "")


def table_row(orch: Orch, run_id: int) -> dict[str, str]:
    """A run's row of the piped `orch status` table, by column."""
    header, *rows = [line.split("\t") for line in orch("status", check=0).stdout.splitlines()]
    return next(dict(zip(header, row)) for row in rows if row[0] == str(run_id))


def group_members(pgid: int, needle: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid \
                    and needle in Path(f"/proc/{entry}/cmdline").read_text():
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_server_left_watching_records_decode_stats_then_stop_frees_its_gpus(tmp_path):
    """On the local host, with the tests-only nvidia-smi showing the server on both GPUs."""
    orch = Orch(tmp_path / "ws")
    gpus = tmp_path / "gpu-state.json"
    state = {"gpus": [{"index": i, "uuid": f"GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e9{i}", "memory_total": 143771,
                       "utilization": 0} for i in (0, 1)], "processes": []}
    gpus.write_text(json.dumps(state))
    orch.env.update(PATH=f"{FAKES}{os.pathsep}{os.environ['PATH']}", ORCH_FAKE_GPU_STATE=str(gpus))
    port = free_port("127.0.0.1")
    watcher = orch.spawn("run", "serve-eagle3",
                         *serve_sets(port, "--decode-stats", "6", "--decode-interval", "0.25", "--serve-after", "600"))
    try:
        deadline = time.time() + 120  # its start-up (the patch set applied, the server loaded) on a loaded machine
        series: list = []
        while time.time() < deadline and len(series) < 6:
            time.sleep(0.2)
            try:
                # each sample with its own time: no command prints a metric's whole series
                with sqlite3.connect(f"file:{orch.db}?mode=ro", uri=True) as db:
                    series = db.execute("SELECT ts, value FROM metrics WHERE run_id = 1 AND name = 'gen_throughput'"
                                        " ORDER BY id").fetchall()
            except sqlite3.OperationalError:  # not created yet
                pass
        assert [v for _, v in series] == [88.8 + i for i in range(6)]
        # stamped with each line's own time (whole seconds in SGLang's format): 1.5 s of lines, in order
        stamps = [ts for ts, _ in series]
        assert stamps == sorted(stamps) and len(set(stamps)) >= 2
        doc = orch.status(1)
        assert doc["status"] == "running" and doc["phase"] == "running" and doc["metrics"]["accept_len"] == 3.5

        (server,) = group_members(doc["pid"], "sglang_emulator")
        state["processes"] = [{"pid": server, "gpu": i, "used_memory": 70000} for i in (0, 1)]
        gpus.write_text(json.dumps(state))
        held = json.loads(orch("gpus", "--json", check=0).stdout)["local"]["gpus"]
        assert [[p["run_id"] for p in g["processes"]] for g in held] == [[1], [1]]
        res = orch("stop", "1", "--grace", "3")
        assert res.returncode == 0 and "GPUs 0,1 free" in res.stderr, res.stderr
        doc = orch.status(1)
        assert doc["status"] == "cancelled" and not group_alive(doc["pid"])
        assert "GPUs 0,1 free after stop" in kinds(doc, "gpu")
        assert watcher.wait(timeout=30) == 1  # the watching `orch run` saw the cancel and ended
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()


@pytest.mark.parametrize("mode, answer", [("503", "HTTP 503"), ("close", "no answer")])
def test_a_server_that_stops_answering_is_flagged_then_failed(tmp_path, ssh_fleet, mode, answer):
    orch = workspace(tmp_path, ssh_fleet)
    port = free_port("127.0.0.1")
    serving = tmp_path / "serving"  # the server answers, held at `ready`, until the watcher has seen it answer
    starter = orch.spawn("run", "serve-eagle3", "--host", "test1", "--set", "health_grace_s=1.5",
                         *serve_sets(port, "--pause", f"ready:{serving}", "--unhealthy-after", "0",
                                     "--unhealthy-mode", mode, "--serve-after", "600"))
    try:
        reached(serving, timeout=120)
        orch.wait_for(1, lambda doc: any(e["kind"] == "health" for e in doc["events"]), timeout=120)
        release(serving)
        _, stderr = starter.communicate(timeout=120)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
    assert starter.returncode == 1, stderr
    doc = orch.status(1)
    assert doc["status"] == "failed"
    assert re.fullmatch(rf"health endpoint stopped answering for \d+ s \(last: {answer}\)", doc["reason"]), doc["reason"]
    health = [e for e in doc["events"] if e["kind"] == "health"]
    assert health[0]["message"] == "health endpoint answered (HTTP 200)"
    assert health[1]["message"].startswith(f"health endpoint stopped answering ({answer})")
    ended = next(e for e in doc["events"] if e["kind"] == "status" and e["message"].startswith("failed"))
    assert ended["ts"] - health[1]["ts"] >= 1.5  # flagged, still running through the grace
    assert not group_alive(doc["pid"])  # killed so the GPUs are freed


def test_debug_patches_the_real_engine_and_turns_graphs_off(tmp_path, ssh_fleet, engine):
    orch = workspace(tmp_path, ssh_fleet, python=engine.python)
    before = engine.snapshot("sglang")
    port = free_port("127.0.0.1")
    res = orch("run", "serve-eagle3", "--host", "test1", "--until-ready", "--set", "debug=true",
               *serve_sets(port, "--serve-after", "600"))
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert doc["spec"]["patches"] == [DEBUG] and doc["status"] == "running"
    assert kinds(doc, "patch")[0].startswith(f"{DEBUG} on sglang 0.5.23:")
    assert engine.snapshot("sglang") != before  # patched while it serves
    job = (Path(doc["remote_dir"]) / "job.sh").read_text()
    assert " ".join(NO_GRAPHS) in job and "--disable-cuda-graph" not in job
    (server,) = group_members(doc["pid"], "sglang_emulator")
    assert all(flag in Path(f"/proc/{server}/cmdline").read_text().split("\0") for flag in NO_GRAPHS)
    stop(orch, 1, doc["pid"])
    assert "reverted" in kinds(orch.status(1), "patch")[-1]
    assert engine.snapshot("sglang") == before


def test_graphs_off_in_the_installed_versions_spelling():
    assert no_graph_flags("0.5.5.post3") == ["--disable-cuda-graph"]
    assert no_graph_flags("0.4.10.post2") == ["--disable-cuda-graph"]
    assert no_graph_flags("0.5.23") == NO_GRAPHS
    assert no_graph_flags(None) == NO_GRAPHS  # not installed (an emulator): the patch set's own flags
    # server_args.py has the per-phase backends (and deprecates --disable-cuda-graph) from 0.5.14
    assert no_graph_flags("0.5.13.post1") == ["--disable-cuda-graph"]
    assert no_graph_flags("0.5.14") == no_graph_flags("0.5.14.post2") == NO_GRAPHS


def test_bench_module_in_the_installed_versions_spelling():
    old, new = ["-m", "sglang.bench_serving"], ["-m", "sglang.benchmark.serving"]
    assert [module_for(v) for v in ("0.4.10.post2", "0.5.5", "0.5.14.post1", None)] == [old] * 4
    assert [module_for(v) for v in ("0.5.15", "0.5.15.post1", "0.5.23", "0.6.0")] == [new] * 4


def test_bench_against_a_run_that_is_not_a_running_server_starts_nothing(tmp_path, ssh_fleet):
    orch = workspace(tmp_path, ssh_fleet)
    assert orch("run", "command", "--host", "test1", "--set", "cmd=true", *FAST).returncode == 0
    for sets, message in ((["server=1"], "run 1 (command on test1, succeeded"),
                          (["server=7"], "server: no run 7"),
                          (["server=1", "url=http://127.0.0.1:1"], "exactly one of server")):
        res = orch("run", "bench-serving", "--host", "test1", *[a for s in sets for a in ("--set", s)])
        assert res.returncode == 2, res.stderr
        assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert len(orch.status()) == 1
    run_dirs = [p.relative_to(tmp_path / "r1" / "runs") for p in (tmp_path / "r1" / "runs").glob("*/*")
                if p.parent.name != "hostjobs"]  # orch's host programs aside, only run 1's dir
    assert [p.name for p in run_dirs] == ["1"]


def test_dry_run_shows_the_real_launch_flags(tmp_path, ssh_fleet):
    orch = workspace(tmp_path, ssh_fleet)
    res = orch("run", "serve-eagle3", "--host", "test1", "--dry-run", "--set", "model=/m/t", "--set", "draft_model=/m/d",
               "--set", "num_steps=3", "--set", "eagle_topk=1", "--set", "num_draft_tokens=4",
               "--set", "mem_fraction=0.8", "--set", 'extra_args=["--context-length", "4096"]')
    assert res.returncode == 0, res.stderr
    assert ("-m sglang.launch_server --model-path /m/t --speculative-algorithm EAGLE3 --speculative-draft-model-path"
            " /m/d --tp-size 8 --port 30000 --speculative-num-steps 3 --speculative-eagle-topk 1"
            " --speculative-num-draft-tokens 4 --mem-fraction-static 0.8 --context-length 4096") in res.stdout
    assert orch.status() == []


class _Health(http.server.BaseHTTPRequestHandler):
    code = 200
    delay_s = 0.0  # SGLang's /health generates a token first

    def do_GET(self) -> None:
        time.sleep(self.delay_s)
        self.send_response(self.code if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def slow_health() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        _Health.delay_s = 0.0
        server.shutdown()
        server.server_close()


def test_a_slow_health_answer_counts_within_the_probes_timeout(tmp_path, slow_health):
    transport = LocalTransport(local_host(tmp_path))
    _Health.delay_s = 1.5
    assert ask(transport, slow_health, timeout_s=0.5) is None
    assert ask(transport, slow_health, timeout_s=4) == 200


def test_serve_eagle3_waits_for_a_busy_sglang_health_answer(tmp_path, slow_health):
    from orchestrator.host.health import TIMEOUT_S
    from playbooks.serve_eagle3 import ServeEagle3Spec, health_check

    _Health.delay_s = TIMEOUT_S + 1  # longer than a generic probe waits
    spec = ServeEagle3Spec(model="/m/t", draft_model="/m/d", port=slow_health, python=sys.executable)
    host = local_host(tmp_path)
    assert health_check(spec, host).ask(LocalTransport(host)) == 200
    assert ask(LocalTransport(host), slow_health, sys.executable) is None  # what the 5 s probe said


def test_health_is_asked_on_the_host_by_its_agent(tmp_path):
    transport = LocalTransport(local_host(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def status() -> int | None:
        return ask(transport, port)

    try:
        assert status() == 200
        _Health.code = 503
        assert status() == 503
    finally:
        _Health.code = 200
        server.shutdown()
        server.server_close()
    assert status() is None
    assert ask(transport, port, sys.executable) is None
