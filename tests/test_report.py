"""The sweep report: built from a real database, rendered by headless Chromium, checked for content."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from PIL import Image

from orchestrator import report
from orchestrator.errors import UsageError
from orchestrator.record import Status
from orchestrator.lifecycle import transition
from orchestrator.store import Store

CHROMIUM = shutil.which("chromium") or "chromium"


def sweep_store(path: Path) -> Store:
    """Three points of one sweep (different batch sizes), throughput and latency, with time series."""
    store = Store(path)
    if "sweep_id" not in {c[1] for c in store.conn.execute("PRAGMA table_info(runs)")}:
        store.db["runs"].add_column("sweep_id", int)  # the sweeps migration, where it has not landed yet
    store.create_run("command", "test1", {"cmd": "other", "env": {}})  # not in the sweep
    t0 = time.time() - 100
    for i, (batch, tput, ttft) in enumerate([(8, 80.0, 120.0), (16, 95.5, 90.0), (32, 88.8, 150.0)]):
        run_id = store.create_run("command", "test1", {"cmd": "serve", "batch": batch, "env": {"A": "1"}})
        store.conn.execute("UPDATE runs SET sweep_id = ? WHERE id = ?", (7, run_id))
        for to in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
            transition(store, run_id, to)
        store.update_run(run_id, started_at=t0)
        for step in range(5):
            store.add_metrics(run_id, [("gen_throughput", tput * (0.6 + 0.1 * step), step)], ts=t0 + 10 * step)
        store.add_metrics(run_id, [("ttft_ms", ttft, None)], ts=t0 + 60)
        transition(store, run_id, Status.SUCCEEDED if i != 2 else Status.FAILED, "done")
    return store


def test_best_point_by_metric_direction(tmp_path):
    store = sweep_store(tmp_path / "orch.db")
    points = report.sweep_points(store, 7)
    assert [p["run"].id for p in points] == [2, 3, 4]
    # gen_throughput's latest value is tput * 1.0: the 16-batch point wins, higher is better
    assert report.best_point(points, "gen_throughput") == 1
    # ttft_ms: lower is better
    assert report.best_point(points, "ttft_ms") == 1 and report.lower_is_better("ttft_ms")
    points[1]["metrics"]["ttft_ms"] = 500.0
    assert report.best_point(points, "ttft_ms") == 0
    with pytest.raises(UsageError, match="no runs in sweep"):
        report.sweep_points(store, "nope")


def test_report_html_and_charts(tmp_path):
    store = sweep_store(tmp_path / "orch.db")
    with pytest.raises(UsageError, match="no metric 'tput'"):
        report.sweep_report(store, 7, tmp_path / "r", metric="tput")
    page = report.sweep_report(store, 7, tmp_path / "r")
    text = page.read_text()
    # the spec key that differs is a column; the ones all points share are not
    assert "<th>batch</th>" in text and "<th>cmd</th>" not in text and "env.A" not in text
    assert "Best point: run 3 by gen_throughput (higher is better)" in text
    assert text.count("&#9733; best") == 1 and "<td>3 &#9733; best</td>" in text
    for png in ("metrics.png", "series.png"):
        assert f'src="{png}"' in text
        with Image.open(page.parent / png) as im:
            assert im.size[0] > 500 and len(im.convert("RGB").getcolors(1 << 20) or []) > 20
    # choosing latency picks the same point by the lower value
    assert "Best point: run 3 by ttft_ms (lower is better)" in report.sweep_report(
        store, 7, tmp_path / "r2", metric="ttft_ms").read_text()


def test_report_renders_in_headless_chromium(tmp_path):
    page = report.sweep_report(sweep_store(tmp_path / "orch.db"), 7, tmp_path / "r")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,1600",
         page.as_uri()],
        check=True, capture_output=True, timeout=60,
    )
    with Image.open(shot) as im:
        rgb = im.convert("RGB")
        assert rgb.size == (1200, 1600)
        pixels = list(rgb.get_flattened_data()) if hasattr(rgb, "get_flattened_data") else list(rgb.getdata())
    non_white = sum(1 for p in pixels if p != (255, 255, 255))
    colors = len(set(pixels))
    # text, the table's fills, and the charts' bars and lines: far from a blank page
    assert non_white > 0.05 * len(pixels), non_white
    assert colors > 100, colors
    # the best row's green fill and the chart's green bar are on screen
    assert sum(1 for p in pixels if p == (0xd3, 0xf9, 0xd8)) > 500


def test_sweep_report_command(tmp_path):
    """A real sweep on the local host whose job prints SGLang decode lines, then `orch sweep report`."""
    from orchtest import Orch

    orch = Orch(tmp_path / "ws")
    line = ("[2025-01-01 00:00:00 TP0] Decode batch, #running-req: 1, #token: 90, token usage: 0.01, "
            "cuda graph: True, gen throughput (token/s): $G, #queue-req: 0")
    cmd = f'for i in 1 2 3; do echo "{line}"; sleep 0.1; done'
    (orch.root / "s.toml").write_text(
        'name = "tput"\nplaybook = "command"\nhosts = ["local"]\n'
        f'[spec]\nengine = "sglang"\npoll_min = 0.05\npoll_max = 0.3\ncmd = {json.dumps(cmd)}\n'
        '[matrix]\n"env.G" = ["40.5", "97.25", "60.0"]\n')
    orch("sweep", "run", str(orch.root / "s.toml"), check=0, timeout=120)
    res = orch("sweep", "report", "tput", check=0)
    page = orch.root / "runs" / "sweeps" / "1" / "report.html"
    assert res.stdout.strip() == str(page)
    text = page.read_text()
    assert "<th>env.G</th>" in text and "<td>97.25</td>" in text
    assert "by gen_throughput (higher is better)" in text and text.count("&#9733; best") == 1
    assert (page.parent / "metrics.png").exists() and (page.parent / "series.png").exists()
    assert orch("sweep", "report", "nope").returncode == 2
