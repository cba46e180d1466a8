"""`orch run --replace`: the run holding the host or GPU set is stopped through the cancel path, then the
new run starts. Real sshd hosts, the SGLang emulator as the server, the real sglang source patched."""

from __future__ import annotations

import json
import os
from pathlib import Path

from orchtest import Orch
from sshd import free_port
from test_serve import FAKES, group_alive, group_members, kinds, no_server_left_behind, serve_sets, workspace

pytest_plugins = ["engine_src"]  # engine: real sglang 0.5.23 source

__all__ = ["no_server_left_behind"]  # the autouse fixture: no server outlives a failing test

DEBUG = "sglang-eagle3-hidden-debug"


def test_replace_stops_the_detached_server_holding_the_gpus_then_starts(tmp_path, ssh_fleet, engine):
    orch = workspace(tmp_path, ssh_fleet, python=engine.python)
    before = engine.snapshot("sglang")
    port = free_port("127.0.0.1")
    res = orch("run", "serve-eagle3", "--host", "test1", "--detach", "--set", "debug=true", "--set", "gpus=[0, 1]",
               *serve_sets(port, "--serve-after", "600"))
    assert res.returncode == 0, res.stderr
    old = orch.wait_for(1, lambda d: d["phase"] == "ready")
    assert engine.snapshot("sglang") != before  # the debug set is applied while it serves

    new_port = free_port("127.0.0.1")
    busy = orch("run", "serve-eagle3", "--host", "test1", "--set", "gpus=[1]", "--until-ready",
                *serve_sets(new_port, "--serve-after", "600"))
    assert busy.returncode == 1 and "busy with run 1" in busy.stderr, busy.stderr
    assert len(orch.status()) == 1  # refused: no run was created

    res = orch("run", "serve-eagle3", "--host", "test1", "--set", "gpus=[1]", "--until-ready", "--replace",
               *serve_sets(new_port, "--serve-after", "600"))
    assert res.returncode == 0, res.stderr
    first = orch.status(1)
    assert first["status"] == "cancelled" and first["reason"] == "replaced by run 2", first["reason"]
    assert not group_alive(old["pid"])
    assert "reverted" in kinds(first, "patch")[-1]  # its end steps ran: the patch set is reverted
    assert engine.snapshot("sglang") == before
    assert {"log tail", "patch revert", "notify"} <= set(kinds(first, "finished"))
    assert (tmp_path / "ws" / "runs" / "1" / "log.tail").exists()
    new = orch.status(2)
    assert new["status"] == "running" and new["phase"] == "ready"
    assert kinds(new, "replaced")[0].startswith("run 1 (serve-eagle3): process group ")
    res = orch("stop", "2", "--grace", "3")
    assert res.returncode == 0, res.stderr


def test_replace_waits_until_the_holders_gpus_are_free(tmp_path):
    """On the local host, the tests-only nvidia-smi showing the old server on both GPUs."""
    orch = Orch(tmp_path / "ws")
    gpus = tmp_path / "gpu-state.json"
    state = {"gpus": [{"index": i, "uuid": f"GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e9{i}", "memory_total": 143771,
                       "utilization": 0} for i in (0, 1)], "processes": []}
    gpus.write_text(json.dumps(state))
    orch.env.update(PATH=f"{FAKES}{os.pathsep}{os.environ['PATH']}", ORCH_FAKE_GPU_STATE=str(gpus))
    port = free_port("127.0.0.1")
    res = orch("run", "serve-eagle3", "--detach", *serve_sets(port, "--serve-after", "600"))
    assert res.returncode == 0, res.stderr
    old = orch.wait_for(1, lambda d: d["phase"] == "ready")
    (server,) = group_members(old["pid"], "sglang_emulator")
    state["processes"] = [{"pid": server, "gpu": i, "used_memory": 70000} for i in (0, 1)]
    gpus.write_text(json.dumps(state))

    res = orch("run", "command", "--replace", "--set", "cmd=echo replaced", "--set", "poll_min=0.05")
    assert res.returncode == 0, res.stderr
    first = orch.status(1)
    assert first["status"] == "cancelled" and first["reason"] == "replaced by run 2"
    assert "GPUs 0,1 free after stop" in kinds(first, "gpu")
    second = orch.status(2)
    assert second["status"] == "succeeded"
    (replaced,) = kinds(second, "replaced")
    assert replaced.startswith("run 1 (serve-eagle3): process group ") and replaced.endswith("; GPUs 0,1 free")
    assert Path(tmp_path / "ws" / "runs" / "1" / "log.tail").exists()
