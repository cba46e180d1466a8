"""`serve-bench` points: serve with the point's EAGLE-3 settings, benchmark, stop the server whatever happens.

Real sshd hosts, the SGLang emulator as launch_server (serving /health) and the bench_serving emulator
printing SGLang's result block; the real CLI and SQLite.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchtest import Orch, kill_controller, reached, release
from sshd import free_port
from test_serve import BENCH, EMULATOR, group_alive, http_status, no_server_left_behind

__all__ = ["no_server_left_behind"]  # the autouse fixture: no server outlives a failing test

EMULATOR_FLAGS = ["--shards", "3", "--shard-time", "0.01", "--capture-time", "0.01", "--decode-stats", "2",
                  "--serve-after", "600"]
POINT_METRICS = {"load_weight_s", "accept_len", "accept_rate", "gen_throughput", "output_throughput",
                 "median_ttft_ms", "median_itl_ms"}


def workspace(tmp_path: Path, fleet) -> Orch:
    hosts = {"test1": {"workdir": str(tmp_path / "r1")}, "test2": {"workdir": str(tmp_path / "r2")}}
    return Orch(tmp_path / "ws", fleet.hosts_toml(**hosts))


def base_spec(**bench: object) -> str:
    table = {"num_prompts": 10, "max_concurrency": 4, "input_len": 64, "output_len": 32, "launcher": str(BENCH),
             **bench}
    return f"""[spec]
model = "/models/target"
draft_model = "/models/draft"
launcher = "{EMULATOR}"
extra_args = {json.dumps(EMULATOR_FLAGS)}
poll_min = 0.05
poll_max = 0.3
bench = {{ {", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items())} }}
"""


def sweep_doc(orch: Orch, ref: str = "1") -> dict:
    return json.loads(orch("sweep", "status", ref, "--json", check=0).stdout)


def test_a_2x2_eagle3_grid_on_two_hosts_serves_benches_and_stops_every_server(tmp_path, ssh_fleet):
    orch = workspace(tmp_path, ssh_fleet)
    # both hosts are this machine: the points of each host get that host's port (round-robin: even
    # points on test1, odd on test2)
    p1, p2 = free_port("127.0.0.1"), free_port("127.0.0.1")
    fails = '\n"bench.extra_args" = ["--num-prompts", "not-a-number"]'  # this point's benchmark fails
    points = [(2, 1, p1, ""), (2, 4, p2, ""), (3, 1, p1, ""), (3, 4, p2, fails)]
    includes = "\n".join(f"[[include]]\nnum_steps = {s}\neagle_topk = {k}\nport = {p}{extra}"
                         for s, k, p, extra in points)
    path = orch.root / "grid.toml"
    path.write_text(f'name = "eagle3-grid"\nplaybook = "serve-bench"\nhosts = ["test1", "test2"]\n'
                    f'objective = {{ metric = "output_throughput", goal = "max" }}\n'
                    f"{base_spec()}\n{includes}\n")
    res = orch("sweep", "run", str(path), timeout=180)
    assert res.returncode == 1, res.stderr  # one point's benchmark failed
    doc = sweep_doc(orch)
    by_index = {p["index"]: p for p in doc["points"]}
    assert [by_index[i]["status"] for i in range(4)] == ["succeeded", "succeeded", "succeeded", "failed"]
    for i in range(3):
        assert POINT_METRICS <= set(by_index[i]["metrics"]), by_index[i]["metrics"]
    assert by_index[3]["fault"] == "job"
    for p in doc["points"]:
        run = orch.status(p["run_id"])
        job = (Path(run["remote_dir"]) / "job.sh").read_text()
        assert f"--speculative-num-steps {p['point']['num_steps']} --speculative-eagle-topk {p['point']['eagle_topk']}" in job
        assert not group_alive(run["pid"]), f"run {run['id']}: its server still runs"
        log = (Path(run["remote_dir"]) / "log").read_text()
        assert "The server is fired up and ready to roll!" in log
    assert http_status(p1) is None and http_status(p2) is None
    best = doc["best"]
    values = {i: by_index[i]["metrics"]["output_throughput"] for i in range(3)}
    assert best["index"] == max(values, key=values.__getitem__) and best["metric"] == "output_throughput"


def test_the_server_is_stopped_when_the_controller_dies_and_the_sweep_resumes(tmp_path, ssh_fleet):
    orch = workspace(tmp_path, ssh_fleet)
    port = free_port("127.0.0.1")
    path, gate = orch.root / "one.toml", tmp_path / "bench-gate"
    # the benchmark waits at its start until the test lets it go: the controller dies while it runs
    path.write_text(f'name = "resume"\nplaybook = "serve-bench"\nhosts = ["test1"]\n'
                    f"{base_spec(extra_args=['--hold', str(gate)])}\n"
                    f"[matrix]\nnum_steps = [3]\nport = [{port}]\n")
    proc = orch.spawn("sweep", "run", str(path))
    try:
        reached(gate)
    finally:
        kill_controller(proc)
    (run,) = orch.status()
    assert group_alive(run["pid"]) and http_status(port) == 200  # the job outlives its controller
    again = orch.spawn("sweep", "run", str(path))
    try:
        said = ""
        while f"watching run {run['id']} again" not in said:  # the resumed sweep holds the running point
            line = again.stderr.readline() if again.stderr else ""
            assert line, f"the resumed sweep ended without watching run {run['id']}: {said}"
            said += line
        release(gate)
        _, err = again.communicate(timeout=120)
    finally:
        again.kill()
    assert again.returncode == 0, said + err
    doc = orch.status(run["id"])
    assert doc["status"] == "succeeded" and POINT_METRICS <= set(doc["metrics"])
    assert not group_alive(run["pid"]) and http_status(port) is None
    assert len(orch.status()) == 1  # watched again, never run twice
