"""orch against the real vLLM (its CPU build, `make engine`) on this machine's `local` host.

Measures, on one tiny-Llama server run under `orch run serve-vllm --detach`:
- ready lag: from the moment `Application startup complete` lands in the log (the file watched every 10 ms)
  to the moment orch's database says phase `ready` (read every 10 ms), against the lag a fixed `sleep N; tail`
  poll has on average (N/2);
- orch's cost to the engine: `vllm bench serve` straight at the server, alternating with orch's host watcher
  running (watched) and stopped (unwatched), ROUNDS rounds; the medians' ratio;
- orch's memory while the server runs: the RSS of the workspace's own processes (host watcher, agent);
- clean stops: STOPS servers started and stopped with `orch stop`, how many ended stopped with no error, and
  in how many vLLM logged an EngineDeadError while it shut down (what orch once read as a crash).
Writes the `## Real engine` section of bench/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import write_section

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / ".engines" / "vllm" / "bin"
ORCH = [sys.executable, "-m", "orchestrator"]
ROUNDS = 3
STOPS = int(os.environ.get("STOPS", "20"))
PORT = 27461
SERVE = ["--set", "enforce_eager=true", "--set", "max_model_len=512",
         "--set", 'env={HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1"}']


def orch(home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*ORCH, *args], env={**os.environ, "ORCH_HOME": str(home)}, capture_output=True,
                          text=True, timeout=timeout, check=False)


def workspace_processes(home: Path) -> dict[int, str]:
    """orch's own processes for this workspace (its host watcher and agents), by pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            text = " ".join(a.decode(errors="replace") for a in argv)
            if "orchestrator" in text and (str(home).encode() in env or str(home) in text) and "vllm" not in text:
                found[int(entry)] = text[:120]
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def ready_lag(home: Path, run_id: int) -> float:
    log = home / "runs" / str(run_id) / "log"
    db = sqlite3.connect(home / "runs" / "orch.db", timeout=30)
    seen_line = seen_ready = None
    deadline = time.time() + 600
    while (seen_line is None or seen_ready is None) and time.time() < deadline:
        now = time.time()
        if seen_line is None and log.exists() and b"Application startup complete" in log.read_bytes():
            seen_line = now
        if seen_ready is None and db.execute("SELECT phase FROM runs WHERE id=?", (run_id,)).fetchone()[0] == "ready":
            seen_ready = now
        time.sleep(0.01)
    db.close()
    assert seen_line is not None and seen_ready is not None, "the server never became ready"
    return seen_ready - seen_line


def bench_once(model: str) -> float:
    out = subprocess.run([str(ENGINE / "vllm"), "bench", "serve", "--backend", "vllm", "--model", model,
                          "--base-url", f"http://127.0.0.1:{PORT}", "--dataset-name", "random", "--random-input-len",
                          "64", "--random-output-len", "64", "--num-prompts", "64", "--max-concurrency", "8"],
                         capture_output=True, text=True, timeout=600, check=False,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for line in out.stdout.splitlines():
        if line.startswith("Output token throughput"):
            return float(line.split()[-1])
    raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])


def clean_stops(home: Path, model: str) -> tuple[int, int]:
    """STOPS servers, each ready then stopped: (stopped with no error, EngineDeadError in the log)."""
    clean = dead = 0
    for _ in range(STOPS):
        res = orch(home, "run", "serve-vllm", "--until-ready", "--json", "--set", f"model={model}",
                   "--set", f"port={PORT}", "--set", f"python={ENGINE / 'python'}",
                   "--set", "kv_cache_bytes=134217728", *SERVE)
        run_id = json.loads(res.stdout)["id"]
        orch(home, "stop", str(run_id))
        doc = json.loads(orch(home, "status", str(run_id), "--json").stdout)
        clean += doc["status"] == "cancelled" and doc["phase"] != "failed" and doc["error"] is None
        dead += b"EngineDeadError" in (home / "runs" / str(run_id) / "log").read_bytes()
    return clean, dead


def main() -> None:
    home = Path(tempfile.mkdtemp(prefix="orch-real-engine-"))
    (home / "hosts.toml").write_text("")
    made = subprocess.run([str(ENGINE / "python"), str(ROOT / "tests" / "engines" / "tiny_models.py"),
                           str(home / "models")], capture_output=True, text=True, check=True)
    model = json.loads(made.stdout.strip().splitlines()[-1])["target"]
    res = orch(home, "run", "serve-vllm", "--detach", "--set", f"model={model}", "--set", f"port={PORT}",
               "--set", f"python={ENGINE / 'python'}", "--set", "kv_cache_bytes=268435456", *SERVE)
    assert res.returncode == 0, res.stderr
    try:
        lag = ready_lag(home, 1)
        mine = workspace_processes(home)
        memory = sum(rss_mib(p) for p in mine)
        watched, unwatched = [], []
        for _ in range(ROUNDS):
            watched.append(bench_once(model))
            watchers = [p for p, argv in workspace_processes(home).items() if "hostwatch" in argv]
            for pid in watchers:
                os.kill(pid, signal.SIGTERM)
            unwatched.append(bench_once(model))
            orch(home, "status")  # any orch command starts the host's watcher again
    finally:
        orch(home, "stop", "1")
    clean, dead = clean_stops(home, model)
    w, u = statistics.median(watched), statistics.median(unwatched)
    load = os.getloadavg()[0]
    section = f"""## Real engine

`python bench/real_engine.py` — the real vLLM 0.32.0 CPU build (`make engine`) serving a tiny Llama (4 shards,
128-256 MiB KV, `--enforce-eager`) under `orch run serve-vllm --detach` on the `local` host; {os.cpu_count()} CPUs,
load average {load:.1f} at the end.

| what | figure |
|---|---:|
| `Application startup complete` in the log → orch's record says `ready` | {lag:.2f} s |
| the same with a fixed `sleep 30; tail` poll (on average half the interval) / `sleep 600` | 15 s ({15 / max(lag, 0.01):.0f}x) / 300 s |
| `vllm bench serve` output tok/s, orch watching (median of {ROUNDS}) | {w:.1f} ({', '.join(f'{x:.0f}' for x in watched)}) |
| the same, orch's host watcher stopped (median of {ROUNDS}) | {u:.1f} ({', '.join(f'{x:.0f}' for x in unwatched)}) |
| watched / unwatched | {w / u:.3f} |
| orch's processes for the workspace while the server runs (RSS, sum) | {memory:.0f} MiB in {len(mine)} processes |
| `orch stop` of a ready server: stopped with no error | {clean} of {STOPS} |
| ... of which vLLM logged `EngineDeadError` while shutting down | {dead} |

Each benchmark: 64 prompts, 64 in / 64 out, 8 at a time, straight at the server (not through orch), alternating
watched and unwatched so that drift in the machine's load falls on both.
"""
    print(section)
    write_section(section)


if __name__ == "__main__":
    main()
