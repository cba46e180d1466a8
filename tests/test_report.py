"""The sweep report: built from a real database, rendered by headless Chromium, checked for content."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from PIL import Image
from test_ui import browser

from orchestrator.errors import UsageError
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.ui import report

__all__ = ["browser"]  # the fixture

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
    # no objective in the sweep: nothing is called best
    assert "No objective" in report.sweep_report(store, 7, tmp_path / "r0").read_text()
    page = report.sweep_report(store, 7, tmp_path / "r", metric="gen_throughput")
    text = page.read_text()
    # the spec key that differs is a column; the ones all points share are not
    assert "<th>batch</th>" in text and "<th>cmd</th>" not in text and "env.A" not in text
    assert "Best point: batch=16 (run 3) by gen_throughput (higher is better)" in text
    assert text.count("&#9733; best") == 1 and "<td>batch=16 &#9733; best</td>" in text
    for png in ("metrics.png", "series.png"):
        assert f'src="{png}"' in text
        with Image.open(page.parent / png) as im:
            assert im.size[0] > 500 and len(im.convert("RGB").getcolors(1 << 20) or []) > 20
    # choosing latency picks the same point by the lower value
    assert "Best point: batch=16 (run 3) by ttft_ms (lower is better)" in report.sweep_report(
        store, 7, tmp_path / "r2", metric="ttft_ms").read_text()


def test_report_renders_in_headless_chromium(tmp_path):
    page = report.sweep_report(sweep_store(tmp_path / "orch.db"), 7, tmp_path / "r", metric="gen_throughput")
    shot = tmp_path / "shot.png"
    screenshot(page, shot, tmp_path / "profile")
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


def screenshot(page: Path, shot: Path, profile: Path, size: str = "1200,1600") -> None:
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", f"--screenshot={shot}", f"--window-size={size}", page.as_uri()],
        check=True, capture_output=True, timeout=60,
    )


def test_sweep_report_command(tmp_path):
    """A real sweep on the local host whose job prints SGLang decode lines, then `orch sweep report`."""
    from orchtest import Orch

    orch = Orch(tmp_path / "ws")
    line = ("[2025-01-01 00:00:00 TP0] Decode batch, #running-req: 1, #token: 90, token usage: 0.01, "
            "cuda graph: True, gen throughput (token/s): $G, #queue-req: 0")
    cmd = f'for i in 1 2 3; do echo "{line}"; sleep 0.1; done'
    (orch.root / "s.toml").write_text(
        'name = "tput"\nplaybook = "command"\nhosts = ["local"]\n'
        'objective = { metric = "gen_throughput", goal = "max" }\n'
        f'[spec]\nengine = "sglang"\npoll_min = 0.05\npoll_max = 0.3\ncmd = {json.dumps(cmd)}\n'
        '[matrix]\n"env.G" = ["40.5", "97.25", "60.0"]\n')
    orch("sweep", "run", str(orch.root / "s.toml"), check=0, timeout=120)
    res = orch("sweep", "report", "tput", check=0)
    page = orch.root / "runs" / "sweeps" / "1" / "report.html"
    assert res.stdout.strip() == str(page)
    text = page.read_text()
    assert "<th>env.G</th>" in text and "<td>97.25</td>" in text
    assert "Best point: env.G=97.25 (run 2) by gen_throughput (higher is better)" in text
    assert text.count("&#9733; best") == 1
    assert "<h1>tput — " in text and " — sweep 1 on local</h1>" in text
    assert text.count('<a href="../../') == 3 and '<a href="../../2/log.tail">log</a>' in text
    assert (orch.root / "runs" / "2" / "log.tail").exists()
    assert (page.parent / "metrics.png").exists() and (page.parent / "series.png").exists()
    assert orch("sweep", "report", "nope").returncode == 2


def test_two_nights_of_a_serve_bench_grid_in_headless_chromium(tmp_path):
    """A serve-bench grid (SGLang and bench emulators) run as two nights of one file on the local host: the
    report's axis shows the swept values, the best is marked, the trend covers both nights."""
    from orchtest import Orch
    from sshd import free_port

    fakes = Path(__file__).parent / "fakes"
    orch = Orch(tmp_path / "ws")
    flags = ["--shards", "2", "--shard-time", "0.01", "--capture-time", "0.01", "--decode-stats", "1",
             "--serve-after", "600"]
    (orch.root / "grid.toml").write_text(f"""
name = "eagle3-nightly"
playbook = "serve-bench"
hosts = ["local"]
objective = {{ metric = "output_throughput", goal = "max" }}
[spec]
model = "/models/target"
draft_model = "/models/draft"
launcher = "{fakes / 'sglang_emulator.py'}"
extra_args = {json.dumps(flags)}
port = {free_port("127.0.0.1")}
poll_min = 0.05
poll_max = 0.3
bench = {{ num_prompts = 8, input_len = 64, output_len = 32, launcher = "{fakes / 'bench_serving_emulator.py'}" }}
[matrix]
num_steps = [2, 3]
eagle_topk = [1, 4]
""")
    for night in ("2025-06-01", "2025-06-02"):
        res = orch("sweep", "run", str(orch.root / "grid.toml"), "--instance", night, timeout=180)
        assert res.returncode == 0, res.stderr
    res = orch("sweep", "report", "eagle3-nightly", check=0)
    page = Path(res.stdout.strip())
    assert page == orch.root / "runs" / "sweeps" / "2" / "report.html"
    text = page.read_text()
    assert "<h1>eagle3-nightly — 2025-06-02 — sweep 2 on local</h1>" in text
    # rows and axis labelled by the swept values (the point's keys in order), the run id a column of its own
    assert all(f"<td>eagle_topk={k} num_steps={n}" in text for n in (2, 3) for k in (1, 4))
    assert text.count("&#9733; best") == 1 and "by output_throughput (higher is better)" in text
    assert "<h2>Nights of this sweep file</h2>" in text and "<td>2025-06-01</td>" in text
    assert 'src="trend.png"' in text and (page.parent / "trend.png").exists()
    assert text.count('">log</a>') == 4
    shot = tmp_path / "shot.png"
    screenshot(page, shot, tmp_path / "profile", "1200,2400")
    with Image.open(shot) as im:
        rgb = im.convert("RGB")
        pixels = list(rgb.get_flattened_data()) if hasattr(rgb, "get_flattened_data") else list(rgb.getdata())
    assert sum(1 for p in pixels if p == (0xd3, 0xf9, 0xd8)) > 500  # the best row's fill
    assert sum(1 for p in pixels if p == (0x2b, 0x8a, 0x3e)) > 200  # best bar and the nights' best line
    # the trend chart's own pixels: two nights, one line per point plus the best
    with Image.open(page.parent / "trend.png") as im:
        assert len(im.convert("RGB").getcolors(1 << 20) or []) > 20


def test_bars_are_zoomed_to_the_values_so_a_small_gain_shows():
    plt = report._pyplot()
    fig, (close, apart) = plt.subplots(2, 1)
    assert report._zoom(close, [88.8, 92.8])  # a 4.5 % gain: the axis starts near the values, not at 0
    lo, hi = close.get_ylim()
    assert 80 < lo < 88.8 and 92.8 < hi < 95
    assert not report._zoom(apart, [10.0, 100.0])  # far apart: from 0 already shows it
    assert apart.get_ylim()[0] <= 0
    plt.close(fig)


def test_the_report_puts_the_objective_first_and_fits_1280_px(tmp_path, browser):
    store = sweep_store(tmp_path / "orch.db")
    for run_id in (2, 3, 4):  # a wide table: many metrics with long names
        store.add_metrics(run_id, [(f"speculative_decoding_metric_with_a_long_name_{i}", 1234.5678 * run_id, None)
                                   for i in range(12)], ts=1.0)
    page = report.sweep_report(store, 7, tmp_path / "r", metric="ttft_ms")
    text = page.read_text()
    head = text[text.index("<tr><th>"):text.index("</tr>")]
    assert head.index("<th>ttft_ms</th>") < head.index("<th>gen_throughput</th>")  # the objective's column first
    browser.set_window_size(1280, 900)
    browser.get(page.as_uri())
    width = browser.execute_script("return document.documentElement.clientWidth")
    assert browser.execute_script("return document.documentElement.scrollWidth") <= width
    table = browser.execute_script("return document.querySelector('table').getBoundingClientRect().right")
    assert table <= width
    browser.save_screenshot(str(tmp_path / "report-1280.png"))
