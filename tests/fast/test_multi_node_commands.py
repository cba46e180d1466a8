"""The playbooks' launch lines on several nodes: one line for every node, the rendezvous filled in by bash
from the node's environment (NODE_ENV); on one node the lines are as they were."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchestrator.playbook import NODE_ENV, UsageError, rendezvous, rendezvous_args
from playbooks.command import Command
from playbooks.extract_hidden_states import ExtractHiddenStates, ExtractSpec, new_pipeline_script
from playbooks.serve_bench import ServeBench, ServeBenchSpec, script
from playbooks.serve_eagle3 import ServeEagle3, ServeEagle3Spec, engine_argv, server_command
from playbooks.train_draft import TrainDraft, train_command

NODE = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}
SGLANG_RDZV = ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.7:29511"]
TORCHRUN_RDZV = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.7", "--master-port", "29511"]


def words(line: str, node: dict[str, str] = NODE) -> list[str]:
    """The argv bash makes of a command line on a node with this environment."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **node}
    out = subprocess.run(["bash", "-c", f'printf "%s\\0" {line}'], env=env, capture_output=True, text=True,
                         check=True).stdout
    return out.split("\0")[:-1]


def serve_spec(**kw: Any) -> ServeEagle3Spec:
    return ServeEagle3Spec(model="/m/target model", draft_model="/m/draft", tp=16, **kw)


def test_the_playbooks_that_span_nodes_say_so() -> None:
    for playbook in (ServeEagle3, ServeBench, TrainDraft, ExtractHiddenStates, Command):
        assert playbook.multi_node, playbook.name


@pytest.mark.parametrize("style, expected", [("sglang", SGLANG_RDZV), ("torchrun", TORCHRUN_RDZV)])
def test_the_rendezvous_expands_to_each_nodes_own_values(style: str, expected: list[str]) -> None:
    assert words(rendezvous(style)) == expected
    head = {**NODE, "NODE_RANK": "0"}
    assert words(rendezvous(style), head) == [*expected[:3], "0", *expected[4:]]
    assert [w for w in rendezvous_args(style) if w.startswith("$")] == [
        "$NNODES", "$NODE_RANK", *(["$MASTER_ADDR:$MASTER_PORT"] if style == "sglang" else
                                   ["$MASTER_ADDR", "$MASTER_PORT"])]
    assert set(NODE_ENV) == set(NODE)


def test_serve_eagle3_on_one_node_is_unchanged() -> None:
    line = server_command(serve_spec(), "/py thon", ["--disable-cuda-graph"])
    assert line == ("'/py thon' -m sglang.launch_server --model-path '/m/target model' --speculative-algorithm EAGLE3 "
                    "--speculative-draft-model-path /m/draft --tp-size 16 --port 30000 --disable-cuda-graph")
    assert "--nnodes" not in engine_argv(serve_spec())


def test_serve_eagle3_on_two_nodes_carries_sglangs_rendezvous() -> None:
    spec = serve_spec(nodes=2, extra_args=["--host", "0.0.0.0"])
    line = server_command(spec, "/py thon", [])
    assert words(line) == ["/py thon", "-m", "sglang.launch_server", "--model-path", "/m/target model",
                           "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/m/draft",
                           "--tp-size", "16", "--port", "30000", "--host", "0.0.0.0", *SGLANG_RDZV]
    # a patch set's flag check sees the flags, their values as the job's bash gets them
    argv = engine_argv(ServeEagle3Spec(model="/m", draft_model="/d", nodes=2, debug=True))
    assert argv[-6:] == ["--nnodes", "$NNODES", "--node-rank", "$NODE_RANK", "--dist-init-addr",
                         "$MASTER_ADDR:$MASTER_PORT"]
    assert "--cuda-graph-backend-decode=disabled" in argv


def record_calls(tmp_path: Path) -> tuple[str, Path]:
    """A stand-in python that writes each call's argv (one word a line) to a file of its own in `calls/` and
    exits 0: calls of processes running at once never interleave."""
    calls = tmp_path / "calls"
    calls.mkdir()
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\nprintf "%s\\n" "$0" "$@" > "$(mktemp -p {calls})"\n')
    python.chmod(0o755)
    return str(python), calls


def run_script(text: str, tmp_path: Path, node: dict[str, str] | None) -> list[list[str]]:
    """The calls the script made, sorted; those of an earlier run are taken away first."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(node or {})}
    for earlier in (tmp_path / "calls").iterdir():
        earlier.unlink()
    # SIGTERM ignored from the start (inherited): a script's stop of its server at its end, which may come
    # before the stand-in wrote its call, does not lose the call; its output captured: run returns once every
    # process the script started in the background let go of it
    subprocess.run(["bash", "-c", text], env=env, cwd=tmp_path, check=True, timeout=60, capture_output=True,
                   preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    return sorted(call.read_text().splitlines() for call in (tmp_path / "calls").iterdir())


def test_serve_bench_on_one_node_is_unchanged(tmp_path: Path) -> None:
    python, _ = record_calls(tmp_path)
    spec = ServeBenchSpec(model="/m", draft_model="/d")
    calls = run_script(script(spec, python, server_command(spec, python, []), []), tmp_path, None)
    assert [c[1:3] if c[1] == "wait_http.py" else c[1:4] for c in calls] == [
        ["--backend", "sglang", "--base-url"], ["-m", "sglang.launch_server", "--model-path"],
        ["wait_http.py", "free"], ["wait_http.py", "up"]]
    assert not any("--nnodes" in c for c in calls)


def test_serve_bench_on_two_nodes_the_head_benchmarks_the_others_only_serve(tmp_path: Path) -> None:
    python, _ = record_calls(tmp_path)
    spec = ServeBenchSpec(model="/m", draft_model="/d", nodes=2)
    text = script(spec, python, server_command(spec, python, []), [])
    worker = run_script(text, tmp_path, NODE)
    assert len(worker) == 2 and worker[0][1:3] == ["-m", "sglang.launch_server"]  # no wait for /health, no benchmark
    assert worker[0][-6:] == SGLANG_RDZV and worker[1][1:3] == ["wait_http.py", "free"]
    head = run_script(text, tmp_path, {**NODE, "NODE_RANK": "0"})
    server = next(c for c in head if c[1:3] == ["-m", "sglang.launch_server"])
    assert server[-6:] == [*SGLANG_RDZV[:3], "0", *SGLANG_RDZV[4:]]
    assert sorted(c[1] for c in head) == ["--backend", "-m", "wait_http.py", "wait_http.py"]


def test_train_draft_runs_under_torchrun_on_several_nodes() -> None:
    argv = ["/py", "/s/train.py", "--verifier-name-or-path", "/m v", "--save-path", "/out"]
    assert train_command(argv, 1) == "/py /s/train.py --verifier-name-or-path '/m v' --save-path /out"
    assert words(train_command(argv, 2)) == ["/py", "-m", "torch.distributed.run", *TORCHRUN_RDZV,
                                             "--nproc-per-node", "gpu", *argv[1:]]


def extract_spec(**kw: Any) -> ExtractSpec:
    return ExtractSpec(backend="speculators", model="/m", dataset="/d", scripts_dir="/s", tp=8, **kw)


def test_extract_on_one_node_is_unchanged(tmp_path: Path) -> None:
    python, _ = record_calls(tmp_path)
    calls = run_script(new_pipeline_script(extract_spec(), python, "/out", "/store"), tmp_path, None)
    server = next(c for c in calls if c[1] == "/s/launch_vllm.py")
    assert server[1:] == ["/s/launch_vllm.py", "/m", "--hidden-states-path", "/store", "--", "--host", "127.0.0.1",
                          "--port", "8000", "--tensor-parallel-size", "8"]


def test_extract_on_two_nodes_spans_them_with_vllms_mp_backend(tmp_path: Path) -> None:
    python, _ = record_calls(tmp_path)
    text = new_pipeline_script(extract_spec(nodes=2), python, "/out", "/store")
    worker = run_script(text, tmp_path, NODE)
    assert [c[1] for c in worker] == ["/s/launch_vllm.py", "wait_http.py"]  # no generator on a worker
    assert worker[0][-13:] == ["--distributed-executor-backend", "mp", *TORCHRUN_RDZV, "--headless",
                               "--api-server-count", "0"]
    head = run_script(text, tmp_path, {**NODE, "NODE_RANK": "0"})
    server = next(c for c in head if c[1] == "/s/launch_vllm.py")
    assert server[-10:] == ["--distributed-executor-backend", "mp", *TORCHRUN_RDZV[:3], "0", *TORCHRUN_RDZV[4:]]
    assert "/s/data_generation_offline.py" in [c[1] for c in head]


@pytest.mark.parametrize("spec", [
    ExtractSpec(nodes=2),  # backend hf: one process
    ExtractSpec(backend="speculators", model="/m", dataset="/d", scripts_dir="/s", speculators_version="0.4.1",
                nodes=2),  # vLLM in-process: its script takes no rendezvous
])
def test_extract_refuses_several_nodes_where_it_cannot_span_them(spec: ExtractSpec) -> None:
    with pytest.raises(UsageError, match="nodes = 1"):
        ExtractHiddenStates().check_inputs(spec, None, None)  # type: ignore[arg-type]
    ExtractHiddenStates().check_inputs(spec.model_copy(update={"nodes": 1}), None, None)  # type: ignore[arg-type]
    ExtractHiddenStates().check_inputs(extract_spec(nodes=2), None, None)  # type: ignore[arg-type]
