#!/usr/bin/env python3
"""Tests-only job, run with the real vLLM engine env's python: loads vLLM modules from a folder of (patched)
copies in place of the installed ones, and drives what the shipped vLLM patch sets change.

    python vllm_patch_probe.py connector SITE OUT   # ExampleHiddenStatesConnector on a CPU KV cache
    python vllm_patch_probe.py debug SITE           # the EAGLE-3 debug helper, and the patched modules import

SITE: the site-packages holding the copies ("-": the installed modules). Prints one JSON line; the debug
helper's own log lines go to vLLM's logger (stdout) before it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
DEBUG_MODULES = ("vllm.model_executor.models.llama_eagle3", "vllm.v1.spec_decode.llm_base_proposer",
                 "vllm.v1.worker.gpu_model_runner")


def load(name: str, site: str):
    """The module `name`, from SITE's copy of its file when SITE is given; its package is vLLM's own."""
    if site == "-":
        return importlib.import_module(name)
    importlib.import_module(name.rpartition(".")[0])
    spec = importlib.util.spec_from_file_location(name, os.path.join(site, *name.split(".")) + ".py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def connector(site: str, out: str) -> dict:
    import torch
    from safetensors.torch import load_file

    mod = load(CONNECTOR, site)
    # The worker side only, as register_kv_caches leaves it: [blocks, heads, block size, head size] on the CPU.
    c = object.__new__(mod.ExampleHiddenStatesConnector)
    kv = torch.arange(3 * 2 * 4 * 8, dtype=torch.float32).reshape(3, 2, 4, 8).to(torch.bfloat16)
    c._kv_cache, c._block_size, c._is_tp_rank_zero = kv, 4, True
    c._executor, c._req_futures, c._lock_fds, c._req_copy_events = ThreadPoolExecutor(1), {}, {}, {}
    c._accumulated_finished_req_ids, c._connector_metadata, c._copy_stream, c.use_lock = set(), None, None, True
    path = os.path.join(out, "hs_0.safetensors")
    pending = mod.PendingSave("req-0", path, torch.tensor([5, 6, 7, 8, 9]), [2, 0])
    try:
        c._submit_async_write(pending)
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    c._executor.shutdown(wait=True)
    done, _ = c.get_finished({"req-0"})
    saved = load_file(path)
    slots = [8, 9, 10, 11, 0]  # blocks 2 then 0, four slots each: the first five tokens
    expected = torch.stack([kv[s // 4, :, s % 4] for s in slots])
    return {"done": sorted(done or ()), "shape": list(saved["hidden_states"].shape),
            "dtype": str(saved["hidden_states"].dtype), "token_ids": saved["token_ids"].tolist(),
            "equal": bool(torch.equal(saved["hidden_states"], expected)),
            "locked": os.path.exists(path + ".lock")}


def debug(site: str) -> dict:
    import torch
    from vllm.logger import _configure_vllm_root_logger

    _configure_vllm_root_logger()  # as a server's entry point does: vLLM's own handler and line format
    modules = [load(name, site) for name in DEBUG_MODULES]
    helper = modules[0].orch_eagle3_debug
    for _ in range(3):  # ORCH_EAGLE3_DEBUG_LIMIT=2: the third call is not logged
        helper("target.capture layer_input=2", torch.full((5, 16), -0.5, dtype=torch.bfloat16))
    helper("draft.input_hidden", [torch.ones(5, 48), None])
    sys.stdout.flush()
    return {"imported": [m.__name__ for m in modules],
            "wired": [hasattr(m, "orch_eagle3_debug") for m in modules]}


def main() -> None:
    what, site = sys.argv[1], sys.argv[2]
    result = connector(site, sys.argv[3]) if what == "connector" else debug(site)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
