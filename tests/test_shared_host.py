"""A host workdir shared by several workspaces: lease files and run dirs written by someone else are parsed,
never evaluated; symlinks are refused; nobody's run dir is removed, adopted or signalled but its own run's.

Real parts: a real sshd on loopback (the session fleet), the real host program, real files and processes.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from orchtest import FAST, Orch, agent_ops, alive, job_cmd

from orchestrator import runflow
from orchestrator.config.hosts import Host
from orchestrator.config.workspace import Workspace
from orchestrator.host import hostlease, hostprogram
from orchestrator.host.hostjobs.leases import ENDING_S
from orchestrator.host.launch import RunPaths
from orchestrator.host.remote import connect
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.watch import follow


def token(ws: str, run_id: int = 1) -> str:
    return f"laptop:/home/{ws}/runs/orch.db:{run_id}:1700000000.0"


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    return tmp_path / "shared"


@pytest.fixture
def host(ssh_fleet: Any, shared: Path) -> Host:
    return Host(name="test1", **ssh_fleet.host_entry(1, workdir=str(shared)))


def orch_pair(tmp_path: Path, ssh_fleet: Any, shared: Path) -> tuple[Orch, Orch]:
    toml = ssh_fleet.hosts_toml(test1={"workdir": str(shared)})
    return Orch(tmp_path / "ws-a", toml), Orch(tmp_path / "ws-b", toml)


def write_lease(shared: Path, key: str, text: str) -> None:
    (shared / "leases").mkdir(parents=True, exist_ok=True)
    (shared / "leases" / key).write_text(text)


# --- lease files are data, never code --------------------------------------------------------------


def test_a_lease_file_is_never_evaluated(tmp_path: Path, ssh_fleet: Any, shared: Path) -> None:
    a, _ = orch_pair(tmp_path, ssh_fleet, shared)
    pwned = tmp_path / "pwned"
    # the time field of an old-style lease line, as bash arithmetic would run it, for a run dir that exists
    (shared / "runs" / "9").mkdir(parents=True)
    write_lease(shared, "host", f"{token('mallory')}\t{shared}/runs/9\tx[$(touch {pwned})]\n")
    write_lease(shared, "gpu-0", json.dumps({"token": token("eve"), "run_dir": f"$(touch {pwned})",
                                              "taken_at": "$(touch /tmp/x)"}))
    res = a("run", "command", "--host", "test1", *FAST, "--set", "cmd=true")
    assert res.returncode == 0, res.stderr
    assert not pwned.exists()
    warnings = [e["message"] for e in a.status(1)["events"] if e["kind"] == "warning"]
    assert any("ignored host: not a lease file" in w for w in warnings), warnings


def test_a_lease_naming_a_dir_outside_the_workdir_is_not_trusted(host: Host, shared: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / ".orch").mkdir(parents=True)
    (elsewhere / ".orch" / "token").write_text(token("eve"))
    (elsewhere / ".orch" / "pid").write_text(f"1 {Path('/proc/1/stat').read_text().rsplit(')', 1)[1].split()[19]}\n")
    write_lease(shared, "host", json.dumps({"token": token("eve"), "run_dir": str(elsewhere), "taken_at": 1.0}))
    transport = connect(host)
    paths = RunPaths.for_run(str(shared), 1, "aaa")
    warnings = hostlease.take(transport, paths, token("alice"), None)
    assert warnings == ["ignored host: not a lease file"]


# --- symlinks --------------------------------------------------------------------------------------


def test_a_symlinked_lock_is_refused_and_its_target_untouched(host: Host, shared: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (shared / "leases").mkdir(parents=True)
    (shared / "leases" / ".lock").symlink_to(victim)
    with pytest.raises(hostlease.Refused, match="is a symlink"):
        hostlease.take(connect(host), RunPaths.for_run(str(shared), 1, "aaa"), token("alice"), None)
    assert victim.read_text() == "precious\n"
    assert not (shared / "runs" / "aaa" / "1").exists()  # refused before anything was made


def test_a_symlinked_lease_file_is_replaced_never_written_through(host: Host, shared: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (shared / "leases").mkdir(parents=True)
    (shared / "leases" / "host").symlink_to(victim)
    transport, me = connect(host), token("alice")
    assert hostlease.take(transport, RunPaths.for_run(str(shared), 1, "aaa"), me, None) == [
        "ignored host: not a lease file"]
    assert victim.read_text() == "precious\n"
    lease = shared / "leases" / "host"
    assert not lease.is_symlink() and json.loads(lease.read_text())["token"] == me
    hostlease.release(transport, me)
    assert not lease.exists() and victim.read_text() == "precious\n"


def test_a_symlinked_leases_folder_is_refused(host: Host, shared: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    shared.mkdir()
    (shared / "leases").symlink_to(target)
    with pytest.raises(hostlease.Refused, match="is a symlink"):
        hostlease.take(connect(host), RunPaths.for_run(str(shared), 1, "aaa"), token("alice"), None)
    assert list(target.iterdir()) == []


def test_a_symlinked_run_dir_is_refused(host: Host, shared: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (shared / "runs" / "aaa").mkdir(parents=True)
    (shared / "runs" / "aaa" / "1").symlink_to(target)
    with pytest.raises(hostlease.Refused, match="is a symlink"):
        hostlease.take(connect(host), RunPaths.for_run(str(shared), 1, "aaa"), token("alice"), [0])
    assert list(target.iterdir()) == []


# --- who holds a lease, and for how long ------------------------------------------------------------


def test_a_preparing_holder_counts(host: Host, shared: Path) -> None:
    transport = connect(host)
    hostlease.take(transport, RunPaths.for_run(str(shared), 1, "aaa"), token("alice"), [0])
    # alice's run prepares (patches, GPU cleanup): no pid yet, but its lease stands
    with pytest.raises(hostlease.HostLeaseBusy, match=r"GPUs 0 held by .*gpu-0.*preparing"):
        hostlease.take(transport, RunPaths.for_run(str(shared), 1, "bbb"), token("bob"), [0])
    # an older orch's lease line, its run dir not made yet: it counts too
    write_lease(shared, "gpu-1", f"{token('carol')}\t{shared}/runs/7\t{int(time.time())}\n")
    with pytest.raises(hostlease.HostLeaseBusy, match="gpu-1"):
        hostlease.take(transport, RunPaths.for_run(str(shared), 1, "bbb"), token("bob"), [1])
    hostlease.take(transport, RunPaths.for_run(str(shared), 1, "bbb"), token("bob"), [2])


def test_a_future_dated_lease_does_not_block(host: Host, shared: Path) -> None:
    write_lease(shared, "host", json.dumps({"token": token("eve"), "run_dir": f"{shared}/runs/eve/1",
                                            "taken_at": time.time() + 10 * 86400}))
    warnings = hostlease.take(connect(host), RunPaths.for_run(str(shared), 1, "aaa"), token("alice"), None)
    assert len(warnings) == 1 and "in the future" in warnings[0]


def test_a_held_lock_names_its_holder(host: Host, shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (shared / "leases").mkdir(parents=True)
    holder = subprocess.Popen(["flock", str(shared / "leases" / ".lock"), "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while str(holder.pid) not in Path("/proc/locks").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        monkeypatch.setattr(hostlease, "LOCK_WAIT_S", 0.5)
        with pytest.raises(hostlease.HostLeaseBusy, match=rf"held by pid {holder.pid} \(user \w+: flock .*sleep 60"):
            hostlease.take(connect(host), RunPaths.for_run(str(shared), 1, "aaa"), token("alice"), None)
    finally:
        holder.kill()
        holder.wait()


# --- the host owns its GPUs: every workspace asks its lease files ---------------------------------------


def test_another_workspaces_run_is_refused_before_a_run_is_made_and_waited_for_with_queue(
        tmp_path: Path, ssh_fleet: Any, shared: Path) -> None:
    a, b = orch_pair(tmp_path, ssh_fleet, shared)
    gate = tmp_path / "gate"
    held = int(a("run", "command", "--host", "test1", "--detach", *FAST, "--set", "gpus=[0]",
                 "--set", f"cmd=while [ ! -e {gate} ]; do sleep 0.05; done", check=0).stdout)
    theirs = a.status(held)["remote_dir"]
    res = b("run", "command", "--host", "test1", *FAST, "--set", "gpus=[0]", "--set", "cmd=true")
    said = res.stderr.replace("\n", "")  # as wrapped on a terminal
    assert res.returncode == 1 and "GPUs 0 held by another workspace's run" in said, res.stderr
    assert f"{a.db}:{held}:" in said and theirs in said and "--queue waits for it to end" in said, res.stderr
    assert b.status() == []  # refused by the host: no run made, nothing touched
    queued = b.spawn("run", "command", "--host", "test1", *FAST, "--set", "gpus=[0]", "--set", "cmd=true",
                     "--queue")
    try:
        assert queued.stderr is not None
        first = queued.stderr.readline()
        assert first.startswith("waiting: test1: GPUs 0 held by another workspace's run"), first
        assert queued.poll() is None and b.status() == []  # it waits without a run of its own
        gate.touch()
        _, err = queued.communicate(timeout=90)
    finally:
        if queued.poll() is None:
            queued.kill()
            queued.wait()
    assert queued.returncode == 0, err
    assert a.status(held)["status"] == "succeeded" and b.status(1)["status"] == "succeeded"
    b.wait_finished(1, timeout=60)
    assert not (shared / "leases" / "gpu-0").exists()


def lease_requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The lease requests this process makes to hosts' agents from now on, by action."""
    from orchestrator.host import agent

    actions: list[str] = []
    asked = agent.call

    def counting(transport: Any, op: str, timeout: float = 60, **args: Any) -> Any:
        if op == "lease":
            actions.append(args["action"])
        return asked(transport, op, timeout, **args)

    monkeypatch.setattr(agent, "call", counting)
    return actions


def in_process_start(tmp_path: Path, queue: bool = False, on_wait: Any = None) -> tuple[Store, Any]:
    """`runflow.start` of `cmd=true` on GPU 0 of test1, in workspace b (beside `orch_pair`'s a): its store and
    its Job."""
    from orchestrator.config.hosts import Inventory
    from orchestrator.runflow import registry
    from playbooks.command import CommandSpec

    ws = Workspace(root=tmp_path / "ws-b", hosts_file=tmp_path / "ws-a" / "hosts.toml")
    store = Store(ws.db_path)
    spec = CommandSpec(cmd="true", gpus=[0], poll_min=0.05, poll_max=0.3)
    host = Inventory.load(ws.hosts_file, ws.root).get("test1")
    return store, runflow.start(ws, store, registry.playbook("command"), spec, host, queue=queue, on_wait=on_wait)


def test_a_start_makes_one_lease_request_on_its_host(tmp_path: Path, ssh_fleet: Any, shared: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The host is asked once, by the take that makes the run's lease files and run dir; its end releases
    them once."""
    orch_pair(tmp_path, ssh_fleet, shared)
    actions = lease_requests(monkeypatch)
    store, job = in_process_start(tmp_path)
    try:
        assert actions == ["take"]
        lease = json.loads((shared / "leases" / "gpu-0").read_text())
        assert lease["run_dir"] == job.paths.root == store.get_run(job.run_id).remote_dir
        follow.watch(job)
        assert store.get_run(job.run_id).status is Status.SUCCEEDED
        assert actions == ["take", "release"] and not (shared / "leases" / "gpu-0").exists()
    finally:
        store.close()


def test_a_queued_run_waits_on_its_one_take_without_a_run_and_touches_nothing(
        tmp_path: Path, ssh_fleet: Any, shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While another workspace's run holds the GPUs, a queued start makes the same take again after each
    refusal: no run of its own meanwhile, nothing made on the host; then it goes on once that run ended."""
    import threading

    a, _ = orch_pair(tmp_path, ssh_fleet, shared)
    gate = tmp_path / "gate"
    held = int(a("run", "command", "--host", "test1", "--detach", *FAST, "--set", "gpus=[0]",
                 "--set", f"cmd=while [ ! -e {gate} ]; do sleep 0.05; done", check=0).stdout)
    actions = lease_requests(monkeypatch)
    told: list[str] = []
    waited_twice = threading.Event()

    def on_wait(busy: Exception) -> None:
        told.append(str(busy))
        if len(told) >= 2:
            waited_twice.set()

    started: list[Any] = []
    starter = threading.Thread(target=lambda: started.append(in_process_start(tmp_path, queue=True, on_wait=on_wait)))
    starter.start()
    try:
        assert waited_twice.wait(60), "the run never waited for the host"
        assert "GPUs 0 held by another workspace's run" in told[0] and f"{a.db}:{held}:" in told[0]
        assert set(actions) == {"take"} and len(actions) >= len(told)  # one request per try, nothing else
        peek = Store(tmp_path / "ws-b" / "runs" / "orch.db")
        try:
            assert peek.list_runs() == []  # no run of its own while it waits
        finally:
            peek.close()
        theirs = Path(a.status(held)["remote_dir"]).parent.name
        assert sorted(p.name for p in (shared / "runs").iterdir()) == sorted([theirs, "hostjobs"])  # nothing of b's
    finally:
        gate.touch()
        starter.join(90)
    assert started, "the queued start did not go on"
    store, job = started[0]
    try:
        assert actions[-1] == "take" and job.run_id == 1
        follow.watch(job)
        assert store.get_run(1).status is Status.SUCCEEDED and a.status(held)["status"] == "succeeded"
    finally:
        store.close()


def test_a_run_across_hosts_refused_by_one_host_keeps_nothing_on_the_others(tmp_path: Path, ssh_fleet: Any) -> None:
    """Another workspace holds GPU 0 of test2; a run asking for GPU 0 of test1 and test2 is refused naming
    that run, with no run made, and what test1 granted first (hosts go in name order) is given back: no lease
    file, no run dir."""
    one, two = tmp_path / "w1", tmp_path / "w2"
    toml = ssh_fleet.hosts_toml(test1={"workdir": str(one)}, test2={"workdir": str(two)})
    a, b = Orch(tmp_path / "ws-a", toml), Orch(tmp_path / "ws-b", toml)
    gate = tmp_path / "gate"
    held = int(a("run", "command", "--host", "test2", "--detach", *FAST, "--set", "gpus=[0]",
                 "--set", f"cmd=while [ ! -e {gate} ]; do sleep 0.05; done", check=0).stdout)
    try:
        res = b("run", "command", "--host", "test1", "--host", "test2", *FAST, "--set", "gpus=[0]",
                "--set", "cmd=true")
        said = res.stderr.replace("\n", "")
        assert res.returncode == 1 and "test2: GPUs 0 held by another workspace's run" in said, res.stderr
        assert f"{a.db}:{held}:" in said and b.status() == []
        assert (one / "runs").is_dir()  # test1 was asked, and granted, first
        assert not (one / "leases" / "gpu-0").exists() and list((one / "runs").glob("*/1")) == []
    finally:
        gate.touch()


def test_the_leases_program_runs_through_the_agent_and_no_shell_command(
        host: Host, shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.host.remote import SSHTransport

    commands: list[str] = []

    class Counting(SSHTransport):
        def run(self, command: str, **kwargs: Any) -> Any:  # type: ignore[override]
            commands.append(command)
            return super().run(command, **kwargs)

    ops = agent_ops(monkeypatch)
    transport = Counting(host)
    try:
        me, bob = token("alice"), token("bob")
        assert hostlease.take(transport, RunPaths.for_run(str(shared), 1, "aaa"), me, [0]) == []
        with pytest.raises(hostlease.HostLeaseBusy, match=r"GPUs 0 held by another workspace's run .*preparing"):
            hostlease.take(transport, RunPaths.for_run(str(shared), 1, "bbb"), bob, [0])
        assert not (shared / "runs" / "bbb").exists()  # refused: nothing made for bob's run
        assert hostlease.take(transport, RunPaths.for_run(str(shared), 1, "bbb"), bob, [1]) == []
        hostlease.release(transport, me)
        hostlease.take(transport, RunPaths.for_run(str(shared), 2, "bbb"), token("bob", 2), [0])
        # the agent's requests only: no shell line at all (the upload makes its folder over SFTP)
        assert commands == []
        # each an op of the agent already running there: no process started on the host for a lease
        assert ops == ["lease"] * 5
        placed = list((shared / "runs" / "hostjobs").glob("hostjobs-*.zip"))
        assert len(placed) == 1 and placed[0].read_bytes() == hostprogram.archive()
    finally:
        transport.close()


# --- run dirs: removed, adopted or signalled only by their own run ----------------------------------


def test_rm_removes_only_a_dir_holding_its_runs_token(tmp_path: Path, ssh_fleet: Any, shared: Path) -> None:
    a, b = orch_pair(tmp_path, ssh_fleet, shared)
    held = int(a("run", "command", "--host", "test1", "--detach", *FAST, "--set", "gpus=[0]",
                 "--set", job_cmd("--steps", "600", "--sleep", "0.1"), check=0).stdout)
    theirs = Path(a.status(held)["remote_dir"])
    assert b("run", "command", "--host", "test1", *FAST, "--set", "gpus=[1]", "--set", "cmd=true").returncode == 0
    mine = Path(b.status(1)["remote_dir"])
    assert mine.is_dir() and mine != theirs
    outside = tmp_path / "outside" / "runs" / "2"
    outside.mkdir(parents=True)
    (outside / "keep").write_text("x")
    assert b("run", "command", "--host", "test1", *FAST, "--set", "gpus=[1]", "--set", "cmd=true").returncode == 0
    assert b("run", "command", "--host", "test1", *FAST, "--set", "gpus=[1]", "--set", "cmd=true").returncode == 0
    with sqlite3.connect(b.db) as db:  # records pointing at a's live run dir, and outside the workdir
        db.execute("UPDATE runs SET remote_dir = ? WHERE id = 2", (str(theirs),))
        db.execute("UPDATE runs SET remote_dir = ? WHERE id = 3", (str(outside),))
    res = b("rm", "1", "2", "3")
    assert res.returncode == 1
    assert "run 1 removed" in res.stderr and not mine.exists()
    assert "run 2 kept" in res.stderr and "holds another run" in res.stderr, res.stderr
    assert "run 3 kept" in res.stderr and "not a run dir under" in res.stderr, res.stderr
    assert (theirs / ".orch" / "pid").exists() and (outside / "keep").exists()
    assert a.status(held)["status"] == "running"
    a("cancel", str(held), "--grace", "1", check=0)


def test_an_orphan_never_adopts_a_pid_from_another_runs_dir(tmp_path: Path, ssh_fleet: Any, shared: Path) -> None:
    a, _ = orch_pair(tmp_path, ssh_fleet, shared)
    held = int(a("run", "command", "--host", "test1", "--detach", *FAST,
                 "--set", job_cmd("--steps", "600", "--sleep", "0.1"), check=0).stdout)
    theirs = a.status(held)["remote_dir"]
    # b's run, its controller dead while launching, recorded with a's run dir
    ws = Workspace(root=tmp_path / "ws-b", hosts_file=tmp_path / "ws-a" / "hosts.toml")
    store = Store(ws.db_path)
    run_id = store.create_run("command", "test1", {"cmd": "true"})
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    store.update_run(run_id, remote_dir=theirs)
    run = runflow.open_run(ws, store, run_id)
    record = runflow.settle_orphan(run)
    assert record.status is Status.FAILED and record.pid is None and "another run's" in (record.reason or ""), record
    assert a.status(held)["status"] == "running"
    store.close()
    a("cancel", str(held), "--grace", "1", check=0)


# --- two Unix users sharing one group-writable workdir ------------------------------------------------

USERS = {"orchalice": 61001, "orchbob": 61002}
GROUP, GID = "orchshare", 61000


@pytest.fixture
def two_users(tmp_path: Path) -> Any:
    """An sshd on loopback in a private mount namespace whose /etc/passwd, group and shadow list two more
    users sharing a group (the machine's own files are never written), and a workdir of that group."""
    import shutil
    import tempfile

    from sshd import SSHServer, keygen, public_key

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (a mount namespace)")
    base = Path(tempfile.mkdtemp(prefix="orch-two-users-", dir="/tmp"))
    base.chmod(0o755)
    etc = base / "etc"
    etc.mkdir()
    passwd = Path("/etc/passwd").read_text() + "".join(
        f"{u}:x:{uid}:{GID}::{base / u}:/bin/bash\n" for u, uid in USERS.items())
    (etc / "passwd").write_text(passwd)
    (etc / "group").write_text(Path("/etc/group").read_text() + f"{GROUP}:x:{GID}:{','.join(USERS)}\n")
    (etc / "shadow").write_text("".join(f"{u}:*:19000:0:99999:7:::\n" for u in USERS))
    for user, uid in USERS.items():
        (base / user).mkdir(mode=0o700)
        os.chown(base / user, uid, GID)
    key = keygen(base / "id_ed25519")
    (base / "authorized_keys").write_text(public_key(key) + "\n")
    (base / "authorized_keys").chmod(0o644)
    shared = base / "shared"
    shared.mkdir()
    os.chown(shared, 0, GID)
    shared.chmod(0o2770)
    binds = " && ".join(f"mount --bind {etc / f} /etc/{f}" for f in ("passwd", "group", "shadow"))
    server = SSHServer(tmp_path / "sshd-two-users", "127.0.0.9", base / "authorized_keys",
                       prefix=["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{binds} && exec "$@"',
                               "sh"])
    server.start()
    known = base / "known_hosts"
    known.write_text(server.host_key_line + "\n")
    try:
        yield server, base, shared, key, known
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def user_workspace(tmp_path: Path, two_users: Any, user: str) -> Orch:
    server, _, shared, key, known = two_users
    return Orch(tmp_path / user, (
        f'[hosts.box]\naddress = "{server.address}"\nport = {server.port}\nuser = "{user}"\n'
        f'identity_file = "{key}"\nknown_hosts = "{known}"\nworkdir = "{shared}"\npython = "/usr/bin/python3"\n'
        "shared_workdir = true\n"))


def as_user(user: str, command: str) -> None:
    """A shell command run as one of the two users (this test process is root)."""
    res = subprocess.run(["sh", "-c", command], user=USERS[user], group=GID, capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stderr


def test_two_users_run_side_by_side_on_one_shared_workdir(tmp_path: Path, two_users: Any) -> None:
    shared = two_users[2]

    def workspace(user: str) -> Orch:
        return user_workspace(tmp_path, two_users, user)

    alice, bob = workspace("orchalice"), workspace("orchbob")
    long_job = "cmd=echo started; sleep 3600"  # until the test cancels it, however slow the machine
    a = int(alice("run", "command", "--host", "box", "--detach", *FAST, "--set", "gpus=[0]", "--set", long_job,
                  check=0).stdout)
    b = int(bob("run", "command", "--host", "box", "--detach", *FAST, "--set", "gpus=[1]", "--set", long_job,
                check=0).stdout)
    assert a == b == 1  # the same id in both workspaces, each in a dir of its own
    dir_a, dir_b = Path(alice.status(a)["remote_dir"]), Path(bob.status(b)["remote_dir"])
    assert dir_a != dir_b and dir_a.stat().st_uid == USERS["orchalice"] and dir_b.stat().st_uid == USERS["orchbob"]
    leases = shared / "leases"
    assert sorted(p.name for p in leases.iterdir() if not p.name.startswith(".")) == ["gpu-0", "gpu-1"]
    # bob may not take alice's GPU (the host refuses before he makes a run), nor remove or adopt her run dir
    res = bob("run", "command", "--host", "box", *FAST, "--set", "gpus=[0]", "--set", "cmd=true")
    assert res.returncode == 1 and "GPUs 0 held by another workspace's run" in res.stderr, res.stderr
    assert [d["id"] for d in bob.status()] == [b]
    assert bob("run", "command", "--host", "box", *FAST, "--set", "gpus=[2]", "--set", "cmd=true").returncode == 0
    with sqlite3.connect(bob.db) as db:  # a record pointing at alice's run dir: no command writes one
        db.execute("UPDATE runs SET remote_dir = ? WHERE id = 2", (str(dir_a),))
    assert bob("rm", "2").returncode == 1 and (dir_a / ".orch" / "pid").exists()
    # bob's cancel stops only his own job; alice's runs on
    bob("cancel", str(b), "--grace", "1", check=0)
    bob.wait_finished(b, timeout=60)
    assert bob.status(b)["status"] == "cancelled" and alice.status(a)["status"] == "running"
    assert not (leases / "gpu-1").exists() and (leases / "gpu-0").exists()
    assert bob("rm", str(b)).returncode == 0 and not dir_b.exists() and dir_a.exists()
    alice("cancel", str(a), "--grace", "1", check=0)
    alice.wait_finished(a, timeout=60)
    assert not (leases / "gpu-0").exists()


# --- a way out of every state -------------------------------------------------------------------------


def test_a_run_whose_host_or_playbook_is_gone_can_be_ended_and_removed(tmp_path: Path, ssh_fleet: Any,
                                                                     shared: Path) -> None:
    a, _ = orch_pair(tmp_path, ssh_fleet, shared)
    first = int(a("run", "command", "--host", "test1", "--detach", *FAST, "--set", "gpus=[0]",
                  "--set", "cmd=sleep 60", check=0).stdout)
    second = int(a("run", "command", "--host", "test1", "--detach", *FAST, "--set", "gpus=[1]",
                   "--set", "cmd=sleep 60", check=0).stdout)
    pids = [int((Path(a.status(r)["remote_dir"]) / ".orch" / "pid").read_text().split()[0]) for r in (first, second)]
    with sqlite3.connect(a.db) as db:  # its plugin uninstalled
        db.execute("UPDATE runs SET playbook = 'gone-plugin' WHERE id = ?", (second,))
    res = a("cancel", str(second), "--grace", "1")
    assert res.returncode == 0 and a.status(second)["status"] == "cancelled", res.stderr
    a.wait_finished(second, timeout=60)
    assert not alive(pids[1])
    (a.root / "hosts.toml").write_text("")  # test1 removed from the inventory
    res = a("cancel", str(first))
    assert res.returncode == 0 and "no longer in the inventory" in res.stderr, res.stderr
    doc = a.status(first)
    assert doc["status"] == "cancelled" and "was not stopped" in doc["reason"]
    res = a("rm", str(first))
    assert res.returncode == 0 and "no longer in the inventory" in res.stderr and a.status() != [], res.stderr
    assert [d["id"] for d in a.status()] == [second]
    os.killpg(pids[0], 9)


def test_pull_copies_at_most_what_it_listed(tmp_path: Path, host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file swapped for a symlink to /dev/zero after the listing (an active run's dir) is left out, and one
    that grew adds nothing."""
    from types import SimpleNamespace

    from orchestrator.host import agent
    from orchestrator.host.remote import SSHTransport
    from orchestrator.runflow import fetching

    root = tmp_path / "run"
    root.mkdir()
    (root / "log").write_bytes(b"x" * 1000)
    (root / "out").write_bytes(b"y" * 10)
    asked = agent.call

    def swapping(transport: Any, op: str, timeout: float = 60, **args: Any) -> Any:
        result = asked(transport, op, timeout, **args)
        if op == "files":  # right after the listing
            (root / "out").unlink()
            (root / "out").symlink_to("/dev/zero")
            with (root / "log").open("ab") as f:
                f.write(b"z" * 5000)
        return result

    monkeypatch.setattr(agent, "call", swapping)
    transport = SSHTransport(host)
    run = SimpleNamespace(paths=RunPaths(str(root)), transport=transport, host=host, run_id=1)
    pulled = fetching.pull(run, tmp_path / "to", limit=2000)  # type: ignore[arg-type]
    assert (pulled.files, pulled.size) == (1, 1000)
    assert (tmp_path / "to" / "log").read_bytes() == b"x" * 1000 and not (tmp_path / "to" / "out").exists()
    transport.close()


def test_the_tail_of_a_log_without_newlines_is_bounded(tmp_path: Path, host: Host) -> None:
    from orchestrator.host.launch import TAIL_BYTES, HostExecutor

    root = tmp_path / "run"
    root.mkdir()
    with (root / "log").open("wb") as f:
        f.truncate(64 << 20)  # 64 MiB, not one newline
    tail = HostExecutor(connect(host)).tail(RunPaths(str(root)), 200)
    assert len(tail) == TAIL_BYTES


@pytest.mark.parametrize("plant", ["module", "pid file"])
def test_a_run_dir_swapped_after_the_take_is_refused_at_the_launch(tmp_path: Path, two_users: Any,
                                                                   monkeypatch: pytest.MonkeyPatch, plant: str) -> None:
    """Bob made the shared workdir's runs/ (so he may rename what is in it): right after alice's run took its
    lease and claimed its run dir, he puts a folder of his own in its place, with a `hashlib.py` in the run
    dir, or a pid file naming one of alice's own processes. Alice's launch refuses his folder: nothing of his
    runs as her, and her process is neither adopted as the job nor signalled."""
    from orchestrator.config.hosts import Inventory
    from orchestrator.errors import OrchError
    from orchestrator.runflow import registry
    from playbooks.command import CommandSpec

    _, _, shared, _, _ = two_users
    alice = user_workspace(tmp_path, two_users, "orchalice")
    as_user("orchbob", f"mkdir -m 3770 {shared}/runs")  # as a shared workdir's first orch makes it
    proof = shared / "pwned"
    victim = subprocess.Popen(["sleep", "300"], user=USERS["orchalice"], group=GID)
    real_take = hostlease.take

    def take_then_swap(transport: Any, paths: RunPaths, run_token: str, *args: Any, **kwargs: Any) -> Any:
        said = real_take(transport, paths, run_token, *args, **kwargs)
        run_dir = Path(paths.root)
        start = Path(f"/proc/{victim.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        files = {"module": {"hashlib.py": f"open({str(proof)!r}, 'w').write('ran')\n"},
                 "pid file": {".orch/token": run_token, ".orch/pid": f"{victim.pid} {start}\n"}}[plant]
        as_user("orchbob", f"mv {run_dir.parent} {run_dir.parent}.old && mkdir -p {run_dir}/.orch && "
                           f"chmod 2777 {run_dir.parent} {run_dir} {run_dir}/.orch")
        for name, text in files.items():
            as_user("orchbob", f"printf %s '{text}' > {run_dir / name} && chmod 0666 {run_dir / name}")
        return said

    monkeypatch.setattr(hostlease, "take", take_then_swap)
    ws = Workspace(root=alice.root, hosts_file=alice.root / "hosts.toml")
    store = Store(ws.db_path)
    host = Inventory.load(ws.hosts_file, ws.root).get("box")
    try:
        with pytest.raises(OrchError, match="belongs to uid 61002, not to this user"):
            runflow.start(ws, store, registry.playbook("command"), CommandSpec(cmd="echo hi", poll_min=0.05,
                                                                                poll_max=0.3), host)
        run = store.get_run(1)
        assert run.status is Status.FAILED and run.pid is None, run
        assert not proof.exists() and victim.poll() is None
    finally:
        store.close()
        victim.kill()
        victim.wait()


def test_a_shared_workdir_first_checked_by_one_user_runs_the_others_jobs(tmp_path: Path, two_users: Any) -> None:
    """The folders orch makes in a shared workdir (runs/, its programs' folder, leases/) are the group's to
    write in and sticky, whoever made them first and whatever made them (a `hosts --check`)."""
    _, _, shared, _, _ = two_users
    alice, bob = (user_workspace(tmp_path, two_users, u) for u in ("orchalice", "orchbob"))
    alice("hosts", "--check", check=0)
    assert bob("run", "command", "--host", "box", *FAST, "--set", "gpus=[0]", "--set", "cmd=true").returncode == 0
    assert alice("run", "command", "--host", "box", *FAST, "--set", "gpus=[0]", "--set", "cmd=true").returncode == 0
    for folder, mode in ((shared / "runs", 0o3070), (shared / "leases", 0o3070), (shared / "runs" / "hostjobs", 0o2070)):
        assert folder.stat().st_mode & mode == mode, (folder, oct(folder.stat().st_mode))
    theirs = Path(alice.status(1)["remote_dir"]).parent
    with pytest.raises(AssertionError, match="Operation not permitted"):  # nobody renames another's run dirs
        as_user("orchbob", f"mv {theirs} {theirs}.old")


def test_a_users_lease_file_is_neither_removed_nor_forged_by_another(tmp_path: Path, two_users: Any) -> None:
    """Lease files in a shared leases/ are their writers' alone: another group member can neither delete one
    nor write one in someone else's name; an ended lease of another user that cannot be replaced is
    written beside (KEY.UID), seen as the key's by every workspace, and released like any other."""
    from orchestrator.config.hosts import Inventory

    _, _, shared, _, _ = two_users
    alice, bob = (user_workspace(tmp_path, two_users, u) for u in ("orchalice", "orchbob"))
    ta, tb = (connect(Inventory.load(o.root / "hosts.toml", o.root).get("box")) for o in (alice, bob))
    try:
        mine, his = token("alice"), token("bob")
        hostlease.take(ta, RunPaths.for_run(str(shared), 1, "aaa"), mine, [0])
        leases = shared / "leases"
        with pytest.raises(AssertionError, match="Operation not permitted"):
            as_user("orchbob", f"rm -f {leases}/gpu-0")
        # bob writes a fresh lease in alice's name: it is none, and blocks nobody
        forged = json.dumps({"token": token("carol"), "run_dir": f"{shared}/runs/ccc/1", "taken_at": time.time(),
                             "uid": USERS["orchalice"]})
        as_user("orchbob", f"printf %s '{forged}' > {leases}/gpu-3")
        assert hostlease.take(tb, RunPaths.for_run(str(shared), 1, "bbb"), his, [3]) == [
            "ignored gpu-3: not a lease file"]
        hostlease.release(tb, his)
        # alice's run ended long ago, her lease left behind: bob takes the key beside it, and alice sees his
        ended = shared / "runs" / "aaa" / "1" / ".orch" / "exit_code"
        ended.write_text("0\n")
        os.utime(ended, (time.time() - ENDING_S - 1,) * 2)
        hostlease.take(tb, RunPaths.for_run(str(shared), 2, "bbb"), his, [0])
        assert (leases / f"gpu-0.{USERS['orchbob']}").exists()
        with pytest.raises(hostlease.HostLeaseBusy, match=r"GPUs 0 held by another workspace's run \(gpu-0: "):
            hostlease.take(ta, RunPaths.for_run(str(shared), 2, "aaa"), mine + "x", [0])
        hostlease.release(tb, his)
        assert not (leases / f"gpu-0.{USERS['orchbob']}").exists()
        hostlease.take(ta, RunPaths.for_run(str(shared), 3, "aaa"), mine, [0])
    finally:
        ta.close()
        tb.close()
