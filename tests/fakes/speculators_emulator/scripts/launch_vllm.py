#!/usr/bin/env python3
"""Tests-only stand-in for speculators' scripts/launch_vllm.py (>= 0.5) and the vLLM server it execs.

`launch_vllm.py MODEL [--target-layer-ids N ...] [--[no-]include-last-layer] [--trust-remote-code] -- <vllm serve
flags>`, as hsc-v0.7.0's: its own --trust-remote-code stays with it (vLLM sees one only after `--`):
prints `Running command:` and the `vllm serve` line with the extract_hidden_states speculative config,
then what vLLM 0.33 prints while starting (worker-prefixed lines, the shard bar, `Starting vLLM server on
http://HOST:PORT`, uvicorn's startup line) and serves on loopback: GET /health, GET /v1/models, and
POST /v1/completions, which writes the prompt's hidden states (`token_ids`, `hidden_states`
[layers, seq, hidden]) to a safetensors file and answers its path in `kv_transfer_params`, as the
hidden-states connector does. SIGTERM shuts it down.

Test knob (environment): SPECULATORS_EMULATOR_SERVER_DIES_AFTER=N stops answering after N completions.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

HIDDEN = 16
PID = os.getpid()
DIES_AFTER = int(os.environ.get("SPECULATORS_EMULATOR_SERVER_DIES_AFTER", "-1"))


def log(name: str, text: str, where: str = "api_server.py:1500", level: str = "INFO") -> None:
    sys.stderr.write(f"({name} pid={PID}) {level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {text}\n")
    sys.stderr.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description="Launch vLLM for hidden states extraction")
    ap.add_argument("model")
    ap.add_argument("--hidden-states-path", default=None)
    ap.add_argument("--target-layer-ids", type=int, nargs="+")
    ap.add_argument("--include-last-layer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    args, vllm_args = ap.parse_known_args()
    if "--" in vllm_args:
        vllm_args.remove("--")
    serve = argparse.ArgumentParser(prog="vllm serve")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--tensor-parallel-size", type=int, default=1)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--trust-remote-code", action="store_true")
    sargs, _other = serve.parse_known_args(vllm_args)

    config = Path(args.model) / "config.json"
    num_layers = json.loads(config.read_text())["num_hidden_layers"] if config.exists() else 32
    if args.target_layer_ids:
        layers = list(args.target_layer_ids)
        if args.include_last_layer and num_layers not in layers:
            layers.append(num_layers)
    else:
        layers = [2, num_layers // 2, num_layers - 3, num_layers]
    spec_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
    store = Path(args.hidden_states_path or tempfile.mkdtemp(prefix="hidden_states-", dir="."))
    store.mkdir(parents=True, exist_ok=True)
    kv_config = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    print("Running command:")
    print(" ".join([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--speculative_config",
                    json.dumps(spec_config), "--kv_transfer_config", json.dumps(kv_config), *vllm_args]), flush=True)
    if args.dry_run:
        return 0

    log("APIServer", "vLLM API server version 0.33.0")
    log("APIServer", f"non-default args: {{'model': '{args.model}', 'port': {sargs.port}, "
                     f"'tensor_parallel_size': {sargs.tensor_parallel_size}, 'max_model_len': {sargs.max_model_len}"
                     + (", 'trust_remote_code': True" if sargs.trust_remote_code else "") + "}",
        "utils.py:233")
    log("EngineCore", f"Starting to load model {args.model}...", "gpu_model_runner.py:3000")
    for n in range(5):
        sys.stderr.write(f"Loading safetensors checkpoint shards: {25 * n:3d}% Completed | {n}/4 "
                         f"[00:{n:02d}<00:{4 - n:02d},  1.00it/s]\n")
        sys.stderr.flush()
        time.sleep(0.01)
    log("EngineCore", "Loading weights took 0.04 seconds", "default_loader.py:300")

    served = {"n": 0}
    rng = np.random.default_rng(0)

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, code: int, body: dict | None = None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            sys.stderr.write(f'(APIServer pid={PID}) INFO:     {self.client_address[0]}:{self.client_address[1]} - '
                             f'"{self.command} {self.path} HTTP/1.1" {code}\n')
            sys.stderr.flush()

        def do_GET(self) -> None:
            if self.path == "/health":
                self.reply(200)
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": args.model, "object": "model"}]})
            else:
                self.reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self.reply(404, {"error": "not found"})
                return
            if DIES_AFTER >= 0 and served["n"] >= DIES_AFTER:
                self.close_connection = True
                self.connection.shutdown(2)  # a server gone bad: the connection drops with no answer
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = body["prompt"]
            served["n"] += 1
            path = store / f"req-{served['n']}.safetensors"
            states = np.stack([rng.standard_normal((len(ids), HIDDEN)).astype(np.float32) + layer
                               for layer in layers])
            save_file({"token_ids": np.asarray(ids, dtype=np.int64), "hidden_states": states}, str(path))
            self.reply(200, {"id": f"cmpl-{served['n']}", "object": "text_completion", "model": args.model,
                             "choices": [{"index": 0, "text": "x", "prompt_token_ids": ids}],
                             "kv_transfer_params": {"hidden_states_path": str(path)}})

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((sargs.host, sargs.port), Handler)

    def stop(signum: int, frame: object) -> None:
        log("APIServer", "Shutting down FastAPI HTTP server.", "launcher.py:110")
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    log("APIServer", f"Starting vLLM server on http://{sargs.host}:{sargs.port}", "api_server.py:1600")
    log("APIServer", "Application startup complete.", "on.py:62")
    server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
