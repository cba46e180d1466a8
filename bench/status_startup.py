"""`orch status` start-up with a big database, side by side with the floor of a Typer + Rich CLI and with
sqlite3 running the same query; says where the time goes. Writes its own section of bench/RESULTS.md.

Usage: python bench/status_startup.py [--runs 100000] [--repeat 9]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from results import write_section  # noqa: E402

SECTION = "## orch status start-up"
ORCH = Path(sys.executable).parent / "orch"
QUERY = "SELECT * FROM runs ORDER BY id DESC LIMIT 50"


def populate(db: Path, runs: int) -> None:
    from orchestrator.store import Store

    store = Store(db)
    rng = random.Random(1)
    now = time.time()
    spec = json.dumps({"cmd": "python -m sglang.launch_server --model /data/kimi --tp 8", "env": {}})
    with store.tx() as c:
        c.executemany(
            "INSERT INTO runs (id, playbook, host, status, phase, spec, created_at, started_at, ended_at, log_offset,"
            " exit_code) VALUES (?, 'command', ?, 'succeeded', 'finished', ?, ?, ?, ?, 0, 0)",
            [(i, f"gpu{i % 16:02d}", spec, now - (runs - i) * 60, now - (runs - i) * 60 + 1,
              now - (runs - i) * 60 + 30) for i in range(1, runs + 1)])
        c.executemany("INSERT INTO events (run_id, ts, kind, message) VALUES (?, ?, 'status', ?)",
                      [(i, now, s) for i in range(1, runs + 1) for s in ("pending", "running", "succeeded")])
        c.executemany("INSERT INTO metrics (run_id, name, value, ts) VALUES (?, ?, ?, ?)",
                      [(i, name, rng.uniform(10, 100), now) for i in range(1, runs + 1)
                       for name in ("gen_throughput", "accept_len", "accept_rate", "samples")])
    store.close()


def measured_env(ws: Path) -> dict[str, str]:
    """The environment of every command measured: `orch` runs this checkout (not whichever orch the venv
    has installed), and Python writes the .pyc files the warm-up is for (typer's and rich's are
    precompiled in site-packages; a PYTHONDONTWRITEBYTECODE left set would recompile orch at every run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env["ORCH_HOME"] = str(ws)
    found = subprocess.run([sys.executable, "-c", "import orchestrator; print(orchestrator.__file__)"], env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).parent == ROOT / "orchestrator", f"orch would run {found}, not this checkout"
    return env


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def import_times(env: dict[str, str]) -> list[tuple[str, float]]:
    """Top-level imports of `orch status` by cumulative time (python -X importtime)."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "orchestrator", "status"], env=env,
                         capture_output=True, text=True, check=True)
    found: dict[str, float] = {}
    for line in res.stderr.splitlines():
        if "|" not in line or "cumulative" in line:
            continue
        _, cumulative, name = (part.strip() for part in line.split("|"))
        raw = line.split("|")[2]
        if raw.startswith(" ") and not raw.startswith("  "):  # top level: one space of indent
            found[name] = found.get(name, 0) + int(cumulative) / 1e6
    return sorted(found.items(), key=lambda kv: -kv[1])[:8]


def in_process(db: Path) -> tuple[float, float]:
    """The query (the 50 newest runs and their documents) and the rendering, measured inside one process."""
    import io

    from rich.console import Console

    from orchestrator.cli import render
    from orchestrator.store import Store
    from orchestrator.store.shapes import run_document

    store = Store(db)
    started = time.perf_counter()
    docs = [run_document(store, r, with_events=False) for r in store.list_runs(limit=50)]
    store.count_runs()
    query = time.perf_counter() - started
    render.out = Console(file=io.StringIO(), force_terminal=True, width=200)
    started = time.perf_counter()
    render.table(["id", "playbook", "host", "status", "metrics"],
                 [[d["id"], d["playbook"], d["host"], d["status"], " ".join(f"{k}={v:g}" for k, v in d["metrics"].items())]
                  for d in docs])
    return query, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp)
        (ws / "hosts.toml").write_text("")
        db = ws / "runs" / "orch.db"
        populate(db, args.runs)
        env = measured_env(ws)
        commands = {
            "orch status": [str(ORCH), "status"],
            "orch status --json": [str(ORCH), "status", "--json"],
            "python -c 'import typer, rich.table'": [sys.executable, "-c", "import typer, rich.table"],
            f"sqlite3 (`{QUERY}`)": ["sqlite3", str(db), QUERY],
        }
        for argv in commands.values():  # warm the page cache and .pyc files
            timed(argv, env)
        walls: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeat):  # interleaved, so load on a shared machine hits every command alike
            for name, argv in commands.items():
                walls[name].append(timed(argv, env))
        medians = {name: statistics.median(w) for name, w in walls.items()}
        imports = import_times(env)
        query, rendering = in_process(db)
    write_results(args, medians, imports, query, rendering)


def write_results(args: argparse.Namespace, medians: dict[str, float], imports: list[tuple[str, float]],
                  query: float, rendering: float) -> None:
    floor = medians["python -c 'import typer, rich.table'"]
    load = os.getloadavg()[0]
    lines = [f"{SECTION} (bench/status_startup.py)", "",
             (f"`orch status` with {args.runs:,} runs ({3 * args.runs:,} events, {4 * args.runs:,} metric samples): "
              f"median of {args.repeat} interleaved runs each, output to a pipe, on this machine "
              f"({os.cpu_count()} cores, load average {load:.1f}: shared with other jobs). Every command runs with "
              "this checkout first on PYTHONPATH and its .pyc files written by a warm-up run."), "",
             "| command | median wall s | vs the Typer + Rich floor |", "|---|---:|---:|"]
    for name, wall in medians.items():
        lines.append(f"| {name.replace('|', '/')} | {wall:.3f} | {wall / floor:.2f}x |")
    lines += ["", f"Where the time goes: the query (50 newest runs, their latest metrics, the total count) "
              f"{1000 * query:.1f} ms and the table {1000 * rendering:.1f} ms in-process; the rest is start-up. "
              "Top-level imports (`python -X importtime`, cumulative):", ""]
    lines += [f"- `{name}` {1000 * s:.0f} ms" for name, s in imports]
    section = "\n".join(lines) + "\n"
    write_section(section)
    print(section)


if __name__ == "__main__":
    main()
