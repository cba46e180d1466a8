#!/usr/bin/env python3
"""Tests-only stand-in for `python -m sglang.launch_server`: prints what SGLang 0.5.23 prints, with timing.

Target (and draft) shard loading as one `\r`-redrawn bar, load/KV/graph markers, the ready line, decode
stats; or a crash / a stall at a chosen point. Serves /health on a loopback port when --port is given
(503 while starting, 200 once ready). `--events FILE` appends `epoch-seconds event` lines so a benchmark
knows exactly when each thing was printed.

Multi-node, as SGLang's `--nnodes N --node-rank R --dist-init-addr HOST:PORT` (`--tp-size` is over all
nodes; each node prints as its first TP rank, tp_size / N * R): the head (rank 0) listens on PORT (all
interfaces) and waits in "Init torch distributed" until the N-1 other ranks have connected, then goes on
as a single node does. Every other rank connects to the head (retrying until it listens), prints its own
load, KV cache and CUDA graph lines but no ready line and no /health (only the head runs the HTTP
server), then stays up while connected. When a peer's connection drops, the head hangs as an NCCL group
with a dead rank does: it prints nothing more, never exits, and /health answers 503; a rank whose head
connection drops prints an NCCL traceback and exits 137. Events: `joined:R` (head), `peer-lost`,
`loaded` (a worker done loading), `head-lost`.
"""

from __future__ import annotations

import argparse
import http.server
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

STATE = {"ready": False, "hung": False}
GATES: dict[str, str] = {}
NODE = {"tp0": 0}  # this node's first TP rank, the rank its lines carry
PEERS: list[socket.socket] = []  # the head's connections to the other ranks, kept open


def hold_if_hung() -> None:
    """A group that lost a rank hangs in its next collective: nothing more is printed, nothing exits."""
    while STATE["hung"]:
        time.sleep(3600)


def log(msg: str, tp: int | None = None) -> None:
    hold_if_hung()
    now = datetime.now()
    rank = f" TP{tp}" if tp is not None else ""
    sys.stderr.write(f"[{now:%Y-%m-%d %H:%M:%S}{rank}] {msg}\n")
    sys.stderr.flush()


def mark(path: str | None, event: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.6f} {event}\n")


def pause_here(point: str, events: str | None) -> None:
    """Held at `point` (`shard:N`, `ready`, `decode:N`, `end`) until the test creates its file (--pause):
    the test paces the server. FILE.reached is created first, and a `paused POINT` event marked."""
    if point in GATES:
        gate = Path(GATES[point])
        mark(events, f"paused:{point}")
        Path(f"{gate}.reached").touch()
        while not gate.exists():
            time.sleep(0.02)


def fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def shard_bar(n: int, total: int, elapsed: float) -> str:
    rate = n / elapsed if elapsed > 0 and n else 0.0
    remaining = (total - n) / rate if rate else None
    rate_s = "?it/s" if not rate else (f"{rate:5.2f}it/s" if rate >= 1 else f"{1 / rate:5.2f}s/it")
    return (f"Loading safetensors checkpoint shards: {100 * n / total:3.0f}% Completed | {n}/{total} "
            f"[{fmt(elapsed)}<{fmt(remaining) if remaining is not None else '?'}, {rate_s}]")


def load(args: argparse.Namespace, shards: int, cls: str, stop_at: int | None) -> None:
    log("Load weight begin. avail mem=139.02 GB", NODE["tp0"])
    t0 = time.time()
    sys.stderr.write("\r" + shard_bar(0, shards, 0.0))
    sys.stderr.flush()
    for i in range(1, shards + 1):
        time.sleep(args.shard_time)
        hold_if_hung()
        if stop_at is not None and i == stop_at:
            fail_or_stall(args)
        # the 0.5.23 format: no newline between redraws, one long physical line
        sys.stderr.write("\r" + shard_bar(i, shards, time.time() - t0))
        sys.stderr.flush()
        if cls != "LlamaForCausalLMEagle3":
            pause_here(f"shard:{i}", args.events)
    sys.stderr.write("\n")
    log(f"Load weight end. elapsed={time.time() - t0:.2f} s, type={cls}, avail mem=74.51 GB, mem usage=64.51 GB.", NODE["tp0"])


def fail_or_stall(args: argparse.Namespace) -> None:
    if args.stall:
        mark(args.events, "stall")
        time.sleep(3600)
    mark(args.events, "crash")
    kind = args.crash
    if kind == "cuda_oom":
        exc = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has a total "
               "capacity of 139.81 GiB of which 1.02 GiB is free.")
    elif kind == "empty":
        exc = "TypeError"
    else:
        exc = "RuntimeError: expected scalar type BFloat16 but found Float"
    tb = ("Traceback (most recent call last):\n"
          '  File "/usr/lib/python3/dist-packages/sglang/srt/managers/scheduler.py", line 2950, in run_scheduler_process\n'
          "    scheduler.event_loop_overlap()\n"
          f"{exc}\n")
    log(f"Scheduler hit an exception: {tb}", NODE["tp0"])
    log("Received sigquit from a child process. It usually means the child failed.")
    if args.linger:  # the other ranks of a TP job hang on, holding their GPUs
        time.sleep(3600)
    sys.exit(137)


def go_unhealthy(server: http.server.HTTPServer | None, mode: str, events: str | None) -> None:
    mark(events, "unhealthy")
    if mode == "503":
        STATE["ready"] = False
    elif server is not None:
        server.shutdown()
        server.server_close()


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path in ("/health", "/health_generate"):
            self.send_response(200 if STATE["ready"] and not STATE["hung"] else 503)
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def watch(conn: socket.socket, lost: Callable[[], None]) -> None:
    """Call lost() when the other end of conn goes away (EOF or error)."""
    def run() -> None:
        try:
            while conn.recv(1024):
                pass
        except OSError:
            pass
        lost()
    threading.Thread(target=run, daemon=True).start()


def gather_ranks(args: argparse.Namespace) -> None:
    """The head: accept the other ranks on the dist-init port until all N-1 joined, then let them go on."""
    _host, port = split_addr(args.dist_init_addr)
    joined: dict[int, socket.socket] = {}
    with socket.create_server(("", port)) as server:
        while len(joined) < args.nnodes - 1:
            conn, _ = server.accept()
            hello = conn.makefile("rb").readline().decode(errors="replace").strip()
            if not hello.isdigit() or not 1 <= int(hello) < args.nnodes or int(hello) in joined:
                conn.close()  # no rank of this group
                continue
            joined[int(hello)] = conn
            mark(args.events, f"joined:{hello}")
    for conn in joined.values():
        conn.sendall(b"go\n")
        PEERS.append(conn)
        watch(conn, peer_lost(args.events))


def peer_lost(events: str | None) -> Callable[[], None]:
    def lost() -> None:
        if not STATE["hung"]:
            mark(events, "peer-lost")
        STATE["hung"] = True
    return lost


def join_head(args: argparse.Namespace) -> socket.socket:
    """A worker: connect to the head (retrying until it listens) and wait until every rank joined."""
    addr = split_addr(args.dist_init_addr)
    while True:
        try:
            conn = socket.create_connection(addr, timeout=2)
        except OSError:
            time.sleep(0.1)
            continue
        conn.settimeout(None)
        try:
            conn.sendall(f"{args.node_rank}\n".encode())
            if conn.makefile("rb").readline() == b"go\n":
                return conn
        except OSError:
            pass
        conn.close()  # the head went away before the group was formed: wait for it again
        time.sleep(0.1)


def head_lost(args: argparse.Namespace) -> None:
    mark(args.events, "head-lost")
    tb = ("Traceback (most recent call last):\n"
          '  File "/usr/lib/python3/dist-packages/sglang/srt/managers/scheduler.py", line 2950, in run_scheduler_process\n'
          "    scheduler.event_loop_normal()\n"
          f"torch.distributed.DistBackendError: NCCL communicator was aborted on rank {NODE['tp0']}: remote process "
          f"exited or there was a network error (peer {args.dist_init_addr})\n")
    log(f"Scheduler hit an exception: {tb}", NODE["tp0"])
    log("Received sigquit from a child process. It usually means the child failed.")
    os._exit(137)


def worker(args: argparse.Namespace, tp_size: int) -> None:
    """A node of rank >= 1: joins the head, loads, then serves its TP ranks silently until the head goes."""
    tp = NODE["tp0"]
    log(f"server_args=ServerArgs(model_path='/models/target', tp_size={tp_size}, nnodes={args.nnodes}, "
        f"node_rank={args.node_rank}, dist_init_addr='{args.dist_init_addr}')")
    log("Init torch distributed begin.", tp)
    conn = join_head(args)
    watch(conn, lambda: head_lost(args))
    log("Init torch distributed ends. mem usage=0.00 GB", tp)
    load(args, args.shards, "DeepseekV3ForCausalLM", args.fail_at_shard)
    log("KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1048576, K size: 30.12 GB, V size: 30.12 GB", tp)
    log("Memory pool end. avail mem=12.13 GB", tp)
    if args.draft_shards:
        load(args, args.draft_shards, "LlamaForCausalLMEagle3", None)
    log("Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, avail mem=12.10 GB", tp)
    time.sleep(args.capture_time)
    log("Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=3.21 s, mem usage=1.10 GB, avail mem=11.00 GB.", tp)
    mark(args.events, "loaded")
    threading.Event().wait()  # until head_lost ends the process, or a signal does


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--draft-shards", type=int, default=0)
    ap.add_argument("--shard-time", type=float, default=0.01)
    ap.add_argument("--fail-at-shard", type=int, help="crash (or stall) while loading this shard")
    ap.add_argument("--crash", default="exception", choices=["exception", "cuda_oom", "empty"])
    ap.add_argument("--stall", action="store_true")
    ap.add_argument("--capture-time", type=float, default=0.05)
    ap.add_argument("--decode-stats", type=int, default=0, help="decode stat lines after ready")
    ap.add_argument("--decode-interval", type=float, default=0.05)
    ap.add_argument("--serve-after", type=float, default=0.0, help="stay up this long after the stats")
    ap.add_argument("--crash-after-ready", type=float, help="crash this many seconds after ready")
    ap.add_argument("--linger", action="store_true", help="after a crash, hang instead of exiting")
    ap.add_argument("--port", type=int)
    ap.add_argument("--tp-size", "--tp", dest="tp_size", type=int)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--dist-init-addr", help="HOST:PORT of the head's rendezvous (multi-node)")
    ap.add_argument("--events")
    ap.add_argument("--pause", action="append", default=[], metavar="AT:FILE",
                    help="wait at AT (shard:N after drawing target shard N, ready, decode:N after N decode "
                         "lines, end) until FILE exists")
    ap.add_argument("--unhealthy-after", type=float, help="seconds after ready when /health stops answering")
    ap.add_argument("--unhealthy-mode", default="503", choices=["503", "close"],
                    help="503: /health answers 503; close: stop listening (the process lives on)")
    args, _unknown = ap.parse_known_args()  # accept every real launch_server flag
    for pause in args.pause:
        parts = pause.split(":", 2 if pause.startswith(("shard:", "decode:")) else 1)
        GATES[":".join(parts[:-1])] = parts[-1]
    multi = args.nnodes > 1
    if multi and not args.dist_init_addr:
        ap.error("--nnodes above 1 needs --dist-init-addr HOST:PORT")
    if not 0 <= args.node_rank < args.nnodes:
        ap.error(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}")
    tp_size = args.tp_size or 8 * args.nnodes
    NODE["tp0"] = tp_size // args.nnodes * args.node_rank
    if args.node_rank > 0:
        mark(args.events, "start")
        worker(args, tp_size)
        return

    server = None
    if args.port:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    mark(args.events, "start")
    if multi:
        log(f"server_args=ServerArgs(model_path='/models/target', tp_size={tp_size}, port={args.port or 30000}, "
            f"nnodes={args.nnodes}, node_rank=0, dist_init_addr='{args.dist_init_addr}')")
        log("Init torch distributed begin.", 0)
        gather_ranks(args)
        log("Init torch distributed ends. mem usage=0.00 GB", 0)
    else:
        log(f"server_args=ServerArgs(model_path='/models/target', tp_size={tp_size}, port={args.port or 30000})")
    load(args, args.shards, "DeepseekV3ForCausalLM", args.fail_at_shard)
    log("KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1048576, K size: 30.12 GB, V size: 30.12 GB", 0)
    log("Memory pool end. avail mem=12.13 GB", 0)
    if args.draft_shards:
        load(args, args.draft_shards, "LlamaForCausalLMEagle3", None)
    log("Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, avail mem=12.10 GB", 0)
    time.sleep(args.capture_time)
    log("Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=3.21 s, mem usage=1.10 GB, avail mem=11.00 GB.", 0)
    log(f"INFO:     Uvicorn running on http://127.0.0.1:{args.port or 30000} (Press CTRL+C to quit)")
    STATE["ready"] = True
    log("The server is fired up and ready to roll!")
    mark(args.events, "ready")
    pause_here("ready", args.events)
    if args.unhealthy_after is not None:
        timer = threading.Timer(args.unhealthy_after, go_unhealthy, (server, args.unhealthy_mode, args.events))
        timer.daemon = True
        timer.start()
    for i in range(args.decode_stats):  # 0.5.23's format with the forward iteration logged
        time.sleep(args.decode_interval)
        log(f"Decode batch [{40 * (i + 1)}], #running-req: 8, #token: 20480, token usage: 0.02, accept len: 3.{i % 10}0, "
            f"accept rate: 0.4{i % 10}, cuda graph: True, gen throughput (token/s): {88.8 + i:.2f}, #queue-req: 0", 0)
        pause_here(f"decode:{i + 1}", args.events)
    time.sleep(args.serve_after)
    if args.crash_after_ready is not None:
        time.sleep(args.crash_after_ready)
        fail_or_stall(args)
    pause_here("end", args.events)
    hold_if_hung()


if __name__ == "__main__":
    sys.exit(main())
