"""End to end: the real `orch` CLI, real sshd hosts on loopback, real SQLite, real jobs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from orchtest import FAST, Orch, job_cmd
from safetensors.torch import load_file

HOSTS = ["local", "test1"]


@pytest.mark.parametrize("host", HOSTS)
def test_extract_hidden_states_end_to_end(orch, host):
    res = orch("run", "extract-hidden-states", "--host", host, "--set", "max_samples=6",
               "--set", "layers=[1,3,5]", *FAST, timeout=300)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "succeeded" and doc["exit_code"] == 0 and doc["phase"] == "finished"
    assert doc["metrics"]["samples"] == 6 and doc["metrics"]["tokens"] > 0
    assert doc["progress"]["label"] == "Extracting hidden states" and doc["progress"]["done"] == 6
    out = Path(doc["remote_dir"]) / "hidden_states"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layers"] == [1, 3, 5]
    tensors = {}
    for shard in manifest["shards"]:
        tensors.update(load_file(out / shard["file"]))
    sample = min(k for k in tensors if k.endswith(".layer1")).removesuffix(".layer1")
    seq = tensors[f"{sample}.input_ids"].shape[0]
    layers = [tensors[f"{sample}.layer{n}"] for n in (1, 3, 5)]
    assert all(t.shape == (seq, manifest["hidden_size"]) for t in layers)
    assert not layers[0].equal(layers[1]) and not layers[1].equal(layers[2])
    local = orch.root / "runs" / "1"
    assert json.loads((local / "outputs.json").read_text())["samples"] == 6
    assert json.loads((local / "spec.json").read_text())["spec"]["layers"] == [1, 3, 5]
    assert "Extraction complete" in (local / "log.tail").read_text()


@pytest.mark.parametrize("host", HOSTS)
def test_command_failing_after_progress(orch, host):
    res = orch("run", "command", "--host", host, "--set", job_cmd("--steps", "4", "--sleep", "0.05", "--crash"),
               *FAST)
    assert res.returncode == 1, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "failed" and doc["exit_code"] == 1 and doc["phase"] == "failed"
    assert doc["progress"]["done"] == 4 and doc["progress"]["total"] == 4
    assert doc["error"]["exception"] == "RuntimeError"
    assert doc["error"]["message"] == "the job hit a wall at the end"
    assert "exit code 1" in doc["reason"] and "RuntimeError" in doc["reason"]
    kinds = [e["kind"] for e in doc["events"]]
    assert "error" in kinds and kinds[-1] == "finished"


def test_environment_and_cwd_reach_the_job(orch, tmp_path):
    cwd = tmp_path / "a dir; with $(odd) `chars`"
    cwd.mkdir()
    res = orch("run", "command", "--host", "test1", "--set", "cmd=pwd; echo \"A=$A B=$B U=$PYTHONUNBUFFERED\"",
               "--set", f"cwd={cwd}", "--set", "env.A=x y", "--set", "env.B='$(touch /tmp/orch-pwned)'", *FAST)
    assert res.returncode == 0, res.stderr
    log = orch("logs", "1", "-n", "5", check=0).stdout
    assert str(cwd) in log
    assert "A=x y B='$(touch /tmp/orch-pwned)' U=1" in log  # env values are text, taken verbatim
    assert not Path("/tmp/orch-pwned").exists()


def test_dry_run_prints_commands_and_touches_nothing(orch, tmp_path):
    res = orch("run", "extract-hidden-states", "--host", "test1", "--dry-run", "--set", "model=/m; rm -rf /")
    assert res.returncode == 0, res.stderr
    assert "setsid" in res.stdout and "--model '/m; rm -rf /'" in res.stdout
    assert not (tmp_path / "remote1").exists()
    assert orch.status() == []


@pytest.mark.parametrize("args, message", [
    (["run", "extract-hidden-states", "--set", "batch_size=-1", "--set", "dtype=int4"], "batch_size"),
    (["run", "extract-hidden-states", "--host", "nowhere"], "unknown host"),
    (["run", "no-such-playbook"], "unknown playbook"),
    (["run", "command", "--set", "cmd=true", "--set", "env.X;Y=1"], "env"),
    (["status", "42"], "no run 42"),
    (["watch", "abc"], "not a run id"),
])
def test_bad_input_exit_2_one_line_nothing_touched(orch, tmp_path, args, message):
    res = orch(*args)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
    # one line per problem: the two bad spec values under one heading
    assert len(res.stderr.strip().splitlines()) == (3 if message == "batch_size" else 1)
    assert not (tmp_path / "remote1").exists()
    assert orch.status() == []


HOSTILE = ["; touch {m}", "$(touch {m})", "`touch {m}`", "' ; touch {m}; '", '" ; touch {m}; "', "x\ntouch {m}"]


def test_hostile_values_never_execute(orch, tmp_path):
    """Every string field that reaches the remote shell, with every kind of injection."""
    values = [v.format(m=tmp_path / f"pwned{i}") for i, v in enumerate(HOSTILE)]
    env = [a for i, v in enumerate(values) for a in ("--set", f"env.V{i}={v}")]
    res = orch("run", "extract-hidden-states", "--host", "test1", "--set", f"model={values[0]}",
               "--set", f"dataset={values[1]}", "--set", f"output_dir={tmp_path / 'o'}{values[2]}",
               "--set", "max_samples=1", *env, *FAST, timeout=120)
    assert res.returncode == 1  # the odd model path does not exist on the host
    assert f"no such file: {values[1]}" in (orch.root / "runs" / "1" / "log.tail").read_text()  # verbatim
    res = orch("run", "command", "--host", "test1", "--set", "cmd=true", "--set", f"cwd={tmp_path}/{values[3]}",
               *FAST)
    assert res.returncode == 1 and "exit code 97" in orch.status(2)["reason"]  # the odd cwd does not exist
    echo = "cmd=printf '%s|' " + " ".join(f'"$V{i}"' for i in range(len(values)))
    res = orch("run", "command", "--host", "test1", "--set", echo, *env, *FAST)
    assert res.returncode == 0, res.stderr
    assert orch("logs", "3", check=0).stdout == "|".join(values) + "|"
    assert not list(tmp_path.glob("pwned*"))


def test_unknown_host_key_is_refused(tmp_path, ssh_fleet, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # nothing trusted from the real ~/.ssh
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(test1={"known_hosts": str(empty), "workdir": str(tmp_path / "r")}))
    orch.env["HOME"] = str(tmp_path)
    res = orch("run", "command", "--host", "test1", "--set", "cmd=touch " + str(tmp_path / "ran"), *FAST)
    assert res.returncode == 2
    assert "unknown host key" in res.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "r").exists()
    assert orch("hosts", "--check", "--json").returncode == 1


def test_status_lists_newest_first_without_events(orch):
    for n in (1, 2):
        orch("run", "command", "--set", f"cmd=echo {n}", *FAST, check=0)
    docs = orch.status()
    assert [d["id"] for d in docs] == [2, 1]
    assert all("events" not in d for d in docs)
    one = orch.status(2)
    for key in ("id", "playbook", "host", "status", "phase", "progress", "error", "metrics", "exit_code",
                "created_at", "started_at", "ended_at", "spec", "events"):
        assert key in one
    assert "succeeded" in orch("status", check=0).stdout


def test_fatal_line_ends_the_run_and_stops_lingering_processes(orch, tmp_path):
    crash = tmp_path / "crash.sh"
    crash.write_text(
        "echo '[2026-11-29 10:00:00 TP0] Load weight begin. avail mem=139.02 GB'\n"
        "sleep 0.5\n"
        "printf '%s\\n' '[2026-11-29 10:00:01 TP0] Scheduler hit an exception: Traceback (most recent call last):'"
        " '  File \"scheduler.py\", line 2950, in run_scheduler_process' 'RuntimeError: NCCL communicator was aborted'\n"
        "sleep 300 & sleep 300\n"  # the process tree lingers, as a dying server's can
    )
    res = orch("run", "command", "--host", "test1", "--set", f"cmd=bash {crash}", "--set", "engine=sglang", *FAST,
               timeout=120)
    assert res.returncode == 1
    doc = orch.status(1)
    assert doc["status"] == "failed" and "fatal error in log" in doc["reason"]
    assert doc["error"]["exception"] == "RuntimeError" and doc["exit_code"] is None
    alive = os.popen(f"ps -eo pgid=,stat= | awk '$1 == {doc['pid']} && $2 !~ /^Z/'").read()
    assert alive == ""


def test_brackets_in_output_print_as_themselves(orch):
    orch("run", "command", "--set", "cmd=echo '[rank3]: [red]boom[/red]'; exit 3", *FAST)
    shown = orch("status", "1", check=0).stdout
    assert "[red]boom[/red]" in shown and "exit code 3" in shown


def test_logs_follow_streams_until_the_job_ends(orch):
    res = orch("run", "command", "--host", "test1", "--detach",
               "--set", "cmd=for i in 1 2 3 4 5; do echo line $i; sleep 0.3; done", *FAST, check=0)
    run_id = res.stdout.strip()
    follow = orch("logs", run_id, "-n", "1", "-f", timeout=60)
    assert follow.returncode == 0
    lines = follow.stdout.splitlines()
    assert lines[-1] == "line 5" and lines == sorted(set(lines), key=lines.index)  # in order, no repeats
