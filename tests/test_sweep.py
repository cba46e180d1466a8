"""Sweeps and leases end to end: the real `orch` CLI, real sshd hosts on loopback, real SQLite, real jobs."""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from pathlib import Path

import pytest
from hostdirs import HostDirs
from orchtest import Orch, job_cmd, kill_controller, release, stop_background_watchers, wait_for_file

from orchestrator import sweep
from orchestrator.config.hosts import Inventory
from orchestrator.config.workspace import Workspace
from orchestrator.errors import UsageError
from orchestrator.host.remote import connect
from orchestrator.runflow.starting import HostTake
from orchestrator.store import Store, lease

FAST_SPEC = "poll_min = 0.05\npoll_max = 0.3\n"


def job(*args: str) -> str:
    """The test job's command line as a TOML string."""
    return json.dumps(job_cmd(*args).removeprefix("cmd="))


def write_sweep(orch: Orch, body: str, name: str = "s.toml") -> Path:
    path = orch.root / name
    path.write_text(body)
    return path


def runs(orch: Orch, while_created: bool = False) -> list[dict]:
    """Every run as `orch status --json` shows it, oldest first; `while_created`: none while the database is
    still being made (a sweep's controller just started)."""
    res = orch("status", "--json", "--limit", "1000000")
    if while_created and res.returncode != 0:
        return []
    assert res.returncode == 0, res.stderr
    return sorted(json.loads(res.stdout), key=lambda r: r["id"])


def sweep_doc(orch: Orch, ref: str = "1") -> dict:
    return json.loads(orch("sweep", "status", ref, "--json", check=0).stdout)


def sweeps(orch: Orch) -> list[dict]:
    return json.loads(orch("sweep", "status", "--json", check=0).stdout)


def no_lease_held(orch: Orch) -> bool:
    # leases are orch's own bookkeeping, shown by no command: read through the store
    return lease.held(Store(orch.db)) == []


def point_key(run: dict) -> str:
    """A run's sweep point, as a key to count its runs by."""
    return json.dumps(run["point"], sort_keys=True)


def assert_one_at_a_time(rows: list[dict]) -> None:
    by_host: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        by_host.setdefault(r["host"], []).append((r["created_at"], r["ended_at"]))
    for spans in by_host.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"two runs at once on one host: {spans}"


def test_grid_over_two_hosts_one_run_at_a_time_per_host(orch):
    decode = 'echo "Decode batch. #running-req: 1, #token: 9, token usage: 0.01, gen throughput (token/s): $A.5, #queue-req: 0, "'
    cmd = json.dumps(job_cmd("--steps", "2", "--sleep", "0.05").removeprefix("cmd=") + " && " + decode)
    path = write_sweep(orch, f"""
name = "grid"
playbook = "command"
hosts = ["test1", "test2"]
[spec]
cmd = {cmd}
{FAST_SPEC}
[matrix]
"env.A" = ["1", "2"]
env.B = ["x", "y", "z"]
""")
    res = orch("sweep", "run", str(path), timeout=120)
    assert res.returncode == 0, res.stderr
    rows = runs(orch)
    assert len(rows) == 6 and all(r["status"] == "succeeded" for r in rows)
    assert {r["host"] for r in rows} == {"test1", "test2"}
    assert_one_at_a_time(rows)
    doc = sweep_doc(orch, "grid")
    assert doc["status"] == "succeeded" and doc["counts"] == {"succeeded": 6}
    points = {(p["point"]["env.A"], p["point"]["env.B"]): p for p in doc["points"]}
    assert sorted(points) == [(a, b) for a in "12" for b in "xyz"]
    specs = {r["id"]: r["spec"] for r in rows}
    for (a, b), p in points.items():
        assert p["runs"] == 1 and p["metrics"]["gen_throughput"] == float(a) + 0.5
        assert specs[p["run_id"]]["env"] == {"A": a, "B": b}
    assert {r["point"]["env.B"] for r in rows} == {"x", "y", "z"}
    table = orch("sweep", "status", "grid", check=0).stdout
    assert "env.A=2 env.B=z" in table and "gen_throughput=2.5" in table
    kinds = [e["kind"] for e in doc["events"]]
    assert kinds.count("run_ended") == 6 and kinds[-1] == "finished"
    # the same file again: nothing to do, nothing run again
    again = orch("sweep", "run", str(path))
    assert again.returncode == 0 and "6 already done" in again.stderr
    assert len(runs(orch)) == 6


def test_killed_controller_then_rerun_resumes_without_rerunning(orch):
    # every point but N=0 holds before its last line until the test opens its gate: the controller dies
    # while a run is surely running, and that run ends only after
    gates = orch.root / "gate"
    gates.mkdir()
    (gates / "0").touch()
    cmd = job_cmd("--steps", "8", "--sleep", "0.05").removeprefix("cmd=") + f' --pause end:{gates}/"$N"'
    path = write_sweep(orch, f"""
name = "resume"
playbook = "command"
hosts = ["test1", "test2"]
[spec]
cmd = {json.dumps(cmd)}
{FAST_SPEC}
[matrix]
"env.N" = ["0", "1", "2", "3"]
""")
    proc = orch.spawn("sweep", "run", str(path))
    deadline = time.time() + 60
    while time.time() < deadline:
        statuses = [r["status"] for r in runs(orch, while_created=True)]
        # once N=0 succeeded, every run still running is held at its gate
        if "succeeded" in statuses and "running" in statuses and len(statuses) >= 3:
            break
        time.sleep(0.05)
    kill_controller(proc)
    killed_at = time.time()
    before = runs(orch)
    interrupted = [r["id"] for r in before if r["status"] == "running"]
    assert interrupted and sweep_doc(orch)["status"] == "interrupted", before
    for n in "123":
        (gates / n).touch()
    res = orch("sweep", "run", str(path), timeout=120)
    assert res.returncode == 0, res.stderr
    # a point that had finished ran once, and so did one whose run was watched again; only a point whose
    # run had not launched yet when its controller died ran anew
    # (or one its host's watcher had already settled as never launched when `before` was read)
    never_launched = {point_key(r) for r in before if r["status"] in ("pending", "preparing", "launching")
                      or "controller died" in (r["reason"] or "")}
    rows = runs(orch)
    per_point = {key: [point_key(r) for r in rows].count(key) for key in map(point_key, rows)}
    assert len(per_point) == 4
    after = [(r["id"], r["point"], r["status"], r["reason"]) for r in rows]
    assert all(n == 1 or (n == 2 and point in never_launched) for point, n in per_point.items()), (
        [(r["id"], r["point"], r["status"]) for r in before], after, res.stderr)
    assert [r["status"] for r in rows].count("succeeded") == 4
    # a run caught before its wrapper wrote a pid ended as one that never launched (failed, or lost when
    # the launch command had gone out): either way its point ran anew
    assert all(r["status"] == "succeeded" or "controller died before launch" in r["reason"]
               or "controller died while launching" in r["reason"] for r in rows), rows
    assert_one_at_a_time(rows)
    for run_id in interrupted:
        # its host's watcher went on with it after the controller died; the resumed sweep follows it to
        # its end, or finds it ended already (its point counted once, above)
        doc = orch.status(run_id)
        assert doc["status"] == "succeeded" and doc["ended_at"] > killed_at  # ran on, watched to its end
        phases = [e["message"] for e in doc["events"] if e["kind"] == "phase"]
        assert len(phases) == len(set(phases)), phases  # its log read once
        doc = orch.status(run_id)
        assert doc["progress"]["done"] == 8
        assert [e["message"] for e in doc["events"] if e["kind"] == "phase"].count("running") == 1
    assert sweep_doc(orch)["counts"] == {"succeeded": 4}


def test_dead_host_points_retry_then_fail_while_the_live_host_succeeds(orch, ssh_fleet_restarts):
    ssh_fleet_restarts.server(2).stop()
    path = write_sweep(orch, f"""
name = "dead"
playbook = "command"
hosts = ["test1", "test2"]
retries = 1
retry_backoff_s = 0.1
[spec]
cmd = {job("--steps", "2", "--sleep", "0.05")}
{FAST_SPEC}
[matrix]
"env.N" = ["0", "1", "2"]
""")
    res = orch("sweep", "run", str(path), timeout=120)
    assert res.returncode == 1
    assert "retry 1 of 1" in res.stderr
    doc = sweep_doc(orch)
    assert doc["status"] == "failed"
    by_host = {h: [p for p in doc["points"] if p["host"] == h] for h in ("test1", "test2")}
    assert [p["status"] for p in by_host["test1"]] == ["succeeded", "succeeded"]
    (dead,) = by_host["test2"]
    assert dead["status"] == "failed" and dead["fault"] == "fleet" and dead["runs"] == 2
    assert "unreachable" in dead["reason"] and "after 2 attempts" in dead["reason"]
    for r in runs(orch):
        if r["host"] == "test2":
            assert r["status"] == "failed" and r["pid"] is None and "before launch" in r["reason"]
    assert no_lease_held(orch)


def test_job_crash_is_not_retried_and_fail_fast_cancels_the_queue(orch):
    path = write_sweep(orch, f"""
name = "ff"
playbook = "command"
hosts = ["test1"]
retries = 3
fail_fast = true
[spec]
cmd = "exit $CODE"
{FAST_SPEC}
[matrix]
"env.CODE" = ["0", "3", "1"]
""")
    res = orch("sweep", "run", str(path), timeout=60)
    assert res.returncode == 1
    points = sweep_doc(orch)["points"]
    assert [p["status"] for p in points] == ["succeeded", "failed", "cancelled"]
    assert points[1]["fault"] == "job" and points[1]["runs"] == 1 and "exit code 3" in points[1]["reason"]
    assert "fail_fast" in points[2]["reason"] and points[2]["runs"] == 0
    assert len(runs(orch)) == 2


def test_invalid_point_exit_2_nothing_started(orch, tmp_path):
    path = write_sweep(orch, f"""
name = "bad"
playbook = "command"
hosts = ["test1", "test2"]
[spec]
cmd = "touch {tmp_path}/ran"
{FAST_SPEC}
[matrix]
stall_factor = [2, 3, 0.5]
""")
    res = orch("sweep", "run", str(path))
    assert res.returncode == 2, res.stderr
    assert "point 2 (stall_factor=0.5)" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = orch("sweep", "run", "--detach", str(path))
    assert res.returncode == 2 and "point 2" in res.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "remote1").exists()
    assert runs(orch) == [] and sweeps(orch) == []
    ws = Workspace(orch.root, orch.root / "hosts.toml")
    for body, message in [("name = 'x'\nplaybook = 'command'\n", "either hosts"),
                          ("name = 'x'\nplaybook = 'command'\nhosts = ['nope']\n[spec]\ncmd = 'true'\n", "unknown host"),
                          ("name = 'x'\nplaybook = 'command'\nhosts = ['test1']\n[matrix]\ncmd = 'true'\n", "matrix.cmd"),
                          ("name = 'x'\nplaybook = 'nope'\nhosts = ['test1']\n", "unknown playbook"),
                          ("name = 'x'\nplaybook = 'command'\nhosts = ['test1']\nretries = -1\n", "retries"),
                          ("name = 'x'\nplaybook = 'command'\nhosts = ['test1']\n[spec]\ncmd = 1\n", "point 0 (base spec)")]:
        with pytest.raises(UsageError, match=re.escape(message)):
            sweep.plan(ws, Store(orch.db), write_sweep(orch, body, "other.toml"))
    assert sweeps(orch) == []
    # a valid file is registered with its points and its notify URLs, which nothing here sends to
    body = ("name = 'ok'\nplaybook = 'command'\ntags = ['gpu']\nnotify = ['http://127.0.0.1:9/x']\n"
            "[spec]\ncmd = 'true'\n[matrix]\nenv.A = ['1', '2', '1']\n[[include]]\nenv = {A = '3'}\n")
    store = Store(orch.db)
    with pytest.raises(UsageError, match="no host of the inventory has the tags gpu"):
        sweep.plan(ws, store, write_sweep(orch, body, "ok.toml"))
    (orch.root / "hosts.toml").write_text(orch.root.joinpath("hosts.toml").read_text() + "\n[hosts.g1]\ntags = ['gpu']\n")
    p = sweep.plan(ws, store, write_sweep(orch, body, "ok.toml"))
    assert [pt.diff for pt in p.points] == [{"env.A": "1"}, {"env.A": "2"}, {"env.A": "3"}]
    sweep_id = sweep.register(store, p)
    assert sweep.register(store, p) == sweep_id  # the same file: the same sweep
    doc = sweep.document(store, sweep_id)
    assert doc["notify"] == ["http://127.0.0.1:9/x"] and doc["counts"] == {"queued": 3}
    assert {pt["host"] for pt in doc["points"]} == {"g1"}
    assert runs(orch) == []


def test_detached_sweep_then_cancel(orch):
    path = write_sweep(orch, f"""
name = "long"
playbook = "command"
hosts = ["test1"]
[spec]
cmd = {job("--steps", "300", "--sleep", "0.05")}
{FAST_SPEC}
[matrix]
"env.N" = ["0", "1", "2"]
""")
    res = orch("sweep", "run", "--detach", str(path), check=0)
    sweep_id = res.stdout.strip()
    deadline = time.time() + 30
    while time.time() < deadline and not any(r["status"] == "running" for r in runs(orch, while_created=True)):
        time.sleep(0.05)
    assert orch("sweep", "run", str(path)).returncode == 1  # one controller per sweep
    res = orch("sweep", "cancel", sweep_id, "--grace", "1")
    assert res.returncode == 0, res.stderr
    deadline = time.time() + 30
    while time.time() < deadline and sweep_doc(orch, sweep_id)["controller"]:
        time.sleep(0.05)
    doc = sweep_doc(orch, sweep_id)
    assert doc["status"] == "cancelled"
    assert [p["status"] for p in doc["points"]] == ["cancelled"] * 3
    (run,) = runs(orch)
    assert run["status"] == "cancelled" and "sweep cancelled" in run["reason"]
    log = orch.root / "runs" / "sweeps" / sweep_id / "controller.log"
    assert "run 1 started" in log.read_text()


def test_two_runs_racing_for_one_host_then_queue(orch, tmp_path):
    hold = tmp_path / "hold"  # the winner's job waits there until the queued run has said it waits
    args = ("run", "command", "--host", "test1", "--set", job_cmd("--steps", "20", "--sleep", "0.01", "--pause",
                                                                   f"10:{hold}"),
            "--set", "poll_min=0.05", "--set", "poll_max=0.3")
    a, b = orch.spawn(*args), orch.spawn(*args)
    first = None
    deadline = time.time() + 60
    while first is None and time.time() < deadline:
        first = next((p for p in (a, b) if p.poll() is not None), None)
        time.sleep(0.02)
    _, errs = first.communicate()
    assert first.returncode == 1, errs
    assert "orch: host test1 is busy with run 1 (command, " in errs
    assert "--queue waits for it to end, --replace stops it first" in errs
    queued = orch.spawn(*args, "--queue")
    assert queued.stderr is not None
    told = queued.stderr.readline()
    assert told.startswith("waiting: host test1 is busy with run 1"), told
    release(hold)
    winner = b if first is a else a
    assert winner.wait(timeout=60) == 0
    _, errs = queued.communicate(timeout=60)
    assert queued.returncode == 0, errs
    rows = runs(orch)
    assert [r["status"] for r in rows] == ["succeeded", "succeeded"]  # the refused one left no run
    assert rows[1]["created_at"] >= rows[0]["ended_at"]
    assert no_lease_held(orch)


def test_stale_leases_are_recovered(orch, tmp_path):
    # a controller that took the host (its lease files on test1 too) and died before launching
    ws = Workspace(root=orch.root, hosts_file=orch.root / "hosts.toml")
    host = Inventory.load(ws.hosts_file, ws.root).get("test1")
    store = Store(orch.db)
    store.migrate()
    create = lambda: [store.create_run("command", "test1", {"cmd": "true"})]
    claim = HostTake(ws, store, [host], {"test1": connect(host)}, None)
    claim.made(lambda: lease.acquire_all(store, ["test1"], None, create, 0.3,
                                         lambda run: pytest.fail(f"run {run.id} was probed"), claim))
    store.conn.execute("UPDATE leases SET pid = ?, pid_start = '1'", (2**22 + 1,))  # that process is gone
    (held,) = lease.held(store)
    assert not held.controller.alive(None, 0)
    with pytest.raises(lease.Busy, match="busy with run 1"):  # the host holds it: a start with no probe waits
        lease.acquire_all(store, ["test1"], None, create, 0.3, lambda run: None, claim)
    res = orch("run", "command", "--host", "test1", "--set", "cmd=true", "--set", "poll_min=0.05")
    assert res.returncode == 0, res.stderr
    orphan, ran = runs(orch)
    assert orphan["status"] == "failed" and "controller died before launch" in orphan["reason"]
    assert ran["status"] == "succeeded"
    # a detached run keeps its lease while its job runs (held until the test lets it end), and frees it
    # once seen to end
    hold = tmp_path / "hold"
    # a process of its own: the lease names the starter until a watcher adopts the run, and that starter's
    # death is what this test is about
    res = orch("run", "command", "--host", "test1", "--detach", "--set", "poll_min=0.05",
               "--set", job_cmd("--steps", "3", "--sleep", "0.01", "--pause", f"end:{hold}"), check=0,
               new_process=True)
    detached = int(res.stdout)
    remote_dir = orch.wait_for(detached, lambda d: d["status"] == "running")["remote_dir"]
    stop_background_watchers(Path(os.environ["HOME"]))  # its watcher dies too (a reboot of this machine)
    res = orch("run", "command", "--host", "test1", "--set", "cmd=true")
    assert res.returncode == 1
    assert f"busy with run {detached} (command, running" in res.stderr
    assert "its controller is gone but the job still runs" in res.stderr
    release(hold)
    wait_for_file(Path(remote_dir) / ".orch" / "exit_code")  # the job ends; nobody watches it now
    res = orch("run", "command", "--host", "test1", "--set", "cmd=true", "--set", "poll_min=0.05")
    assert res.returncode == 0, res.stderr
    assert orch.status(detached)["status"] == "succeeded"
    assert [r["status"] for r in runs(orch)].count("failed") == 1  # only the orphan


def test_gpu_sets(tmp_path, orch):
    store = Store(tmp_path / "l.db")
    at = HostDirs(tmp_path / "hosts", store)
    make = lambda: [store.create_run("command", "h", {})]
    at.acquire(["h"], make, [0, 1])
    with pytest.raises(lease.Busy, match="GPUs 0,1 of h are busy with run 1"):
        at.acquire(["h"], make, [1, 2])
    with pytest.raises(lease.Busy, match="busy with run 1"):
        at.acquire(["h"], make)
    assert at.acquire(["h"], make, [2, 3]) == [2]
    assert at.acquire(["other"], lambda: [store.create_run("command", "other", {})]) == [3]
    at.release(1, "h")
    assert at.acquire(["h"], make, [1]) == [4]
    # a sweep whose points ask for disjoint GPU sets runs them side by side on one host
    path = write_sweep(orch, f"""
name = "gpus"
playbook = "command"
hosts = ["test1"]
[spec]
cmd = {job("--steps", "8", "--sleep", "0.1")}
{FAST_SPEC}
[matrix]
gpus = [[0], [1]]
""")
    assert orch("sweep", "run", str(path), timeout=60).returncode == 0
    a, b = runs(orch)
    assert a["started_at"] < b["ended_at"] and b["started_at"] < a["ended_at"]


def test_sweep_watch_follows_each_point_to_the_end(orch):
    """A detached sweep on a real sshd host, followed from the record by `orch sweep watch`: each point's job
    holds after its steps until the watch has shown it running, so no point ends between two of its looks."""
    gate = orch.root / "gate"
    path = write_sweep(orch, f"""
name = "followed"
playbook = "command"
hosts = ["test1"]
objective = {{ metric = "score", goal = "max" }}
[spec]
cmd = "for i in $(seq 1 3); do echo step $i; done; until [ -e {gate}-$N ]; do sleep 0.05; done; echo orch-metric score=$N"
{FAST_SPEC}
[matrix]
"env.N" = ["1", "2"]
""")
    sweep_id = orch("sweep", "run", "--detach", str(path), check=0).stdout.strip()
    watch = orch.spawn("sweep", "watch", sweep_id)
    said = []
    try:
        for index, n in enumerate("12"):
            while not any(line.startswith(f"#{index} env.N={n} on test1: ") and " (running) · step " in line
                          for line in said):  # its phase and last line
                line = watch.stderr.readline() if watch.stderr else ""
                assert line, "".join(said)
                said.append(line.split(" ", 1)[1] if line[:1].isdigit() else line)  # after HH:MM:SS
            release(Path(f"{gate}-{n}"))
        _, rest = watch.communicate(timeout=120)
    finally:
        watch.kill()
    assert watch.returncode == 0, "".join(said) + rest
    stderr = "".join(said) + rest
    lines = [line.split(" ", 1)[1] if line[:1].isdigit() else line for line in rest.splitlines()]
    lines = [line.rstrip("\n") for line in said] + lines
    for index, n in enumerate("12"):
        mine = [line for line in lines if line.startswith(f"#{index} env.N={n} on test1: ")]
        assert mine[-1].endswith(f"succeeded, run {index + 1}, score={n}"), stderr
    assert f"sweep {sweep_id} (followed): succeeded" in lines, stderr
    assert stderr.splitlines()[-1] == "best: #1 env.N=2 (run 2): score=2 (higher is better)"
