#!/usr/bin/env python3
"""Wait for a server the job started, or check that its port is free. Standard library only.

    python wait_http.py free HOST PORT                     exit 1 when something already listens there
    python wait_http.py up URL --pid PID --timeout SECONDS exit 0 once URL answers 200; exit 1 when the
                                                           server process is gone or the time is up

Runs on the host inside a job (e.g. speculators' launch-vLLM-then-generate pipeline).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import urllib.error
import urllib.request


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) != 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(prog="wait_http.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    free = sub.add_parser("free")
    free.add_argument("host")
    free.add_argument("port", type=int)
    up = sub.add_parser("up")
    up.add_argument("url")
    up.add_argument("--pid", type=int, required=True)
    up.add_argument("--timeout", type=float, required=True)
    up.add_argument("--interval", type=float, default=0.5)
    args = ap.parse_args()

    if args.cmd == "free":
        if not port_free(args.host, args.port):
            print(f"wait_http.py: port {args.port} on {args.host} is already in use; choose another port",
                  file=sys.stderr)
            return 1
        return 0
    deadline = time.monotonic() + args.timeout
    while True:
        if answers(args.url):
            print(f"wait_http.py: {args.url} answers", flush=True)
            return 0
        if not alive(args.pid):
            print(f"wait_http.py: the server (pid {args.pid}) exited before {args.url} answered", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"wait_http.py: {args.url} did not answer within {args.timeout:g} s", file=sys.stderr)
            return 1
        time.sleep(args.interval)


if __name__ == "__main__":
    os.environ.setdefault("NO_PROXY", "*")  # a proxy must not stand between the job and its own server
    sys.exit(main())
