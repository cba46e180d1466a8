"""`orch status` start-up as a user runs it (the installed `orch` script), side by side with the floor of a
Typer + Rich CLI and with sqlite3 running the same query, in paired rounds: median and interquartile range
of each round's ratio to the floor; says where the time goes. Writes its own section of bench/RESULTS.md.

Usage: python bench/status_startup.py [--runs 5] [--repeat 31]    (--runs 100000: a big database)
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
from results import write_section

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
    """The environment of every command measured, as a user's shell has it: no PYTHONPATH (the installed
    `orch` script finds orchestrator as pip installed it), and Python writes the .pyc files the warm-up is
    for (typer's and rich's are precompiled in site-packages; a PYTHONDONTWRITEBYTECODE left set would
    recompile orch at every run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    env["ORCH_HOME"] = str(ws)
    return env


def installed_orchestrator(ws: Path, env: dict[str, str]) -> Path:
    """The orchestrator package the installed script runs (an editable install: this checkout's)."""
    found = subprocess.run([sys.executable, "-c", "import orchestrator; print(orchestrator.__file__)"], env=env,
                           cwd=ws, capture_output=True, text=True, check=True).stdout.strip()
    return Path(found).parent


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall seconds, and the CPU seconds (user + system) the command's process took: on a shared machine
    the wall time carries the other jobs' load, the CPU time hardly any."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv)
    return wall, usage.ru_utime + usage.ru_stime


def import_times(env: dict[str, str], cwd: Path) -> list[tuple[str, float]]:
    """Top-level imports of the installed `orch status` by cumulative time (python -X importtime)."""
    res = subprocess.run([sys.executable, "-X", "importtime", str(ORCH), "status"], env=env, cwd=cwd,
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


FLOOR = "python -c 'import typer, rich.table'"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=31)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp)
        (ws / "hosts.toml").write_text("")
        db = ws / "runs" / "orch.db"
        populate(db, args.runs)
        env = measured_env(ws)
        package = installed_orchestrator(ws, env)
        commands = {
            "orch status": [str(ORCH), "status"],
            "orch status --json": [str(ORCH), "status", "--json"],
            FLOOR: [sys.executable, "-c", "import typer, rich.table"],
            f"sqlite3 (`{QUERY}`)": ["sqlite3", str(db), QUERY],
        }
        for argv in commands.values():  # warm the page cache and .pyc files
            timed(argv, env, ws)
        walls: dict[str, list[float]] = {name: [] for name in commands}
        cpus: dict[str, list[float]] = {name: [] for name in commands}
        names = list(commands)
        for i in range(args.repeat):  # paired: each round runs every command once, in a rotated order, so
            for name in names[i % len(names):] + names[:i % len(names)]:  # load on a shared machine hits all alike
                wall, cpu = timed(commands[name], env, ws)
                walls[name].append(wall)
                cpus[name].append(cpu)
        # each command against the floor of its own round, then the median and quartiles of those ratios
        ratios = {name: quartiles([w / f for w, f in zip(walls[name], walls[FLOOR])]) for name in commands}
        medians = {name: statistics.median(w) for name, w in walls.items()}
        cpu_ratios = {name: quartiles([c / f for c, f in zip(cpus[name], cpus[FLOOR])]) for name in commands}
        cpu_medians = {name: statistics.median(c) for name, c in cpus.items()}
        imports = import_times(env, ws)
        query, rendering = in_process(db)
    write_results(args, package, {"wall": (medians, ratios), "CPU": (cpu_medians, cpu_ratios)}, imports, query,
                  rendering, load_before)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Lower quartile, median, upper quartile."""
    low, mid, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, mid, high


Figures = tuple[dict[str, float], dict[str, tuple[float, float, float]]]  # medians, quartiles of the ratios


def write_results(args: argparse.Namespace, package: Path, measured: dict[str, Figures],
                  imports: list[tuple[str, float]], query: float, rendering: float, load_before: float) -> None:
    from importlib.metadata import version

    load = os.getloadavg()[0]
    where = "this checkout (an editable install)" if package == ROOT / "orchestrator" else str(package)
    lines = [f"{SECTION} (bench/status_startup.py)", "",
             (f"`orch status` with {args.runs:,} runs ({3 * args.runs:,} events, {4 * args.runs:,} metric samples), "
              f"as a user runs it: the installed console script (`{ORCH.name}` in the environment's bin, which "
              f"runs {where}, with Typer {version('typer')}), no PYTHONPATH, from the workspace folder, output to "
              f"a pipe, .pyc files written by a warm-up run. {args.repeat} rounds, each running every command once "
              f"(rotated order); each round's ratio to the floor of the same round, then the median and "
              f"interquartile range of those ratios; the wall time as a user waits for it, and the CPU time (user + "
              f"system) of the command's process, which the other jobs of a shared machine hardly move. "
              f"This machine: {os.cpu_count()} cores, load average {load_before:.1f} before and {load:.1f} after "
              f"(1 min; shared with other jobs). The bar: `orch status` at most 1.5x the floor."), "",
             ("| command | median wall s | wall vs the Typer + Rich floor (paired): median | IQR "
              "| median CPU s | CPU vs the floor (paired): median | IQR |"), "|---|---:|---:|---:|---:|---:|---:|"]
    for name in measured["wall"][0]:
        row = [name.replace("|", "/")]
        for medians, ratios in measured.values():
            low, mid, high = ratios[name]
            row += [f"{medians[name]:.3f}", f"{mid:.2f}x", f"{low:.2f}x to {high:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", (f"Where the time goes: the query (50 newest runs, their latest metrics, the total count) "
                   f"{1000 * query:.1f} ms and the table {1000 * rendering:.1f} ms in-process; the rest is start-up. "
                   "Top-level imports (`python -X importtime` of the installed script, cumulative):"), ""]
    lines += [f"- `{name}` {1000 * s:.0f} ms" for name, s in imports]
    section = "\n".join(lines) + "\n"
    write_section(section)
    print(section)


if __name__ == "__main__":
    main()
