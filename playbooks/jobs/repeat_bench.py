"""Run a benchmark several times in one process: `python repeat_bench.py REPEATS WARMUP -m MODULE ARGS...` (or a
script path instead of `-m MODULE`).

The engine's benchmark CLI takes seconds to tens of seconds to import (torch, transformers, the engine); run
once per repeat, that would cost more than the measurement. Here it is imported once and its `__main__` run
`WARMUP + REPEATS` times with the same arguments: the warm-up runs' output goes to warmup.log (in the working
directory), each repeat's to stdout after a `repeat i/N` line, so each prints its result block into the log.
The first run that fails ends it with its exit code. Runs on the engine's python; standard library only.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable


def run_once(target: list[str]) -> int:
    """One run of the module (or script) as `python -m MODULE ARGS` would run it: its exit code."""
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def quiet(fn: Callable[[], int], path: str) -> int:
    """Run fn with stdout and stderr (the file descriptors: what logging handlers hold too) going to path."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        return fn()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[0].isdigit() or not argv[1].isdigit():
        print("usage: repeat_bench.py REPEATS WARMUP (-m MODULE | SCRIPT) [ARGS...]", file=sys.stderr)
        return 2
    repeats, warmup, target = int(argv[0]), int(argv[1]), argv[2:]
    for i in range(1, warmup + 1):
        print(f"warm-up {i}/{warmup}", flush=True)
        code = quiet(lambda: run_once(target), "warmup.log")
        if code:
            print(f"warm-up {i} failed with exit code {code} (its output: warmup.log)", file=sys.stderr, flush=True)
            return code
    for i in range(1, repeats + 1):
        print(f"repeat {i}/{repeats}", flush=True)
        code = run_once(target)
        sys.stdout.flush()
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
