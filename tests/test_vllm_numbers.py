"""Numbers one can trust, on the real vLLM (its CPU build) under orch, and a nightly sweep of it run the way cron
runs it. One server of the tiny target serves it all (a server's start is most of the time here): first what a
server is once ready (its URL, its load figures, its own stats) and a benchmark that joins it; then its endpoint
benchmarked nightly: two nights of the same server measure this machine's spread (five repeats each) and are
within the noise of each other; a benchmark whose requests fail is invalid; the server is stopped cleanly and
orch restarts it with a patch set that slows the engine's decode path, and the third night is flagged a
regression beyond the measured spread, naming the patch set, in the sweep's document, its notification's one
line, `compare` and the report's history of the nights with their noise bands. Each benchmark's receipt holds its
server's (the one serving its URL). Last, the slowed server's engine core is killed: the run fails naming the
kill, and its patch set is reverted."""

from __future__ import annotations

import difflib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from orchtest import Orch, processes_of
from sshd import free_port
from test_notify import Receiver

pytest_plugins = ["vllm_env"]  # tiny_models
pytestmark = pytest.mark.vllm

ENV = '{HF_HUB_OFFLINE = "1", VLLM_NO_USAGE_STATS = "1", TOKENIZERS_PARALLELISM = "false"}'
RUNNER = "vllm/v1/worker/gpu_model_runner.py"  # the CPU model runner's forward pass is this class's
# per forward pass: each decode step waits 50x its time here, beyond what a loaded machine does to one repeat
# (a step 26x slower, seen once)
SLEEP_S = 0.25
# Three nights in a few minutes: the night's date is the local date of the firing, so each firing of the same
# line takes it in a time zone a day apart (as a crontab's TZ= would), the earliest first.
NIGHTS = ("NIGHT+24", "NIGHT0", "NIGHT-24")
BROKEN = '["--endpoint", "/v1/nowhere/completions", "--ready-check-timeout-sec", "0"]'


def slow_set(root: Path, site: Path) -> Path:
    """A patch set (a folder: patch.toml and one diff) that sleeps in the model runner's forward pass."""
    old = (site / RUNNER).read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(old) if line.startswith("    def _model_forward("))
    ret = next(i for i in range(at, len(old)) if old[i].strip() == "return self.model(")
    new = [*old[:ret], f"        __import__('time').sleep({SLEEP_S})  # slower decode, on purpose\n", *old[ret:]]
    folder = root / "slow-decode"
    folder.mkdir()
    (folder / "patch.toml").write_text('description = "Sleep in every forward pass."\npackage = "vllm"\n'
                                       'versions = "==0.32.0"\nstrip = 1\nrevert_after = true\n')
    (folder / "slow.diff").write_text("".join(difflib.unified_diff(old, new, f"a/{RUNNER}", f"b/{RUNNER}")))
    return folder


def nightly_file(path: Path, port: int, python: Path, model: str, hook: str) -> Path:
    """A nightly benchmark of the endpoint at `port`: five repeats after a warm-up, its objective the
    output throughput, its end announced to `hook`."""
    path.write_text(f"""name = "nightly-vllm"
playbook = "bench-serving"
hosts = ["local"]
notify = ["{hook}"]
objective = {{ metric = "output_throughput", goal = "max" }}
[spec]
url = "http://127.0.0.1:{port}"
engine = "vllm"
model = "{model}"
python = "{python}"
num_prompts = 8
input_len = 32
output_len = 16
warmup = 1
poll_min = 0.2
poll_max = 1
[matrix]
repeats = [5]
""")
    return path


def fire(command: str, tz: str) -> None:
    """The crontab line run as cron runs it: /bin/sh, a bare environment (HOME, LOGNAME, SHELL, PATH), from /."""
    env = {"HOME": os.environ["HOME"], "LOGNAME": "root", "SHELL": "/bin/sh", "PATH": "/usr/bin:/bin", "TZ": tz}
    res = subprocess.run(["/bin/sh", "-c", command.replace("\\%", "%")], env=env, cwd="/", capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr


def serve(orch: Orch, python: Path, model: str, port: int, *sets: str) -> int:
    res = orch("run", "serve-vllm", "--json", "--set", f"model={model}", "--set", f"port={port}",
               "--set", f"python={python}", "--set", "kv_cache_bytes=134217728", "--set", "enforce_eager=true",
               "--set", "max_model_len=256", "--set", f"env={ENV}", "--set", "poll_min=0.2", "--set", "poll_max=1",
               *sets, "--until-ready", timeout=600)
    assert res.returncode == 0, res.stderr
    return int(json.loads(res.stdout)["id"])


def bench(orch: Orch, server: int, *sets: str, check: int | None = 0) -> int:
    res = orch("run", "bench-serving", "--json", "--set", f"server={server}", "--set", "num_prompts=8",
               "--set", "input_len=32", "--set", "output_len=16", "--set", "poll_min=0.2", "--set", "poll_max=1",
               *sets, timeout=600, check=check)
    return int(json.loads(res.stdout)["id"])


def stop_all(orch: Orch) -> None:
    for run in orch.status():
        if run["status"] in ("running", "launching", "preparing"):
            orch("stop", str(run["id"]), "--grace", "10")


def stop_cleanly(orch: Orch, run_id: int) -> None:
    """`orch stop`: the run is stopped, never failed, whatever vLLM logs while it shuts down."""
    orch("stop", str(run_id), "--grace", "30", check=0)
    doc = orch.status(run_id)
    assert doc["status"] == "cancelled" and doc["phase"] != "failed" and doc["error"] is None, doc


@dataclass
class Night:
    """The module's server of the tiny target (run `server`, ready at `port`) in the workspace `orch`, run by a
    patchable copy of the engine (`python`, `site`), and the nightly file that benchmarks its endpoint."""

    root: Path
    orch: Orch
    python: Path
    site: Path
    model: str
    port: int
    hook: Receiver
    entry: dict
    server: int
    timings: dict[str, float] = field(default_factory=dict)
    slowed: int | None = None  # the server the nightly test restarts with the slowing patch set


@pytest.fixture(scope="module")
def night(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Night]:
    from orchtest import stop_background_watchers
    from vllm_env import patchable_engine

    root = tmp_path_factory.mktemp("night")
    with pytest.MonkeyPatch.context() as mp:
        home = root / "home"  # the server's watcher outlives any one test's HOME
        home.mkdir()
        mp.setenv("HOME", str(home))
        mp.setenv("ORCH_CRONTAB", str(home / "crontab"))
        python = patchable_engine(root / "engine")
        [site] = (root / "engine" / "lib").glob("python3*/site-packages")
        orch = Orch(root / "ws")
        hook = Receiver()
        model, port = str(tiny_models["target"]), free_port("127.0.0.1")
        nightly = nightly_file(orch.root / "nightly.toml", port, python, model, hook.url)
        entry = json.loads(orch("cron", "install", str(nightly), "--at", "0 3 * * *", "--json", check=0).stdout)
        try:
            started = time.monotonic()
            server = serve(orch, python, model, port)
            yield Night(root, orch, python, site, model, port, hook, entry, server,
                        {"server start": round(time.monotonic() - started, 1)})
        finally:
            stop_all(orch)  # a failing test leaves no server behind
            hook.close()
            stop_background_watchers(home)


def test_a_ready_server_serves_benchmarks_and_its_own_stats(night: Night) -> None:
    """Ready with its URL and the target's load figures; a benchmark joins it; the server's stats while it serves
    are recorded (a benchmark whose every request fails: the nightly test's)."""
    orch, run = night.orch, night.server
    doc = orch.status(run)
    assert doc["status"] == "running" and doc["phase"] == "ready", doc
    assert doc["url"] == f"http://127.0.0.1:{night.port}"
    assert doc["metrics"]["load_weight_s"] < 60
    assert doc["progress"]["total"] == 4  # the target's 4 shards

    good = bench(orch, run)
    b = orch.status(good)
    assert b["status"] == "succeeded", b
    assert b["metrics"]["completed"] == 8 and b["metrics"]["failed"] == 0
    assert b["metrics"]["output_throughput"] > 0

    # the server's own stats (vLLM logs them every 10 s while it serves): its headline is what it served at,
    # not the idle zero line that ends every burst
    served = orch.wait_for(run, lambda d: "gen_throughput" in d["metric_summaries"], timeout=120)
    assert served["metric_summaries"]["gen_throughput"]["mean"] > 0


def test_nightly_sweeps_measure_the_spread_and_flag_a_slowing_patch_beyond_it(night: Night) -> None:
    orch, python, model, port, hook, entry, server = (night.orch, night.python, night.model, night.port, night.hook,
                                                      night.entry, night.server)
    slow = slow_set(night.root, night.site)
    timings = night.timings

    def timed(what: str, step: Callable[[], int | None]) -> int | None:
        started = time.monotonic()
        got = step()
        timings[what] = round(time.monotonic() - started, 1)
        return got

    timed("night 1 (1 warm-up + 5 repeats)", lambda: fire(entry["command"], NIGHTS[0]))
    timed("night 2", lambda: fire(entry["command"], NIGHTS[1]))
    # every request goes to a path the server does not serve (no ready check first, which would stop it early)
    broken = timed("one failing run", lambda: bench(orch, server, "--set", f"extra_args={BROKEN}", check=1))
    stop_cleanly(orch, server)
    # between the nights, orch restarts the server with the patch set (applied at its start, reverted at its end)
    slowed = timed("slowed server start", lambda: serve(orch, python, model, port,
                                                        "--set", f"patches=[{json.dumps(str(slow))}]"))
    night.slowed = slowed
    timed("night 3, slowed", lambda: fire(entry["command"], NIGHTS[2]))
    print("TIMINGS", timings, flush=True)

    listed = json.loads(orch("sweep", "status", "--json", check=0).stdout)[::-1]  # oldest first
    assert [(d["name"], d["status"]) for d in listed] == [("nightly-vllm", "succeeded")] * 3, listed
    assert sorted({d["instance"] for d in listed}) == [d["instance"] for d in listed]  # three nights, in order
    sweeps = [json.loads(orch("sweep", "status", str(d["id"]), "--json", check=0).stdout) for d in listed]
    first, second, third = (d["points"][0]["run_id"] for d in sweeps)
    log = Path(entry["log"]).read_text()
    assert log.count(f"orch:{entry['id']} end: exit code 0") == 3, log

    doc = orch.status(first)
    assert doc["status"] == "succeeded" and doc["invalid"] is None, doc["reason"]
    s = doc["metric_summaries"]["output_throughput"]
    assert s["samples"] == 5 and s["min"] < s["max"]  # five repeats, one sample each: the machine's own spread
    receipt = doc["receipt"]
    assert receipt["engine"]["name"] == "vllm" and receipt["engine"]["version"].startswith("0.32.0")
    assert receipt["repeats"] == 5 and receipt["warmup"] == 1 and receipt["dataset"]["seed"] == 0
    assert receipt["hardware"]["cpu"]["count"] >= 1 and receipt["hostname"]
    served = receipt["server"]  # the server run answering at the benchmark's URL
    assert served["run"] == server and served["ready_at_launch"] is True
    assert set(served["receipt"]["model"]["files"]) >= {"config.json", "tokenizer_config.json"}
    assert "--max-model-len" in served["receipt"]["server_argv"]

    bad = orch.status(broken)  # every request answered 404: no success
    assert bad["status"] == "failed" and bad["invalid"].startswith("8 of 8 benchmark requests failed"), bad
    assert bad["metrics"]["failed"] == 8 and not bad["metrics"].get("completed"), bad["metrics"]

    # two nights of the same server: the same receipt but for time, within the noise, no regression flagged
    same = json.loads(orch("compare", str(first), str(second), "--json", check=0).stdout)
    assert same["differences"] == []
    assert same["metrics"]["output_throughput"]["verdict"] == "within_noise", same["metrics"]["output_throughput"]
    assert sweeps[1]["regressions"] == [] and sweeps[1]["regression_line"] is None
    against_bad = json.loads(orch("compare", str(first), str(broken), "--json", check=0).stdout)
    assert {m["verdict"] for m in against_bad["metrics"].values()} == {"incomparable"}

    # the slowed night: flagged beyond the spread of both nights, the patch set named as what changed
    named = f"server.receipt.patches.{slow}.name: - -> {slow}"
    [moved] = [r for r in sweeps[2]["regressions"] if r["metric"] == "output_throughput"]
    assert (moved["verdict"], moved["run_id"], moved["previous_run_id"]) == ("worse", third, second), moved
    assert named in moved["changed"], moved["changed"]
    line = sweeps[2]["regression_line"]
    assert "regression" in line and "beyond the noise" in line and str(slow) in line, line
    [first_news, second_news, third_news] = hook.bodies
    assert "regression" not in first_news["text"] + second_news["text"]
    assert third_news["text"].count("\n") == 0 and "regression" in third_news["text"] and str(slow) in third_news["text"]
    got = json.loads(orch("compare", str(second), str(third), "--json", check=0).stdout)
    keys = [d["key"] for d in got["differences"]]
    assert f"server.receipt.patches.{slow}.name" in keys, keys
    assert got["metrics"]["output_throughput"]["verdict"] == "worse", got["metrics"]["output_throughput"]
    assert got["metrics"]["median_itl_ms"]["verdict"] == "worse"

    # the report: the nights of this file, each with its best point's noise band, drawn as a trend
    page = Path(orch("sweep", "report", str(sweeps[2]["id"]), check=0).stdout.strip())
    html = page.read_text(encoding="utf-8")
    assert "Nights of this sweep file" in html and (page.parent / "trend.png").stat().st_size > 0
    bands = [orch.status(r)["metric_summaries"]["output_throughput"] for r in (first, second, third)]
    for one, band in zip(sweeps, bands):
        assert f"<td>{one['instance']}</td>" in html
        assert f"{band['min']:.4g} – {band['max']:.4g}" in html, (band, html[html.index("Nights"):])

    figures = {n: got["metrics"][n]["noise"] for n in ("output_throughput", "median_itl_ms")}
    figures["same receipt"] = {n: same["metrics"][n]["noise"] for n in ("output_throughput", "median_itl_ms")}
    print("FIGURES", json.dumps({"timings_s": timings, "regression_line": line, **figures}))


def test_a_killed_engine_core_of_a_server_that_served_is_named_and_its_patch_set_reverted(night: Night) -> None:
    """The slowed server, once the nightly test is done with it: its engine core killed from outside."""
    from vllm_env import engine_core_of  # the plugin's module, once pytest has it

    orch, run = night.orch, night.slowed
    assert run is not None, "the nightly test did not get as far as its slowed server"
    serving = orch.status(run)
    assert serving["status"] == "running" and serving["phase"] in ("ready", "running"), serving  # it served night 3
    os.kill(engine_core_of(serving["pid"]), signal.SIGKILL)
    doc = orch.wait_for(run, lambda d: d["status"] != "running", timeout=120)
    assert doc["status"] == "failed", doc
    error = doc["error"]
    assert "engine core" in error["message"].lower(), error
    # orch's diagnosis, not vLLM's words: a kill from outside, and where to look for who sent it
    assert error["kind"] == "killed" and "dmesg" in (error.get("hint") or ""), error
    # what lingered of the server stopped, then the end steps: the patch set reverted
    doc = orch.wait_finished(run)
    assert doc["receipt"]["patches"][0]["reverted"] is True
    assert processes_of(night.root, str(night.python)) == []
