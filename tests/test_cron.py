"""`orch cron` against the real crontab (saved and restored around each test), and the line it installs
run the way cron runs it: /bin/sh with a bare environment."""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import subprocess
import time

import pytest

from orchtest import Orch

FOREIGN = "17 3 * * * /usr/bin/true # someone else's line"


@pytest.fixture
def crontab():
    """The user's crontab with one foreign line, restored to what it was after the test."""
    before = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
    saved = before.stdout if before.returncode == 0 else None
    subprocess.run(["crontab", "-"], input=(saved or "") + FOREIGN + "\n", text=True, check=True)

    def read() -> str:
        return subprocess.run(["crontab", "-l"], capture_output=True, text=True, check=True).stdout

    yield read
    if saved is None:
        subprocess.run(["crontab", "-r"], capture_output=True)
    else:
        subprocess.run(["crontab", "-"], input=saved, text=True, check=True)


@pytest.fixture
def orch(tmp_path) -> Orch:
    o = Orch(tmp_path / "ws")
    (o.root / "nightly.toml").write_text(
        'name = "nightly"\nplaybook = "command"\nhosts = ["local"]\n'
        '[spec]\ncmd = "echo done"\npoll_min = 0.05\npoll_max = 0.3\n[matrix]\n"env.N" = ["1", "2"]\n')
    return o


def test_bad_input_installs_nothing(orch, crontab):
    before = crontab()
    (orch.root / "broken.toml").write_text("playbook = \n")
    for args, message in [
        (["nightly.toml", "--at", "61 2 * * *"], "invalid cron schedule"),
        (["nightly.toml", "--at", "every night"], "invalid cron schedule"),
        (["missing.toml", "--at", "0 2 * * *"], "sweep file not found"),
        (["broken.toml", "--at", "0 2 * * *"], "broken.toml"),
    ]:
        res = orch("cron", "install", str(orch.root / args[0]) if args[0] != "missing.toml" else args[0], *args[1:])
        assert res.returncode == 2 and message in res.stderr, (args, res.stderr)
    assert crontab() == before
    assert orch("cron", "remove", "abc123").returncode == 2


def test_install_list_remove_touch_only_orch_lines(orch, crontab):
    res = orch("cron", "install", str(orch.root / "nightly.toml"), "--at", "0 2 * * *", "--json", check=0)
    entry = json.loads(res.stdout)
    line = next(ln for ln in crontab().splitlines() if f"# orch:{entry['id']}" in ln)
    assert line.startswith("0 2 * * * cd ")
    assert f"ORCH_HOME={orch.root}" in line and f"{orch.root}/runs/cron/nightly.log 2>&1" in line
    assert f"PATH={os.path.dirname(os.sys.executable)}:" in line
    listed = json.loads(orch("cron", "list", "--json", check=0).stdout)
    assert [e["id"] for e in listed if e["workspace"] == str(orch.root)] == [entry["id"]]
    assert listed[-1]["file"] == str(orch.root / "nightly.toml") and listed[-1]["schedule"] == "0 2 * * *"
    assert FOREIGN in crontab()
    orch("cron", "remove", entry["id"], check=0)
    assert "orch:" not in crontab() and FOREIGN in crontab()


def cron_sh(command: str) -> subprocess.CompletedProcess:
    """Run a crontab command as cron does: /bin/sh, HOME/LOGNAME/SHELL and PATH=/usr/bin:/bin only."""
    env = {"HOME": os.environ.get("HOME", "/root"), "LOGNAME": "root", "SHELL": "/bin/sh", "PATH": "/usr/bin:/bin"}
    return subprocess.run(["/bin/sh", "-c", command.replace("\\%", "%")], env=env, cwd="/",
                          capture_output=True, text=True, timeout=60)


def test_the_line_runs_in_cron_s_bare_environment_and_skips_a_busy_night(orch, crontab):
    entry = json.loads(orch("cron", "install", str(orch.root / "nightly.toml"), "--at", "@daily", "--json",
                            check=0).stdout)
    log = orch.root / "runs" / "cron" / "nightly.log"
    lock = orch.root / "runs" / "cron" / "nightly.lock"
    # the previous night's sweep still holds the lock
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242\n")
    try:
        t0 = time.monotonic()
        res = cron_sh(entry["command"])
        assert res.returncode == 0 and time.monotonic() - t0 < 10
        assert f"orch:{entry['id']} skipped: the previous sweep of {orch.root}/nightly.toml still runs (pid 4242)" \
            in log.read_text()
    finally:
        os.close(fd)
    # free: orch itself is found and started (ORCH_HOME, PATH), and hands the file to `orch sweep run`
    days = {time.strftime("%Y-%m-%d")}
    res = cron_sh(entry["command"])
    days.add(time.strftime("%Y-%m-%d"))  # a firing across midnight
    text = log.read_text()
    assert f"orch:{entry['id']} start: sweep {orch.root}/nightly.toml" in text
    assert f"orch:{entry['id']} end: exit code 0" in text, text
    sweeps = orch("sweep", "status", "--json", check=0)
    assert [(d["name"], d["status"]) for d in json.loads(sweeps.stdout)] == [("nightly", "succeeded")]
    # the night's instance is the local date of the firing
    assert json.loads(sweeps.stdout)[0]["instance"] in days


def test_each_night_is_a_new_sweep_and_a_rerun_the_same_night_resumes_it(orch):
    nightly = str(orch.root / "nightly.toml")
    for day in ["2031-01-01", "2031-01-01", "2031-01-02"]:
        orch("cron", "fire", "abc123", nightly, "--instance", day, check=0)
    sweeps = json.loads(orch("sweep", "status", "--json", check=0).stdout)
    assert [(d["instance"], d["status"], d["counts"]) for d in sweeps] == [
        ("2031-01-02", "succeeded", {"succeeded": 2}), ("2031-01-01", "succeeded", {"succeeded": 2})]
    # two nights, two points each: four runs; the second firing of the first night ran nothing
    per_sweep = sqlite3.connect(orch.db).execute("SELECT sweep_id, COUNT(*) FROM runs GROUP BY sweep_id ORDER BY 1")
    assert per_sweep.fetchall() == [(sweeps[1]["id"], 2), (sweeps[0]["id"], 2)]
    log = (orch.root / "runs" / "cron" / "nightly.log").read_text()
    assert log.count("end: exit code 0") == 3 and "instance 2031-01-02" in log
    shown = orch("sweep", "status", "nightly", check=0).stdout
    assert shown.startswith(f"sweep {sweeps[0]['id']} nightly 2031-01-02 (command): succeeded")
