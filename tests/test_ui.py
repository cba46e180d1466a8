"""`orch ui`: the real command serving over a loopback socket, a real database, runs made by the run flow on
the local host, and a real browser (Debian's chromium through chromium-driver and selenium)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from orchtest import FAST, Orch, job_cmd, reached, release

from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.ui.guard import Guard, is_loopback

FAKES = Path(__file__).resolve().parent / "fakes"
SCRIPT = '<script>window.PWNED=1</script><img src=x onerror="window.PWNED=2">'


class Dashboard:
    """`orch ui --port 0` in a workspace, as a process of its own; its URL and token from what it prints."""

    def __init__(self, orch: Orch, *args: str, env: dict[str, str] | None = None):
        self.log = orch.root / "ui.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", "--port", "0", *args],
                                     env={**orch.env, **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=self.log.open("w"))
        deadline = time.time() + 30
        while not (m := re.search(r"orch ui: (http://[^/\s]+)/(?:#token=(\S+))?", self.log.read_text())):
            assert self.proc.poll() is None and time.time() < deadline, self.log.read_text()
            time.sleep(0.05)
        self.base, self.token = m[1], m[2]

    def page(self, path: str = "/") -> str:
        """A page's address as a browser first opens it: with the token in the fragment, as printed."""
        return f"{self.base}{path}#token={self.token}"

    def request(self, path: str, method: str = "GET", headers: dict[str, str] | None = None,
                token: bool = True) -> tuple[int, Any]:
        """The dashboard's answer; with its token, as its pages ask, unless `token` is False."""
        headers = {**({"X-Orch-Token": self.token} if token else {}), **(headers or {})}
        req = urllib.request.Request(self.base + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as res:
                status, body = res.status, res.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode()

    def get(self, path: str, **headers: str) -> Any:
        status, body = self.request(path, headers=headers)
        assert status == 200, (status, body)
        return body

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


@pytest.fixture
def orch_hosts() -> str:
    return ""  # the built-in `local` host only


@pytest.fixture
def dashboards() -> Iterator[list[Dashboard]]:
    started: list[Dashboard] = []
    yield started
    for d in started:
        d.stop()


def serve(dashboards: list[Dashboard], orch: Orch, *args: str, **kw: Any) -> Dashboard:
    d = Dashboard(orch, *args, **kw)
    dashboards.append(d)
    return d


def synthetic_runs(orch: Orch, n: int) -> Store:
    """Runs written through the store and its transitions (no jobs): hosts, playbooks and statuses in turn."""
    store = Store(orch.db)
    for i in range(n):
        run_id = store.create_run(("command", "serve-eagle3")[i % 2], ("gpu01", "gpu02", "gpu03")[i % 3],
                                  {"cmd": f"job {i}" + (" 50%_done" if i == 7 else "")})
        if i % 4:
            for to in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
                transition(store, run_id, to)
        if i % 4 == 3:
            transition(store, run_id, Status.SUCCEEDED, "exit code 0")
        store.add_metrics(run_id, [("tok_s", float(i), None)], ts=time.time())
    return store


# --- the runs table ------------------------------------------------------------------------------
def test_runs_filtered_and_paged_in_sql(orch: Orch, dashboards: list[Dashboard]) -> None:
    synthetic_runs(orch, 30)
    ui = serve(dashboards, orch)
    page = ui.get("/api/runs?limit=7")
    assert [r["id"] for r in page["runs"]] == list(range(30, 23, -1)) and page["count"] == 30
    assert page["runs"][0]["metrics"] == {"tok_s": 29.0} and page["newer"] is None
    seen = [r["id"] for r in page["runs"]]  # keyset paging: every run once, newest first
    while page["older"] is not None:
        page = ui.get(f"/api/runs?limit=7&before={page['older']}")
        seen += [r["id"] for r in page["runs"]]
    assert seen == list(range(30, 0, -1))
    back = ui.get("/api/runs?limit=7&after=16")  # the page just newer than run 16
    assert [r["id"] for r in back["runs"]] == list(range(23, 16, -1)) and back["older"] == 17
    one = ui.get("/api/runs?status=succeeded&host=gpu01&playbook=serve-eagle3")
    assert {(r["status"], r["host"], r["playbook"]) for r in one["runs"]} == {("succeeded", "gpu01", "serve-eagle3")}
    assert [r["id"] for r in one["runs"]] == [i + 1 for i in range(29, -1, -1) if i % 4 == 3 and i % 3 == 0 and i % 2]
    active = ui.get("/api/runs?status=pending,preparing,launching,running")
    assert active["count"] == sum(1 for i in range(30) if i % 4 in (1, 2)) + sum(1 for i in range(30) if i % 4 == 0)
    # text: LIKE's wildcards are the text itself; a number is also an id
    assert [r["id"] for r in ui.get("/api/runs?q=50%25_done")["runs"]] == [8]
    assert [r["id"] for r in ui.get("/api/runs?q=%25")["runs"]] == [8]
    assert 12 in [r["id"] for r in ui.get("/api/runs?q=12")["runs"]]
    assert ui.get("/api/runs?status=nonsense")["count"] == 30  # an unknown status filters nothing out
    facets = ui.get("/api/facets")
    assert facets["hosts"] == ["gpu01", "gpu02", "gpu03"] and facets["playbooks"] == ["command", "serve-eagle3"]


def test_the_dashboard_indexes_serve_its_queries(orch: Orch) -> None:
    store = Store(orch.db)
    for column in ("host", "playbook"):
        plan = " ".join(str(r) for r in store.conn.execute(
            f"EXPLAIN QUERY PLAN SELECT id FROM runs WHERE {column} = 'x' ORDER BY id DESC LIMIT 50"))
        assert f"idx_runs_{column}" in plan and "TEMP B-TREE" not in plan, plan


# --- a run ---------------------------------------------------------------------------------------
def test_run_page_of_a_failed_run(orch: Orch, dashboards: list[Dashboard]) -> None:
    cmd = (f"echo {shlex.quote(SCRIPT)}; for i in 1 2 3; do echo orch-metric tok_s=$((i*10)); sleep 0.2; done; "
           "python3 -c 'raise RuntimeError(\"boom <b>x</b>\")'")
    orch("run", "command", *FAST, "--set", f"cmd={cmd}", check=1)
    ui = serve(dashboards, orch)
    doc = ui.get("/api/runs/1")
    assert doc["status"] == "failed" and doc["error"]["exception"] == "RuntimeError"
    assert doc["error"]["message"] == "boom <b>x</b>" and SCRIPT in doc["error"]["context"]
    assert doc["error"]["hint"] == Store(orch.db).get_run(1).error["hint"] and "(source: " in doc["error"]["hint"]
    phases = [s["phase"] for s in doc["timeline"]]
    assert phases[0] == "created" and phases[-1] == "failed" and "starting" in phases
    times = [s["ts"] for s in doc["timeline"]]
    assert times == sorted(times) and times[-1] == doc["ended_at"]
    keys = [k["key"] for k in doc["spec_keys"]]
    changed = [k["key"] for k in doc["spec_keys"] if k["changed"]]
    assert set(changed) == {"cmd", "poll_min", "poll_max"} and keys[:3] == changed  # set keys first
    assert doc["metrics"] == {"tok_s": 30.0}
    assert [v for _, v in ui.get("/api/runs/1/metrics")["tok_s"]] == [10.0, 20.0, 30.0]
    tail = ui.get("/api/runs/1/log?lines=50")
    assert tail["source"] == "stored" and SCRIPT in tail["text"] and "RuntimeError" in tail["text"]
    # the command the page gives starts the same run again
    argv = shlex.split(doc["reproduce"])
    assert argv[:5] == ["orch", "run", "command", "--host", "local"]
    orch(*argv[1:], check=1)
    assert orch.status(2)["spec"] == doc["spec"]
    assert ui.request("/api/runs/99")[0] == 404


def test_an_active_run_log_comes_from_its_host(orch: Orch, dashboards: list[Dashboard], tmp_path: Path) -> None:
    """The log of a running job, read from its host each time: the job writes 10 lines, waits for the
    test, writes 10 more and waits again."""
    more, end = tmp_path / "more", tmp_path / "end"
    lines = lambda a, b: f"for i in $(seq {a} {b}); do echo line $i; done"
    wait = lambda gate: f"touch {gate}.reached; while [ ! -e {gate} ]; do sleep 0.05; done"
    run_id = int(orch("run", "command", "--detach", *FAST, "--set",
                      f"cmd={lines(1, 10)}; {wait(more)}; {lines(11, 20)}; {wait(end)}", check=0).stdout)
    ui = serve(dashboards, orch)

    def fetched_after(at: float) -> dict:
        """The tail as fetched from the host after `at` (a tail fetched within the last second is served
        again, and one still being fetched is pending): asked again until it is."""
        return wait_until(lambda: (t := ui.get(f"/api/runs/{run_id}/log?lines=5")) and not t["pending"]
                          and t["at"] > at and t, 60, step=0.2)

    reached(more)
    first = fetched_after(0)
    assert first["source"] == "host" and first["error"] is None
    assert first["text"].splitlines() == [f"line {i}" for i in range(6, 11)]
    release(more)
    reached(end)
    later = fetched_after(first["at"])
    assert later["source"] == "host" and later["error"] is None
    assert later["text"].splitlines() == [f"line {i}" for i in range(16, 21)]
    orch("cancel", str(run_id), "--grace", "1", check=0)


def test_a_silent_host_holds_up_neither_its_page_nor_the_others(orch: Orch, dashboards: list[Dashboard]) -> None:
    """A host that accepts the connection and never says a word: its run's log is pending within the
    wait, and the runs table answers meanwhile."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []

    def hold() -> None:  # every connection accepted and kept open, never a word said
        while True:
            try:
                held.append(silent.accept()[0])
            except OSError:
                return  # the listener closed

    threading.Thread(target=hold, daemon=True).start()
    (orch.root / "hosts.toml").write_text(
        f'[hosts.mute]\naddress = "127.0.0.1"\nport = {silent.getsockname()[1]}\nconnect_timeout = 3600\n')
    store = Store(orch.db)
    run_id = store.create_run("command", "mute", {"cmd": "sleep 1000"})
    for to in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, to)
    store.update_run(run_id, pid=123, pid_start="1", remote_dir="/tmp/nowhere", last_line="the last line seen",
                     heartbeat=time.time(), watcher="elsewhere:1:1")
    ui = serve(dashboards, orch)
    # Held up, each request would wait out the host's hour-long connect_timeout, far past the 30 s the
    # test's client waits for an answer. How quickly they answer is measured by bench/ui.py.
    tail = ui.get(f"/api/runs/{run_id}/log")
    assert tail["pending"] and tail["text"] == "the last line seen"
    for _ in range(3):  # the same run again: no second fetch piles up behind the first, nor blocks anyone
        assert ui.get(f"/api/runs/{run_id}/log")["pending"]
        ui.get("/api/runs")
    ui.get("/api/runs?q=sleep")
    silent.close()
    for conn in held:  # the fetches under way end (the host hung up), and the dashboard with them
        conn.close()


# --- safe by default ----------------------------------------------------------------------------
def test_beyond_loopback_needs_a_token(orch: Orch) -> None:
    res = orch("ui", "--port", "0", "--bind", "0.0.0.0", timeout=30)
    assert res.returncode == 2 and "--token" in res.stderr
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("gpu01")
    guard = Guard.make("0.0.0.0", 8765, token="t" * 20)
    assert guard.token == "t" * 20 and guard.hosts is None
    with pytest.raises(Exception, match="at least 16"):
        Guard.make("0.0.0.0", 8765, token="short")
    loop = Guard.make("127.0.0.1", 8765)
    assert len(loop.token) >= 32 and "localhost:8765" in (loop.hosts or ())
    assert Guard.make("127.0.0.1", 8765).token != loop.token  # a new one each start


def test_a_token_guards_every_read_when_asked(orch: Orch, dashboards: list[Dashboard]) -> None:
    synthetic_runs(orch, 2)
    ui = serve(dashboards, orch, env={"ORCH_UI_TOKEN": "s3cret-s3cret-s3cret"})
    assert ui.request("/api/runs", token=False)[0] == 401
    assert ui.request("/api/runs", headers={"X-Orch-Token": "wrong-wrong-wrong-wrong"})[0] == 401
    assert ui.get("/api/runs", **{"X-Orch-Token": "s3cret-s3cret-s3cret"})["count"] == 2
    status, page = ui.request("/")  # the page shell holds no data: it loads, then asks with the token
    assert status == 200 and "orch.js" in page


def test_the_token_is_never_taken_from_the_command_line_but_from_a_file_of_the_users_own(
        orch: Orch, dashboards: list[Dashboard], tmp_path: Path) -> None:
    # on a command line it is in every local user's `ps`: refused in one line, nothing served
    res = orch("ui", "--port", "0", "--token", "s3cret-s3cret-s3cret", timeout=30)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "ORCH_UI_TOKEN" in res.stderr, res.stderr
    assert "--token-file" in res.stderr and "s3cret" not in res.stderr
    token_file = tmp_path / "ui-token"
    token_file.write_text("f1le-t0ken-f1le-t0ken\n")
    for mode in (0o644, 0o640, 0o604):  # others may read it: a token anyone can read guards nothing
        token_file.chmod(mode)
        res = orch("ui", "--port", "0", "--token-file", str(token_file), timeout=30)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and "chmod 600" in res.stderr, res.stderr
    for bad in ("", "two words\n"):
        token_file.write_text(bad)
        token_file.chmod(0o600)
        res = orch("ui", "--port", "0", "--token-file", str(token_file), timeout=30)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and "the token alone" in res.stderr, res.stderr
    token_file.write_text("f1le-t0ken-f1le-t0ken\n")
    res = orch("ui", "--port", "0", "--token-file", str(tmp_path / "missing"), timeout=30)
    assert res.returncode == 2 and "No such file" in res.stderr
    synthetic_runs(orch, 1)
    ui = serve(dashboards, orch, "--bind", "127.0.0.1", "--token-file", str(token_file),
               env={"ORCH_UI_TOKEN": "env-t0ken-env-t0ken"})  # the file, given, comes first
    assert ui.token == "f1le-t0ken-f1le-t0ken"
    assert ui.get("/api/runs", **{"X-Orch-Token": "f1le-t0ken-f1le-t0ken"})["count"] == 1
    assert ui.request("/api/runs", headers={"X-Orch-Token": "env-t0ken-env-t0ken"}, token=False)[0] == 401
    shown = Path(f"/proc/{ui.proc.pid}/cmdline").read_bytes()  # what `ps` shows every user
    assert b"t0ken" not in shown and b"--token-file" in shown


OTHER_UID = 61002  # another user of this machine: no passwd entry is needed to be one
PEEK = """
import json, sys, urllib.error, urllib.request
base, db = sys.argv[1:3]
found = {}
for name, headers in (("no_token", {}), ("wrong_token", {"X-Orch-Token": "x" * 32})):
    try:
        with urllib.request.urlopen(urllib.request.Request(base + "/api/runs", headers=headers), timeout=30) as res:
            found[name] = [res.status, res.read().decode()]
    except urllib.error.HTTPError as exc:
        found[name] = [exc.code, exc.read().decode()]
for path in (db, db.rsplit("/", 1)[0]):
    try:
        open(path, "rb").read(1) if path == db else __import__("os").listdir(path)
        found[path] = "read"
    except PermissionError:
        found[path] = "refused"
print(json.dumps(found))
"""


def test_another_user_of_this_machine_gets_nothing_from_a_loopback_dashboard(dashboards: list[Dashboard]) -> None:
    """Any local user can reach a loopback port: without the token the API answers nothing, and the files the
    dashboard writes are its owner's alone. The other user is a real one (another uid) when the tests run as
    root; otherwise the same requests are made as this user."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="orch-ui-owner-", dir="/tmp"))  # a folder anyone may look into
    base.chmod(0o755)
    try:
        owner = Orch(base / "ws")
        (base / "ws").chmod(0o755)
        ui = serve(dashboards, owner)  # a fresh workspace: the dashboard makes runs/ and the database
        runs, db = owner.root / "runs", owner.db
        assert oct(runs.stat().st_mode & 0o777) == "0o700" and oct(db.stat().st_mode & 0o777) == "0o600"
        Store(db).create_run("command", "local", {"cmd": "python train.py --data /private/set"})
        assert ui.get("/api/runs")["count"] == 1  # the owner, with the token the dashboard printed
        as_other = (["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
                    if os.geteuid() == 0 and shutil.which("setpriv") else [])
        res = subprocess.run([*as_other, "/usr/bin/python3", "-c", PEEK, ui.base, str(db)], capture_output=True,
                             text=True, timeout=60, cwd="/", check=False)
        assert res.returncode == 0, res.stderr
        seen = json.loads(res.stdout)
        for name in ("no_token", "wrong_token"):
            status, body = seen[name]
            assert status == 401 and "train.py" not in body and "#token=" in body, (name, seen[name])
        if as_other:
            assert seen[str(db)] == "refused" and seen[str(runs)] == "refused", seen
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_actions_are_off_unless_allowed_and_need_token_and_origin(orch: Orch, dashboards: list[Dashboard]) -> None:
    run_id = int(orch("run", "command", "--detach", *FAST, "--set", "cmd=sleep 120", check=0).stdout)
    ro = serve(dashboards, orch)
    origin = {"Origin": ro.base}
    assert ro.token and "actions" not in ro.log.read_text()
    status, body = ro.request(f"/api/runs/{run_id}/cancel", "POST", origin)
    assert status == 403 and "--allow-actions" in body["error"]
    ro.stop()
    dashboards.remove(ro)
    ui = serve(dashboards, orch, "--allow-actions")
    assert ui.token and f"token: {ui.token}" in ui.log.read_text()
    good = {"Origin": ui.base, "X-Orch-Token": ui.token, "Sec-Fetch-Site": "same-origin"}
    for headers in ({"X-Orch-Token": ui.token},  # no Origin: not from a page of ours
                    {**good, "Origin": "http://evil.example"},
                    {**good, "Sec-Fetch-Site": "cross-site"},
                    {"Origin": ui.base},  # no token
                    {**good, "X-Orch-Token": "x" * 32}):
        status, body = ui.request(f"/api/runs/{run_id}/cancel", "POST", headers, token=False)
        assert status == (403 if headers.get("X-Orch-Token") == ui.token else 401), (headers, body)
    assert orch.status(run_id)["status"] == "running"
    assert ui.request(f"/api/runs/{run_id}/cancel", headers=good)[0] == 405  # a GET never acts
    assert ui.request(f"/api/runs/{run_id}/reboot", "POST", good)[0] == 404
    # a page from another name for this address (DNS rebinding) is not answered at all
    assert ui.request("/api/runs", headers={"Host": f"evil.example:{ui.base.rsplit(':', 1)[1]}"})[0] == 421
    status, body = ui.request(f"/api/runs/{run_id}/cancel", "POST", good)
    assert status == 200, body
    doc = orch.status(run_id)
    assert doc["status"] == "cancelled" and doc["reason"] == "cancelled from the dashboard"
    status, body = ui.request(f"/api/runs/{run_id}/cancel", "POST", good)
    assert status == 409 and "already ended" in body["error"]


def test_every_response_carries_the_safety_headers(orch: Orch, dashboards: list[Dashboard]) -> None:
    ui = serve(dashboards, orch)
    for path in ("/", "/api/runs", "/static/orch.js"):
        with urllib.request.urlopen(urllib.request.Request(ui.base + path, headers={"X-Orch-Token": ui.token}),
                                    timeout=10) as res:
            csp = res.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp
            assert res.headers["x-content-type-options"] == "nosniff"


# --- sweeps, hosts, compare ---------------------------------------------------------------------
def sweep(orch: Orch) -> None:
    """A real sweep on the local host: three points whose job prints SGLang decode lines."""
    line = ("[2025-01-01 00:00:00 TP0] Decode batch, #running-req: 1, #token: 90, token usage: 0.01, "
            "cuda graph: True, gen throughput (token/s): $G, #queue-req: 0")
    cmd = f'for i in 1 2 3; do echo "{line}"; sleep 0.1; done'
    (orch.root / "s.toml").write_text(
        'name = "tput"\nplaybook = "command"\nhosts = ["local"]\n'
        f'[spec]\nengine = "sglang"\npoll_min = 0.05\npoll_max = 0.3\ncmd = {json.dumps(cmd)}\n'
        '[matrix]\n"env.G" = ["40.5", "97.25", "60.0"]\n')
    orch("sweep", "run", str(orch.root / "s.toml"), check=0, timeout=180)


def test_sweep_pivot_marks_the_best(orch: Orch, dashboards: list[Dashboard], browser: Any, tmp_path: Path) -> None:
    sweep(orch)
    ui = serve(dashboards, orch)
    doc = ui.get("/api/sweeps/1")
    assert doc["keys"] == ["env.G"] and "gen_throughput" in doc["metrics"] and doc["objective"] == "gen_throughput"
    best = doc["best"]["gen_throughput"]
    assert doc["points"][best]["point"] == {"env.G": "97.25"}
    assert doc["points"][best]["metrics"]["gen_throughput"] == 97.25 and doc["points"][best]["run_id"]
    assert doc["trend"] == [{"sweep_id": 1, "instance": "", "created_at": doc["created_at"], "best": 97.25}]
    assert [s["id"] for s in ui.get("/api/sweeps")] == [1]
    assert ui.get("/api/runs?sweep=1")["count"] == 3 and ui.get("/api/runs?sweep=2")["count"] == 0
    browser.get(ui.page("/sweeps/1"))
    marked = wait_until(lambda: browser.execute_script(
        "const r = document.querySelector('table.pivot tr.best'); return r && [r.dataset.point, r.innerText]"), 10)
    assert int(marked[0]) == best and "97.25" in marked[1] and "★" in marked[1]
    assert browser.execute_script("return document.querySelectorAll('table.pivot tbody tr').length") == 3
    assert browser.execute_script("return document.querySelectorAll('table.pivot td.best').length") >= 1
    points = browser.execute_script("return [...document.querySelectorAll('.chart svg')].map(s => s.dataset.points)")
    assert points[0] == "3"  # the objective against env.G, a point each
    run_link = browser.find_element("css selector", "table.pivot tr.best a")
    assert run_link.get_attribute("href").endswith(f"/runs/{doc['points'][best]['run_id']}")
    browser.save_screenshot(str(tmp_path / "sweep.png"))


def test_gpus_when_asked_with_the_run_holding_each(orch: Orch, dashboards: list[Dashboard], tmp_path: Path) -> None:
    run_id = int(orch("run", "command", "--detach", "--set", "cleanup=false", *FAST, "--set", "cmd=sleep 120",
                      check=0).stdout)
    pid = orch.status(run_id)["pid"]
    state = tmp_path / "gpu-state.json"
    state.write_text(json.dumps({"gpus": [{"index": 0, "uuid": "GPU-0", "memory_total": 81559, "utilization": 87},
                                          {"index": 1, "uuid": "GPU-1", "memory_total": 81559, "utilization": 0}],
                                 "processes": [{"pid": pid, "gpu": 0, "used_memory": 20000}], "base_memory": 3}))
    env = {"PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}", "ORCH_FAKE_GPU_STATE": str(state)}
    ui = serve(dashboards, orch, env=env)
    hosts = ui.get("/api/hosts")
    assert [h["name"] for h in hosts] == ["local"] and hosts[0]["runs"] == {"running": 1}
    snap = ui.get("/api/hosts/gpus?host=local")["local"]["snapshot"]
    gpu0, gpu1 = snap["gpus"]
    assert gpu0["utilization_pct"] == 87 and gpu0["memory_used_mib"] == 20003 and gpu1["processes"] == []
    assert [(p["pid"], p["run_id"]) for p in gpu0["processes"]] == [(pid, run_id)]
    assert ui.get("/api/hosts/check?host=local")["local"]["ok"]
    assert ui.request("/api/hosts/gpus?host=nope")[0] == 400
    orch("cancel", str(run_id), "--grace", "1", check=0)


def test_compare_is_what_orch_compare_shows(orch: Orch, dashboards: list[Dashboard]) -> None:
    synthetic_runs(orch, 3)
    ui = serve(dashboards, orch)
    assert ui.get("/api/compare?ids=1,3") == json.loads(orch("compare", "1", "3", "--json", check=0).stdout)
    assert ui.get("/api/compare?ids=1,3&all=1")["spec"].keys() == {"cmd"}
    assert ui.request("/api/compare?ids=1")[0] == 400
    assert ui.request("/api/compare?ids=1,x")[0] == 400


# --- the browser --------------------------------------------------------------------------------
@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    driver_path = shutil.which("chromedriver")
    assert driver_path, "chromium-driver is not installed (.ci/run installs it)"
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1100",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(predicate: Any, timeout: float, step: float = 0.05) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("never happened")


def row_of(driver: Any, run_id: int) -> dict[str, str] | None:
    return driver.execute_script(
        "const r = document.querySelector(`tr[data-run='${arguments[0]}']`);"
        "return r && {status: r.dataset.status, text: r.innerText};", run_id)


def test_in_the_browser(orch: Orch, dashboards: list[Dashboard], browser: Any, tmp_path: Path) -> None:
    """The runs page follows a run to its end without a reload, within 2 s of the database; a run page
    shows a `<script>` from the log and the spec as text and runs none of it; the other pages draw."""
    shots = tmp_path / "screenshots"
    shots.mkdir()
    orch("run", "command", *FAST, "--set", f"cmd=echo {shlex.quote(SCRIPT)}; echo orch-metric tok_s=1;"
         " sleep 0.3; echo orch-metric tok_s=3; sleep 0.3; echo orch-metric tok_s=2;"
         f" python3 -c 'import sys; raise RuntimeError(sys.argv[1])' {shlex.quote(SCRIPT)}",
         "--set", f"env.NOTE={SCRIPT}", check=1)
    ui = serve(dashboards, orch)
    gates = [tmp_path / f"step{n}" for n in (5, 15, 25)]
    running = int(orch("run", "command", "--detach", *FAST, "--set",
                       job_cmd("--steps", "30", "--sleep", "0.01", *(a for n, g in zip((5, 15, 25), gates)
                                                                      for a in ("--pause", f"{n}:{g}"))),
                       check=0).stdout)
    browser.get(ui.page("/"))
    wait_until(lambda: row_of(browser, running), 30)
    browser.execute_script("window.notReloaded = true")
    for n, held in zip((5, 15, 25), gates):  # the bar moves on the page as the job goes (held at each step)
        reached(held)
        wait_until(lambda: f"{n}/30" in (row_of(browser, running) or {}).get("text", ""), 30)  # noqa: B023
        release(held)
    wait_until(lambda: row_of(browser, running)["status"] == "succeeded", 60)
    assert browser.execute_script("return window.notReloaded") is True  # how soon after the database: bench/ui.py
    browser.save_screenshot(str(shots / "runs.png"))
    # the filters narrow the table without a reload
    browser.find_element("css selector", "select[name=status]").send_keys("failed")
    wait_until(lambda: browser.execute_script(
        "return [...document.querySelectorAll('tr[data-run]')].map(r => r.dataset.status).join()") == "failed", 5)

    browser.get(ui.page("/runs/1"))
    wait_until(lambda: SCRIPT in browser.execute_script("return document.getElementById('log')?.textContent || ''"), 10)
    assert browser.execute_script("return window.PWNED") is None  # neither the script nor the onerror ran
    assert browser.execute_script("return document.querySelectorAll('main script, main img').length") == 0
    wait_until(lambda: SCRIPT in browser.find_element("id", "error").text, 10)
    hint = ui.get("/api/runs/1")["error"]["hint"]
    assert browser.find_element("css selector", "#error .hint").text == f"try: {hint}"
    assert SCRIPT in browser.find_element("id", "spec").text  # a spec value, escaped too
    assert wait_until(lambda: browser.execute_script(
        "const c = document.querySelector('#charts svg'); return c && Number(c.dataset.points)"), 10) == 3
    assert "orch run command --host local" in browser.find_element("id", "reproduce").text
    browser.save_screenshot(str(shots / "run.png"))

    for page in ("/hosts", "/compare?ids=1,2", "/sweeps"):
        browser.get(ui.page(page))
        wait_until(lambda: browser.execute_script("return document.querySelector('main table, main p.muted') !== null"), 10)
        assert not browser.find_elements("css selector", "main .error")
        browser.save_screenshot(str(shots / (page.strip("/").split("?")[0] + ".png")))
    logs = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE" and "favicon" not in e["message"]]
    assert not logs, logs


def test_in_the_browser_with_an_ssh_host_and_the_engine_emulator(tmp_path: Path, ssh_fleet: Any, dashboards: list[Dashboard],
                                                                 browser: Any) -> None:
    """Runs made by the real run flow on a real sshd host with the SGLang emulator: the runs page follows a
    server through its phases without a reload; a crashed one's page shows its cause and log lines, and
    the served one's page charts its decode throughput."""
    emulator = Path(__file__).parent / "fakes" / "sglang_emulator.py"
    orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(test1={"workdir": str(tmp_path / "r1")}))

    def serve_cmd(*flags: str) -> str:
        argv = [sys.executable, str(emulator), "--shards", "12", "--shard-time", "0.25", *flags]
        return "cmd=" + " ".join(shlex.quote(a) for a in argv)

    orch("run", "command", "--host", "test1", *FAST, "--set", "engine=sglang",
         "--set", serve_cmd("--fail-at-shard", "3", "--crash", "cuda_oom"), check=1)
    loading, serving = tmp_path / "loading", tmp_path / "serving"  # the server waits there for the test
    served = int(orch("run", "command", "--host", "test1", "--detach", *FAST, "--set", "engine=sglang", "--set",
                      serve_cmd("--decode-stats", "12", "--decode-interval", "0.05", "--pause", f"shard:6:{loading}",
                                "--pause", f"decode:6:{serving}"), check=0).stdout)
    ui = serve(dashboards, orch)
    browser.get(ui.page("/"))
    wait_until(lambda: row_of(browser, served), 30)
    browser.execute_script("window.notReloaded = true")
    texts: list[str] = []

    def shows(*words: str) -> bool:
        texts.append((row_of(browser, served) or {}).get("text", ""))
        return any(w in texts[-1] for w in words)

    reached(loading)
    wait_until(lambda: shows("loading"), 60)
    release(loading)
    reached(serving)
    wait_until(lambda: shows("running", "ready"), 60)
    release(serving)
    wait_until(lambda: row_of(browser, served)["status"] == "succeeded", 90)
    assert browser.execute_script("return window.notReloaded") is True
    browser.get(ui.page("/runs/1"))  # the crash: its cause and the log lines around it
    error = "return document.getElementById('error')?.textContent || ''"
    wait_until(lambda: "OutOfMemoryError" in browser.execute_script(error), 10)
    assert "CUDA out of memory" in browser.execute_script(error)
    browser.get(ui.page(f"/runs/{served}"))
    points = wait_until(lambda: browser.execute_script(
        "const c = [...document.querySelectorAll('#charts svg')].map(s => Number(s.dataset.points));"
        "return c.length && Math.max(...c)"), 10)
    assert points >= 12  # gen throughput, one point per decode line
    browser.save_screenshot(str(tmp_path / "ssh-run.png"))


def test_a_run_page_shows_its_receipt_and_why_it_is_invalid(orch: Orch, dashboards: list[Dashboard], browser: Any
                                                            ) -> None:
    """What produced a benchmark's numbers (engine and version, patch sets, the command line, its server's) and
    why they count nowhere, as text: a hostile argument shows as itself and runs nothing."""
    store = Store(orch.db)
    run_id = store.create_run("bench-serving", "local", {"server": 7, "num_prompts": 200})
    for to in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, to)
    argv = f"/e/bin/python -m vllm.entrypoints.cli.main bench serve --seed 0 --label {shlex.quote(SCRIPT)}"
    store.complete_receipt(run_id, {
        "engine": {"name": "vllm", "version": "0.32.0", "packages": {"torch": "2.13.0+cpu"}},
        "patches": [{"name": "slow-decode", "set_hash": "ab12", "package": "vllm", "reverted": True}],
        "argv": argv, "dataset": {"name": "random", "num_prompts": 200, "seed": 0},
        "server": {"run": 7, "ready_at_launch": True, "receipt": {"server_argv": ["vllm", "serve", "--max-model-len", "256"]}}})
    store.mark_invalid(run_id, "141 of 200 benchmark requests failed")
    transition(store, run_id, Status.SUCCEEDED, "exit code 0")
    ui = serve(dashboards, orch)
    browser.get(ui.page(f"/runs/{run_id}"))
    shown = wait_until(lambda: browser.execute_script("return document.getElementById('receipt-json')?.textContent"), 10)
    receipt = json.loads(shown)
    assert receipt["engine"]["version"] == "0.32.0" and receipt["patches"][0]["name"] == "slow-decode"
    assert receipt["argv"] == argv and receipt["server"]["receipt"]["server_argv"][-2:] == ["--max-model-len", "256"]
    assert browser.execute_script("return window.PWNED") is None
    assert "141 of 200 benchmark requests failed (its numbers count nowhere)" in browser.find_element("tag name", "main").text
    browser.get(ui.page("/"))
    row = wait_until(lambda: row_of(browser, run_id), 10)
    assert "invalid" in row["text"], row
