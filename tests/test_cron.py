"""`orch cron` against a python-crontab tab file ($ORCH_CRONTAB, one per test: tests/conftest.py), and
the line it installs run the way cron runs it: /bin/sh with a bare environment. One test drives the real
`crontab` program, for a throwaway system user it creates and removes."""

from __future__ import annotations

import fcntl
import grp
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from orchtest import Orch

FOREIGN = "17 3 * * * /usr/bin/true # someone else's line"


@pytest.fixture
def crontab():
    """The test's tab file with one foreign line; returns a reader of its text."""
    tab = Path(os.environ["ORCH_CRONTAB"])
    tab.write_text(FOREIGN + "\n")
    return tab.read_text


@pytest.fixture
def orch_hosts(tmp_path) -> str:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "nightly.toml").write_text(SWEEP)  # the workspace's sweep file
    return ""  # the built-in `local` host only


SWEEP = ('name = "nightly"\nplaybook = "command"\nhosts = ["local"]\n'
         '[spec]\ncmd = "echo done"\npoll_min = 0.05\npoll_max = 0.3\n[matrix]\n"env.N" = ["1", "2"]\n')


def cron_file(orch: Orch, suffix: str) -> Path:
    """The one lock or log file of the workspace's cron folder."""
    found = list((orch.root / "runs" / "cron").glob(f"*.{suffix}"))
    assert len(found) == 1, found
    return found[0]


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
    assert f"ORCH_HOME={orch.root}" in line and f"{orch.root}/runs/cron/nightly-" in line
    assert f"PATH={os.path.dirname(os.sys.executable)}:" in line
    listed = json.loads(orch("cron", "list", "--json", check=0).stdout)
    assert [e["id"] for e in listed if e["workspace"] == str(orch.root)] == [entry["id"]]
    assert listed[-1]["file"] == str(orch.root / "nightly.toml") and listed[-1]["schedule"] == "0 2 * * *"
    assert FOREIGN in crontab()
    orch("cron", "remove", entry["id"], check=0)
    assert "orch:" not in crontab() and FOREIGN in crontab()


def test_a_duplicate_is_refused_and_dry_run_writes_nothing(orch, crontab):
    nightly = str(orch.root / "nightly.toml")
    before = crontab()
    res = orch("cron", "install", nightly, "--at", "0 2 * * *", "--dry-run", check=0)
    line = res.stdout.strip()
    assert line.startswith("0 2 * * * cd ") and "cron fire" in line and line.split(" # orch:")[1]
    assert crontab() == before and not (orch.root / "runs" / "cron").exists()
    entry = json.loads(orch("cron", "install", nightly, "--at", "0 2 * * *", "--json", check=0).stdout)
    after = crontab()
    # the same file and schedule (however spaced) again: refused, one clear line, nothing written
    for at in ("0 2 * * *", "0  2 * *  *"):
        res = orch("cron", "install", nightly, "--at", at)
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().splitlines() == [
            f"orch: cron entry {entry['id']} already runs {nightly} at '0 2 * * *' (`orch cron remove {entry['id']}` first)"]
        assert orch("cron", "install", nightly, "--at", at, "--dry-run").returncode == 2
    assert crontab() == after
    # another schedule of the same file is another entry
    orch("cron", "install", nightly, "--at", "30 3 * * *", check=0)
    assert crontab().count("# orch:") == 2


def test_list_shows_the_next_run_and_the_last_with_its_result(orch, crontab):
    nightly = str(orch.root / "nightly.toml")
    entry = json.loads(orch("cron", "install", nightly, "--at", "0 2 * * *", "--json", check=0).stdout)
    (listed,) = json.loads(orch("cron", "list", "--json", check=0).stdout)
    assert listed["last_run"] is None
    nxt = time.localtime(listed["next_run"])
    assert (nxt.tm_hour, nxt.tm_min) == (2, 0) and 0 < listed["next_run"] - time.time() <= 86400
    orch("cron", "fire", entry["id"], nightly, "--instance", "2031-01-01", check=0)
    (listed,) = json.loads(orch("cron", "list", "--json", check=0).stdout)
    assert listed["last_run"]["result"] == "succeeded" and listed["last_run"]["ended"] is not None
    (orch.root / "nightly.toml").write_text(SWEEP.replace('cmd = "echo done"', 'cmd = "exit 3"'))
    orch("cron", "fire", entry["id"], nightly, "--instance", "2031-01-02", check=1)
    (listed,) = json.loads(orch("cron", "list", "--json", check=0).stdout)
    assert listed["last_run"]["result"] == "failed (exit 1)"
    table = orch("cron", "list", check=0).stdout
    assert time.strftime("%Y-%m-%d 02:00", nxt) in table and ": failed (exit 1)" in table


def cron_sh(command: str, unescape: bool = True) -> subprocess.CompletedProcess:
    """Run a crontab command as cron does: /bin/sh, HOME/LOGNAME/SHELL and PATH=/usr/bin:/bin only."""
    env = {"HOME": os.environ.get("HOME", "/root"), "LOGNAME": "root", "SHELL": "/bin/sh", "PATH": "/usr/bin:/bin"}
    return subprocess.run(["/bin/sh", "-c", command.replace("\\%", "%") if unescape else command], env=env, cwd="/",
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_line_runs_in_cron_s_bare_environment_and_skips_a_busy_night(orch, crontab):
    entry = json.loads(orch("cron", "install", str(orch.root / "nightly.toml"), "--at", "@daily", "--json",
                            check=0).stdout)
    log = Path(entry["log"])
    lock = log.with_suffix(".lock")
    # the previous night's sweep still holds the lock
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242\n")
    try:
        res = cron_sh(entry["command"])
        assert res.returncode == 0
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
    of_runs = [r["sweep_id"] for r in orch.status()]
    assert sorted((s, of_runs.count(s)) for s in set(of_runs)) == [(sweeps[1]["id"], 2), (sweeps[0]["id"], 2)]
    log = cron_file(orch, "log").read_text()
    assert log.count("end: exit code 0") == 3 and "instance 2031-01-02" in log
    shown = orch("sweep", "status", "nightly", check=0).stdout
    assert shown.startswith(f"sweep {sweeps[0]['id']} nightly 2031-01-02 (command): succeeded")


INJECTED = "\n* * * * * touch orch-cron-injected #"  # no slash: a file name can carry it


def test_a_control_character_in_a_path_adds_no_crontab_entry(tmp_path, crontab):
    """A newline in the sweep file's path, ORCH_HOME or the --hosts path would end the line: refused."""
    before = crontab()
    plain = Orch(tmp_path / "plain")
    odd_home = Orch(tmp_path / f"ws{INJECTED}")
    odd_hosts = tmp_path / f"hosts{INJECTED}.toml"
    odd_hosts.write_text("")
    for name in (f"nightly{INJECTED}.toml", "nightly\rx.toml", "nightly.toml"):
        (plain.root / name).write_text(SWEEP)
    at = ["--at", "0 2 * * *"]
    for orch, argv, what in [
        (plain, ["cron", "install", str(plain.root / f"nightly{INJECTED}.toml"), *at], "the sweep file's path"),
        (plain, ["cron", "install", str(plain.root / "nightly\rx.toml"), *at], "the sweep file's path"),
        (odd_home, ["cron", "install", str(plain.root / "nightly.toml"), *at], "ORCH_HOME"),
        (plain, ["--hosts", str(odd_hosts), "cron", "install", str(plain.root / "nightly.toml"), *at],
         "the --hosts path"),
    ]:
        res = orch(*argv)
        assert res.returncode == 2, (what, res.stdout, res.stderr)
        assert res.stderr.count("\n") == 1 and what in res.stderr and "control character" in res.stderr, res.stderr
    assert crontab() == before
    # the same sweep from a plain path installs, its tag on the line itself
    entry = json.loads(plain("cron", "install", str(plain.root / "nightly.toml"), *at, "--json", check=0).stdout)
    lines = crontab().splitlines()
    assert len(lines) == 2 and lines[1].startswith("0 2 * * * cd ") and lines[1].endswith(f"# orch:{entry['id']}")


def test_two_sweeps_of_the_same_name_in_two_folders_have_their_own_lock_and_log(tmp_path, crontab):
    orch = Orch(tmp_path / "ws")
    files = []
    for folder in ("a", "b"):
        (orch.root / folder).mkdir()
        files.append(orch.root / folder / "hs.toml")
        files[-1].write_text(SWEEP.replace('name = "nightly"', f'name = "hs-{folder}"').replace(', "2"', ""))
    entries = [json.loads(orch("cron", "install", str(f), "--at", "@daily", "--json", check=0).stdout) for f in files]
    logs = [Path(e["log"]) for e in entries]
    assert logs[0] != logs[1] and all(log.name.startswith("hs-") for log in logs)
    # the sweep of a/hs.toml still runs (holds its lock); b/hs.toml is another sweep and runs
    fd = os.open(logs[0].with_suffix(".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        for entry, file in zip(entries, files):
            orch("cron", "fire", entry["id"], str(file), check=0)
    finally:
        os.close(fd)
    assert "skipped: the previous sweep of" in logs[0].read_text()
    assert "start: sweep" not in logs[0].read_text()
    b_log = logs[1].read_text()
    assert f"orch:{entries[1]['id']} end: exit code 0" in b_log and "skipped" not in b_log
    assert [d["name"] for d in json.loads(orch("sweep", "status", "--json", check=0).stdout)] == ["hs-b"]


def test_the_environment_is_the_tests_own(private_home):
    """HOME (so ~/.ssh and ~/.fabric.yaml), the agent and the crontab are never the user's running the tests."""
    assert os.environ["HOME"] == str(private_home) != pwd.getpwuid(os.getuid()).pw_dir
    assert list(private_home.iterdir()) == [] and "SSH_AUTH_SOCK" not in os.environ
    assert Path(os.environ["ORCH_CRONTAB"]).parent == private_home
    res = Orch(private_home / "ws")("cron", "list", "--json", check=0)
    assert json.loads(res.stdout) == []


# orch as another user. The interpreter may live where only root can read (~root/.pyenv), so it starts
# as root, imports what the cron commands use, then drops to the user before orch runs: the `crontab`
# program sees that user's uid, exactly as when they run orch themselves.
AS_USER = """
import os, sys
import crontab, orchestrator.cli, orchestrator.cron, orchestrator.sweep, playbooks, pydantic, rich.table
uid, gid, *args = sys.argv[1:]
os.setgroups([]); os.setgid(int(gid)); os.setuid(int(uid))
orchestrator.cli.main(args)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a throwaway system user needs root")
def test_the_real_crontab_program_for_a_throwaway_user():
    """No ORCH_CRONTAB: install, list and remove through `crontab`, as a user made for this test."""
    name = f"orchcron{secrets.token_hex(3)}"
    home = Path(tempfile.mkdtemp(prefix=f"{name}-"))  # not under tmp_path: that is root's alone
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", str(home),
                    "--shell", "/bin/sh", name], check=True, capture_output=True)
    try:
        uid, gid = pwd.getpwnam(name).pw_uid, grp.getgrnam(name).gr_gid
        os.chown(home, uid, gid)
        ws = home / "ws"
        ws.mkdir()
        (ws / "hosts.toml").write_text("")
        (ws / "nightly.toml").write_text(SWEEP)
        os.chown(ws, uid, gid)
        subprocess.run(["crontab", "-u", name, "-"], input=FOREIGN + "\n", text=True, check=True)
        env = {"HOME": str(home), "USER": name, "LOGNAME": name, "PATH": os.environ["PATH"], "ORCH_HOME": str(ws)}

        def orch(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", AS_USER, str(uid), str(gid), *args], env=env, cwd=home,
                                  capture_output=True, text=True, timeout=60, check=False)

        def their_crontab() -> str:
            return subprocess.run(["crontab", "-u", name, "-l"], capture_output=True, text=True, check=True).stdout

        res = orch("cron", "install", str(ws / "nightly.toml"), "--at", "0 2 * * *", "--json")
        assert res.returncode == 0, res.stderr
        entry = json.loads(res.stdout)
        line = next(ln for ln in their_crontab().splitlines() if ln.endswith(f"# orch:{entry['id']}"))
        assert line.startswith("0 2 * * * cd ") and f"ORCH_HOME={ws}" in line and FOREIGN in their_crontab()
        (listed,) = json.loads(orch("cron", "list", "--json").stdout)
        assert listed["id"] == entry["id"] and time.localtime(listed["next_run"]).tm_hour == 2
        dup = orch("cron", "install", str(ws / "nightly.toml"), "--at", "0 2 * * *")
        assert dup.returncode == 2 and f"cron entry {entry['id']} already runs" in dup.stderr
        assert their_crontab().count("# orch:") == 1
        assert orch("cron", "remove", entry["id"]).returncode == 0
        assert "orch:" not in their_crontab() and FOREIGN in their_crontab()
    finally:
        subprocess.run(["crontab", "-u", name, "-r"], capture_output=True, check=False)
        subprocess.run(["userdel", name], capture_output=True, check=False)
        shutil.rmtree(home, ignore_errors=True)


def as_cron_reads(line: str) -> str:
    """The command cron runs for a tab line: the schedule and orch's comment cut, then cron's own rule:
    `\\%` is a %, an unescaped % ends the command (the rest is its stdin)."""
    command = line.split(" ", 1)[1].rsplit(" # orch:", 1)[0]
    out, i = [], 0
    while i < len(command):
        if command[i] == "\\" and command[i + 1:i + 2] == "%":
            out.append("%")
            i += 2
            continue
        if command[i] == "%":
            break
        out.append(command[i])
        i += 1
    return "".join(out)


def test_a_percent_in_the_sweep_path_reaches_the_sweep(tmp_path, crontab):
    orch = Orch(tmp_path / "at 50% ws")  # a path the shell needs quoted
    nightly = orch.root / "100%-nightly.toml"
    nightly.write_text(SWEEP)
    orch("cron", "install", str(nightly), "--at", "@daily", check=0)
    [line] = [line for line in crontab().splitlines() if "# orch:" in line]
    res = cron_sh(as_cron_reads(line), unescape=False)
    assert res.returncode == 0, res
    (listed,) = json.loads(orch("cron", "list", "--json", check=0).stdout)
    assert listed["file"] == str(nightly) and listed["last_run"]["result"] == "succeeded", listed
