#!/usr/bin/env python3
"""Tests-only job: runs the debug patch set's own `orch_eagle3_debug` (taken from its diff) on CPU tensors,
logging through SGLang's log format, as a patched server's rank 0 does at each stage.

    python eagle3_debug_job.py PATH/02-logits_processor-concat.diff
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch


def patch_function(diff: str) -> str:
    """The added lines from the prefix constant to the end of the function (before `_is_npu`)."""
    added = [ln[1:] for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    start = next(i for i, ln in enumerate(added) if ln.startswith("_ORCH_EAGLE3_DEBUG_PREFIX"))
    end = next(i for i, ln in enumerate(added) if i > start and ln.startswith("        if aux_hidden_states"))
    return "\n".join(added[start:end])


def main() -> None:
    logging.basicConfig(format="[%(asctime)s TP0] %(message)s", datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO)
    namespace: dict[str, Any] = {"os": os, "torch": torch, "Any": Any, "Dict": dict,
                                 "logger": logging.getLogger("sglang.srt.layers.logits_processor")}
    exec(patch_function(Path(sys.argv[1]).read_text()), namespace)  # noqa: S102 - the patch's code, as it runs
    debug = namespace["orch_eagle3_debug"]
    torch.manual_seed(0)
    for step in range(2):
        for layer in (2, 30, 58):
            debug(f"target.capture layer_input={layer}", torch.randn(7, 16, dtype=torch.bfloat16) * (layer / 10))
        debug("target.final_hidden", torch.randn(7, 16))
        debug("logits.aux_in", [torch.ones(7, 16), torch.zeros(7, 16), None])
        debug("draft.input_hidden", torch.full((7, 48), 0.5, dtype=torch.float16))
    print("Decode batch, #running-req: 1, #token: 9, token usage: 0.01, accept len: 2.10, accept rate: 0.47, "
          "gen throughput (token/s): 94.00, #queue-req: 0, ", flush=True)


if __name__ == "__main__":
    main()
