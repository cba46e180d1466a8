"""What a dashboard page costs at 100 000 runs: `orch ui` against sqlite3 running the same queries.

A workspace in a temp dir gets N runs (default 100 000; hosts, playbooks, statuses and sweeps in turn, a
spec of ~300 bytes, three metric samples each) written straight into the orch database. Then
`orch ui --port 0` serves it and each request is timed over a fresh HTTP connection (time to the first
byte, and to the whole body), median of R tries, against the same SQL the page runs (the page, its
metrics, its capped count) executed by Python's sqlite3 on the same file. With chromium + chromium-driver
(selenium), the runs page's first contentful paint, the time until its rows are drawn, and the time from
a status change written to the database to the page showing it are measured too.
Writes its own section of bench/RESULTS.md. Usage: python bench/ui.py [--runs 100000] [--tries 15]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## Dashboard (bench/ui.py)"
STATUSES = ["succeeded"] * 6 + ["failed", "cancelled", "lost", "running"]
QUERIES = [  # (what, path)
    ("first page", "/api/runs"),
    ("status + host", "/api/runs?status=failed&host=gpu04"),
    ("playbook, deep page", "/api/runs?playbook=serve-eagle3&before=20001"),
    ("sweep", "/api/runs?sweep=20"),
    ("text, common", "/api/runs?q=model-13"),
    ("text, rare", "/api/runs?q=needle-in-a-haystack"),
]


def build(db: Path, n: int) -> None:
    from orchestrator.store import Store

    Store(db).close()  # the schema, by its migrations
    conn = sqlite3.connect(db)
    now = time.time() - n
    runs, metrics = [], []
    for i in range(1, n + 1):
        status = STATUSES[i % len(STATUSES)]
        spec = {"model": f"/data/model-{i % 17}", "tp": 8, "mem_fraction": 0.9 + (i % 5) / 100,
                "cmd": "python -m sglang.launch_server --port 30000" + (" needle-in-a-haystack" if i == n // 3 else ""),
                "env": {"NCCL_DEBUG": "WARN"}, "poll_min": 30, "poll_max": 600}
        progress = json.dumps({"label": "Loading", "done": i % 64, "total": 64, "rate_per_s": 0.5, "eta_s": 30})
        runs.append((i, ("command", "serve-eagle3", "extract-hidden-states")[i % 3], f"gpu{i % 8:02d}", status,
                     "finished" if status == "succeeded" else "running", json.dumps(spec), now + i, now + i + 1,
                     None if status == "running" else now + i + 100, progress, i % 50 if i % 10 == 0 else None,
                     f"Decode batch, gen throughput (token/s): {i % 90}"))
        metrics += [(i, name, float(i % 97), now + i + 10 * k, k) for k, name in
                    enumerate(("gen_throughput", "accept_length", "tok_s"))]
    conn.executemany("INSERT INTO runs (id, playbook, host, status, phase, spec, created_at, started_at, ended_at,"
                     " progress, sweep_id, last_line, log_offset) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,0)", runs)
    conn.executemany("INSERT INTO metrics (run_id, name, value, ts, step) VALUES (?,?,?,?,?)", metrics)
    conn.commit()
    conn.execute("ANALYZE")
    conn.close()


def timed_get(host: str, port: int, path: str, token: str) -> tuple[float, float, bytes]:
    """Seconds to the first byte and to the whole body, over a new connection (as a browser's first visit)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", path, headers={"X-Orch-Token": token})
    res = conn.getresponse()  # returns once the status line and headers are in
    first = time.perf_counter() - t0
    body = res.read()
    total = time.perf_counter() - t0
    conn.close()
    assert res.status == 200, (path, res.status, body[:200])
    return first, total, body


def sqlite_same(db: Path, path: str) -> float:
    """The page's three queries (rows, their metrics, the capped count) straight through sqlite3."""
    from orchestrator.store import Store
    from orchestrator.store.runtable import COLUMNS
    from orchestrator.ui import table

    class Params(dict):  # the query string, as Starlette hands it to table.Filters
        def getlist(self, key: str) -> list[str]:
            return self.get(key + "[]", [])

    raw = parse_qs(urlsplit(path).query)
    params = Params({k: v[0] for k, v in raw.items()})
    params.update({k + "[]": v for k, v in raw.items()})
    where, args = table.Filters.parse(params).where()
    before = params.get("before")
    keyset = (" AND" if where else " WHERE") + f" id < {int(before)}" if before else ""
    store = Store(db)
    conn = store.conn
    t0 = time.perf_counter()
    rows = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM runs{where}{keyset} ORDER BY id DESC LIMIT 51",
                        args).fetchall()
    store.latest_metrics_of([r[0] for r in rows[:50]])
    conn.execute(f"SELECT COUNT(*) FROM (SELECT 1 FROM runs{where} LIMIT ?)", [*args, table.COUNT_CAP + 1]).fetchone()
    took = time.perf_counter() - t0
    store.close()
    return took


def browser_figures(base: str, token: str, db: Path, tmp: Path) -> dict[str, float] | None:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    driver_path = shutil.which("chromedriver")
    if not driver_path:
        return None
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000", "--no-first-run",
                "--disable-background-networking", f"--user-data-dir={tmp / 'chromium'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        driver.get(f"{base}/#token={token}")  # warm: the browser's own start is not the page's
        t0 = time.perf_counter()
        driver.get(base + "/")
        while not driver.execute_script("return document.querySelectorAll('tr[data-run]').length"):
            time.sleep(0.005)
        rows_drawn = time.perf_counter() - t0
        fcp = driver.execute_script(
            "const p = performance.getEntriesByName('first-contentful-paint')[0]; return p ? p.startTime : null")
        newest = driver.execute_script("return Number(document.querySelector('tr[data-run]').dataset.run)")
        lags = []
        for status in ("cancelled", "failed", "succeeded"):
            conn = sqlite3.connect(db)
            conn.execute("UPDATE runs SET status = ? WHERE id = ?", (status, newest))
            conn.commit()
            conn.close()
            t0 = time.perf_counter()
            while driver.execute_script(
                    "return document.querySelector(`tr[data-run='${arguments[0]}']`).dataset.status", newest) != status:
                time.sleep(0.01)
            lags.append(time.perf_counter() - t0)
        return {"fcp_ms": fcp, "rows_s": rows_drawn, "lag_median_s": statistics.median(lags), "lag_max_s": max(lags)}
    finally:
        driver.quit()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100_000)
    ap.add_argument("--tries", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        ws = tmp / "ws"
        (ws / "runs").mkdir(parents=True)
        (ws / "hosts.toml").write_text("")
        db = ws / "runs" / "orch.db"
        t0 = time.perf_counter()
        build(db, args.runs)
        print(f"{args.runs} runs written in {time.perf_counter() - t0:.1f} s ({db.stat().st_size >> 20} MiB)")
        env = {**os.environ, "ORCH_HOME": str(ws), "HOME": str(tmp)}
        log = tmp / "ui.log"
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", "--port", "0"], env=env,
                                stdout=subprocess.DEVNULL, stderr=log.open("w"))
        try:
            while not (m := re.search(r"http://([\d.]+):(\d+)/#token=(\S+)", log.read_text())):
                assert proc.poll() is None, log.read_text()
                time.sleep(0.05)
            host, port, token = m[1], int(m[2]), m[3]
            rows = []
            for what, path in [("page shell", "/"), *QUERIES]:
                timed_get(host, port, path, token)  # warm: the page cache and the worker thread's connection
                tries = [timed_get(host, port, path, token) for _ in range(args.tries)]
                sql = [sqlite_same(db, path) for _ in range(args.tries)] if path != "/" else []
                n = len(json.loads(tries[0][2])["runs"]) if path != "/" else None
                rows.append({"what": what, "path": path, "rows": n,
                             "ttfb_ms": 1000 * statistics.median(t[0] for t in tries),
                             "total_ms": 1000 * statistics.median(t[1] for t in tries),
                             "sqlite_ms": 1000 * statistics.median(sql) if sql else None})
                print(rows[-1])
            browser = browser_figures(f"http://{host}:{port}", token, db, tmp)
            print(browser)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    write_results(args.runs, args.tries, rows, browser)


def write_results(n: int, tries: int, rows: list[dict[str, Any]], browser: dict[str, float] | None) -> None:
    load = os.getloadavg()[0]
    lines = [SECTION, "",
             (f"`python bench/ui.py` — {n} runs (8 hosts, 3 playbooks, 4 statuses, 1 in 10 in a sweep, 3 metrics each) "
              f"in a real orch database; `orch ui` on loopback; median of {tries} requests, each on a new "
              f"connection; sqlite3: the same three queries (page, its metrics, the count capped at 10 000) through "
              f"Python's sqlite3 on the same file. {os.cpu_count()} CPUs, load average {load:.1f} at the end."), "",
             "| page | rows | first byte (ms) | whole (ms) | sqlite3, same queries (ms) |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        sql = f"{r['sqlite_ms']:.1f}" if r["sqlite_ms"] is not None else "-"
        lines.append(f"| {r['what']} `{r['path']}` | {r['rows'] if r['rows'] is not None else '-'} | "
                     f"{r['ttfb_ms']:.1f} | {r['total_ms']:.1f} | {sql} |")
    lines.append("")
    if browser:
        fcp = f"{browser['fcp_ms']:.0f} ms" if browser["fcp_ms"] is not None else "n/a"
        lines.append(f"In chromium (selenium): first contentful paint {fcp}, the runs drawn "
                     f"{1000 * browser['rows_s']:.0f} ms after navigation; a status written to the database shows "
                     f"on the open page in {browser['lag_median_s']:.2f} s median, {browser['lag_max_s']:.2f} s at "
                     "most (the page asks every second). Goal: page ≤ 300 ms server side, change visible ≤ 2 s.")
    else:
        lines.append("No browser figures: selenium or chromium-driver is not installed.")
    lines.append("Every filter is an indexed column (status, host, playbook, sweep_id) walked newest first by "
                 "rowid, and paging is keyset (`id < before`), so a deep page costs what the first one does. A text "
                 "search is a LIKE over the spec, reason and last line: a common word finds its 50 rows at once; a "
                 "rare one scans the table, bounded by the count's cap.")
    section = "\n".join(lines) + "\n"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + ("\n" + text[end + 1:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
