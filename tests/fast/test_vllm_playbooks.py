"""serve-vllm's command line and bench-serving's choice of benchmark, in process (the real engine runs them in
tests/test_vllm_real.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from orchestrator.config.hosts import local_host
from orchestrator.errors import NotFound, UsageError
from orchestrator.store.record import Status
from playbooks.bench_serving import BenchServingSpec, bench_argv, target
from playbooks.serve_bench import ServeBenchVllmSpec, script
from playbooks.serve_vllm import ServeVllmSpec, server_args, server_command, server_url


def test_the_speculative_table_goes_to_vllm_as_json_and_the_shortcut_sets_its_tokens() -> None:
    spec = ServeVllmSpec(model="/m", speculative_config={"method": "eagle3", "model": "/d"}, num_speculative_tokens=5,
                         kv_cache_bytes=1 << 27, enforce_eager=True, tp=2)
    args = server_args(spec)
    assert args[:5] == ["/m", "--host", "127.0.0.1", "--port", "8000"]
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 5}
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(1 << 27)
    assert "--enforce-eager" in args and args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--pipeline-parallel-size" not in args  # sizes of 1 are vLLM's defaults: not spelled out
    assert "--max-num-seqs" not in args and "--block-size" not in args  # unset: vLLM's own defaults


def test_scheduler_settings_a_search_varies_are_flags_of_their_own() -> None:
    args = server_args(ServeVllmSpec(model="/m", max_num_seqs=16, max_num_batched_tokens=2048, block_size=32))
    assert [args[args.index(f) + 1] for f in ("--max-num-seqs", "--max-num-batched-tokens", "--block-size")] == [
        "16", "2048", "32"]


@pytest.mark.parametrize("fields", [
    {"speculative_config": {"num_speculative_tokens": 3}},  # neither a method nor a draft
    {"num_speculative_tokens": 3},  # a shortcut into no table
    {"bind": "127.0.0.1; rm -rf /"},
])
def test_bad_speculative_settings_are_refused(fields: dict) -> None:
    with pytest.raises(ValidationError):
        ServeVllmSpec(model="/m", **fields)


def test_several_nodes_use_vllms_multi_node_form_and_the_others_run_headless() -> None:
    line = server_command(ServeVllmSpec(model="/m", nodes=2, tp=16), "python")
    assert "--distributed-executor-backend mp" in line and '--node-rank "$NODE_RANK"' in line
    assert '$([ "$NODE_RANK" != 0 ] && echo --headless)' in line


def test_the_url_is_the_hosts_when_the_server_listens_everywhere() -> None:
    host = local_host(Path("/tmp"))
    assert server_url(ServeVllmSpec(model="/m", port=9), host) == "http://127.0.0.1:9"
    assert server_url(ServeVllmSpec(model="/m", port=9, bind="0.0.0.0"), host) == "http://127.0.0.1:9"


def server_run(playbook: str, **spec: object) -> SimpleNamespace:
    return SimpleNamespace(id=7, playbook=playbook, host="local", status=Status.RUNNING, phase="ready",
                           spec={"port": 8123, **spec})


def finder(run: SimpleNamespace):
    def find(run_id: int) -> SimpleNamespace:
        if run_id != run.id:
            raise NotFound(f"no run {run_id}")
        return run
    return find


def test_a_vllm_server_gets_vllms_benchmark_with_its_model_and_python() -> None:
    run = server_run("serve-vllm", model="/m", served_model_name="tiny", python="/engine/bin/python")
    spec = BenchServingSpec(server=7, num_prompts=16)
    t = target(finder(run), spec, local_host(Path("/tmp")))
    assert (t.url, t.engine, t.model, t.python) == ("http://127.0.0.1:8123", "vllm", "tiny", "/engine/bin/python")
    argv = bench_argv("py", spec, t.url, ["-m", "vllm.entrypoints.cli.main", "bench", "serve"], t.engine, t.model)
    assert argv[argv.index("--backend") + 1] == "vllm" and argv[argv.index("--model") + 1] == "tiny"
    assert argv[argv.index("--dataset-name") + 1] == "random"  # vLLM's random needs no download


def test_an_sglang_server_keeps_sglangs_benchmark() -> None:
    t = target(finder(server_run("serve-eagle3", model="/m")), BenchServingSpec(server=7), local_host(Path("/tmp")))
    assert (t.engine, t.model) == ("sglang", None)
    argv = bench_argv("py", BenchServingSpec(server=7), t.url, [], t.engine, t.model)
    assert argv[argv.index("--dataset-name") + 1] == "random-ids" and "--model" not in argv


@pytest.mark.parametrize("spec, says", [
    (BenchServingSpec(server=7, engine="sglang"), "is a vllm server"),
    (BenchServingSpec(url="http://h:1", engine="vllm"), "model"),
    (BenchServingSpec(server=8), "no run 8"),
])
def test_a_benchmark_that_cannot_fit_its_server_is_refused(spec: BenchServingSpec, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        target(finder(server_run("serve-vllm", model="/m")), spec, local_host(Path("/tmp")))


def test_serve_bench_vllm_serves_waits_benches_and_stops() -> None:
    spec = ServeBenchVllmSpec(model="/m", port=8200, bench={"num_prompts": 4})
    text = script(spec, "py", server_command(spec, "py"), ["-m", "vllm.entrypoints.cli.main", "bench", "serve"], "vllm")
    lines = text.splitlines()
    assert lines[1].startswith("py -m vllm.entrypoints.cli.main serve /m") and lines[1].endswith("&")
    assert "trap stop_server EXIT" in text
    assert lines[-1].startswith("py -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url http://127.0.0.1:8200")
    assert "--model /m" in lines[-1]
