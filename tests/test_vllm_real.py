"""The real vLLM (its CPU build, `make engine`) under orch on this machine's `local` host.

Nothing here stands in for the engine: tiny models made on the fly (tests/engines/tiny_models.py), real
servers, real benchmarks, real failures. One worker runs this file and tests/test_vllm_numbers.py
(tests/conftest.py), so one of their servers serves at a time (the starts that only fail are launched together:
each is mostly Python imports on one core); every server gets a KV size (without one vLLM takes nearly all the
memory), `--enforce-eager` and loopback. A server that serves benchmarks, its own stats, a clean stop and a
killed engine core: tests/test_vllm_numbers.py, whose servers also serve the nightly benchmarks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from orchtest import Orch, processes_of
from sshd import free_port

pytest_plugins = ["vllm_env"]  # tiny_models
pytestmark = pytest.mark.vllm

KV = str(128 << 20)  # 128 MiB of KV cache: a server in about 2 GiB
START_S = 600  # a server's start on a loaded 2-core machine
ENV = '{HF_HUB_OFFLINE = "1", VLLM_NO_USAGE_STATS = "1", TOKENIZERS_PARALLELISM = "false"}'  # TOML, as --set takes


@pytest.fixture(scope="module")
def models(tiny_models: dict[str, Path]) -> dict[str, str]:
    return {name: str(path) for name, path in tiny_models.items()}


@pytest.fixture
def orch_hosts() -> str:
    return ""  # the built-in `local` host only


@pytest.fixture(autouse=True)
def no_server_left(orch: Orch) -> Iterator[None]:
    """A failing test leaves no server behind."""
    yield
    for run in orch.status():
        if run["status"] in ("running", "launching", "preparing"):
            orch("stop", str(run["id"]), "--grace", "10")


def serve(orch: Orch, models: dict[str, str], *sets: str, until_ready: bool = True, kv: str | None = KV,
          detach: bool = False, port: int | None = None) -> tuple[int, int]:
    """A serve-vllm run of the tiny target: (run id, port); `detach` returns once it is launched."""
    from vllm_env import engine_python  # the plugin's module, once pytest has it

    port = port or free_port("127.0.0.1")
    args = ["run", "serve-vllm", "--json", "--set", f"model={models['target']}", "--set", f"port={port}",
            "--set", f"python={engine_python()}", *(["--set", f"kv_cache_bytes={kv}"] if kv else []), "--set", "enforce_eager=true",
            "--set", "max_model_len=512", "--set", f"env={ENV}", "--set", "poll_min=0.2", "--set", "poll_max=1"]
    res = orch(*args, *sets, *(["--until-ready"] if until_ready else []), *(["--detach"] if detach else []),
               timeout=START_S)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    return int(doc["id"]), port


def test_speculative_decoding_records_acceptance(orch, models):
    """ngram in one serve-and-bench job, which stops its own server at its end: a success, whatever vLLM logs
    while it shuts down, with the acceptance recorded (EAGLE-3: tests/test_vllm_eagle3_debug.py)."""
    from vllm_env import engine_python

    ngram = '{method = "ngram", num_speculative_tokens = 3, prompt_lookup_max = 3}'
    res = orch("run", "serve-bench-vllm", "--set", f"model={models['target']}", "--set", f"python={engine_python()}",
               "--set", f"port={free_port('127.0.0.1')}", "--set", f"kv_cache_bytes={KV}", "--set", "enforce_eager=true",
               "--set", "max_model_len=512", "--set", f"env={ENV}", "--set", f"speculative_config={ngram}",
               # ngram drafts once the output repeats itself: 64 tokens give it room
               "--set", "bench={num_prompts = 16, input_len = 32, output_len = 64}", timeout=START_S)
    doc = orch.status(1)
    assert res.returncode == 0 and doc["status"] == "succeeded" and doc["error"] is None, doc
    assert doc["metrics"]["accept_len"] > 1 and doc["metrics"]["completed"] == 16, doc["metrics"]


# The servers below only fail, so their starts (mostly Python imports and profiling, one core each) run at the
# same time rather than one after another: one fixture launches them all, each in a workspace of its own (the
# local host's lease is a workspace's), and each test waits for its own. A killed engine core: on the nightly
# test's last server (tests/test_vllm_numbers.py).
FAILURES = ["missing-model", "kv-too-small", "too-long-for-the-model", "memory-refusal"]


def failure_sets(case: str, root: Path) -> list[str]:
    return {"missing-model": ["--set", f"model={root / 'no-such-model'}"],
            "kv-too-small": ["--set", "max_model_len=2048", "--set", f"kv_cache_bytes={1 << 20}"],
            "too-long-for-the-model": ["--set", "max_model_len=100000"],
            # 99 % of the machine's memory, never all free: refused before anything is allocated (with no KV
            # size given, that fraction is what vLLM would take)
            "memory-refusal": ["--set", "gpu_memory_utilization=0.99"]}[case]


@pytest.fixture(scope="module")
def launched(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Orch, int]]]:
    """The failing starts, all launched at once: case -> (orch, run)."""
    from orchtest import stop_background_watchers

    with pytest.MonkeyPatch.context() as mp:
        home = tmp_path_factory.mktemp("launched-home")  # their watchers outlive any one test's HOME
        mp.setenv("HOME", str(home))
        runs: dict[str, tuple[Orch, int]] = {}
        ports: set[int] = set()
        while len(ports) < len(FAILURES):  # one each: servers started at once never share a port
            ports.add(free_port("127.0.0.1"))
        try:
            for case, port in zip(FAILURES, sorted(ports)):
                root = tmp_path_factory.mktemp(case)
                orch = Orch(root / "ws")
                run, _ = serve(orch, models, *failure_sets(case, root), until_ready=False, detach=True, port=port,
                               kv=None if case == "memory-refusal" else KV)
                runs[case] = (orch, run)
            yield runs
        finally:
            for orch, run in runs.values():
                if orch.status(run)["status"] in ("running", "launching", "preparing"):
                    orch("stop", str(run), "--grace", "10")
            for orch, run in runs.values():  # their watchers stop what lingers, then end: never killed midway
                orch.wait_finished(run)
            stop_background_watchers(home)


@pytest.mark.parametrize("case", FAILURES)
def test_startup_failures_name_their_cause(launched, case):
    orch, run = launched[case]
    doc = orch.wait_for(run, lambda d: d["status"] not in ("running", "launching", "preparing"), timeout=START_S)
    assert doc["status"] == "failed", doc
    # nothing of the server outlives its failed start (vLLM's API server can hang on an engine core that died)
    orch.wait_finished(run)
    assert processes_of(orch.root, "vllm") == []
    error = doc["error"]
    said = f"{error['message']} {error.get('hint') or ''}".lower()
    if case == "missing-model":
        assert "no such model directory" in said or "does not exist" in said, error
    elif case == "kv-too-small":
        assert "kv cache" in said and ("vllm_cpu_kvcache_space" in said or "kv-cache-memory-bytes" in said), error
        assert "nvidia-smi" not in said and "gpu" not in (error.get("hint") or "").lower(), error
    elif case == "too-long-for-the-model":  # the reason is on the line after pydantic's header
        assert "greater than the derived max_model_len" in said, error
    else:
        assert "memory" in said and "nvidia-smi" not in said and "free the gpus" not in said, error
