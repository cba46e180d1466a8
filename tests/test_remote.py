"""The transports against real OpenSSH servers on loopback (tests/sshd.py) and against this machine."""

from __future__ import annotations

import os
import pwd
import re
import socket
import stat
import threading
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sshd import SSHFleet, alive, descendants, keygen, public_key

from orchestrator.config.hosts import Host, Inventory, local_host
from orchestrator.errors import AuthFailed, HostKeyError, RemoteError, Unreachable
from orchestrator.host.remote import (
    LocalTransport,
    SSHTransport,
    Transport,
    close_all,
    connect,
    env_exports,
    quote,
    ssh_retry,
)


def fingerprint(public: str) -> str:
    """`SHA256:...` of a public key line, as the real ssh-keygen -l prints it."""
    import subprocess

    out = subprocess.run(["ssh-keygen", "-lf", "-"], input=public + "\n", capture_output=True, text=True,
                         check=True).stdout
    return out.split()[1]


class Sleeps(list[float]):
    """A stand-in for time.sleep that records the waits instead of waiting."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def ssh_transport(host: Host) -> tuple[SSHTransport, Sleeps]:
    transport = SSHTransport(host)
    sleeps = Sleeps()
    transport.retry_sleep = sleeps  # type: ignore[assignment]
    return transport, sleeps


@pytest.fixture
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $HOME, so ~/.ssh/known_hosts (and keys, config, ssh-agent) of the real user play no part."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


@pytest.fixture(params=["ssh", "local"])
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Transport]:
    """The same contract on both transports."""
    t: Transport
    if request.param == "ssh":
        t, _ = ssh_transport(request.getfixturevalue("ssh_host"))
    else:
        t = LocalTransport(local_host(tmp_path))
    try:
        yield t
    finally:
        t.close()


def client_port(t: Transport) -> str:
    """The client side of the TCP connection that carried this command, as sshd saw it."""
    return t.run('printf %s "$SSH_CONNECTION"').stdout.split()[1]


# -- the command contract (both transports) -------------------------------------------------------------


def test_exit_code_stdout_and_stderr(transport: Transport) -> None:
    r = transport.run("echo out; echo err >&2; exit 3", check=False)
    assert (r.exit_code, r.stdout, r.stderr, r.ok) == (3, "out\n", "err\n", False)

    ok = transport.run("printf 'a\\nb'")
    assert (ok.exit_code, ok.stdout, ok.stderr, ok.ok) == (0, "a\nb", "", True)
    assert ok.host == transport.host.name


def test_failure_raises_with_command_code_and_output(transport: Transport) -> None:
    with pytest.raises(RemoteError) as info:
        transport.run("echo first; echo 'last words' >&2; exit 7")
    err = info.value
    assert err.remote_exit_code == 7 and err.exit_code == 1
    assert err.host == transport.host.name
    assert "exit 7" in err.command
    assert "last words" in str(err) and "exit code 7" in str(err)


def test_invalid_utf8_output_does_not_crash(transport: Transport) -> None:
    r = transport.run("printf 'ok \\377\\376 \\303 end'; printf '\\200' >&2")
    assert r.stdout.startswith("ok ") and r.stdout.endswith(" end")
    assert "\ufffd" in r.stdout and "\ufffd" in r.stderr


HOSTILE = [
    "; touch {marker}",
    "$(touch {marker})",
    "`touch {marker}`",
    "' ; touch {marker} ; '",
    '" ; touch {marker} ; "',
    "\"$(touch {marker})\"",
    "line one\ntouch {marker}\n",
    "&& touch {marker} || touch {marker} | touch {marker} &",
    "> {marker}",
    "$HOME ${{HOME}} * ? [a-z] ~ \\ \\\\ \\n %s %d",
    "-n",
    "",
    "tab\tcr\rnul-free ünïcødé ✓",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_quoted_values_arrive_verbatim(transport: Transport, tmp_path: Path, template: str) -> None:
    marker = tmp_path / "pwned"
    value = template.format(marker=marker)
    r = transport.run(f"printf %s {quote(value)}")
    assert r.stdout == value
    r = transport.run(env_exports({"ORCH_VALUE": value}) + 'printf %s "$ORCH_VALUE"')
    assert r.stdout == value
    assert not marker.exists()


def test_put_writes_bytes_atomically(transport: Transport, tmp_path: Path) -> None:
    data = bytes(range(256)) * 4096 + b"\x00tail"  # every byte value, ~1 MiB
    target = tmp_path / "up" / "load" / "blob.bin"
    transport.put(data, str(target), mode=0o600)
    assert target.read_bytes() == data
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["blob.bin"]  # no .tmp left behind
    assert transport.run(f"wc -c < {quote(str(target))}").stdout.strip() == str(len(data))

    transport.put(b"second", str(target))  # replaces
    assert target.read_bytes() == b"second"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_expand_resolves_the_home_of_the_host(transport: Transport) -> None:
    home = transport.run('printf %s "$HOME"').stdout
    assert home.startswith("/")
    if isinstance(transport, SSHTransport):
        assert home == pwd.getpwnam(transport.host.user or "").pw_dir
    assert transport.expand("~/x") == home + "/x"
    assert transport.expand("~") == home
    assert transport.expand("/abs/~/x") == "/abs/~/x"
    assert transport.expand("~other/x") == "~other/x"


def test_timeout_is_a_remote_error_and_the_transport_survives(transport: Transport) -> None:
    with pytest.raises(RemoteError) as info:
        transport.run("sleep 5", timeout=0.5)
    assert info.value.remote_exit_code is None and "timed out" in str(info.value)
    assert transport.run("echo still here").stdout == "still here\n"


# -- SSH specifics ------------------------------------------------------------------------------------------


def test_put_goes_over_sftp(ssh_host: Host, tmp_path: Path) -> None:
    t, _ = ssh_transport(ssh_host)
    try:
        t.put(b"payload", str(tmp_path / "f"))
        assert t._conn._sftp is not None  # Fabric opened an SFTP session on the connection
        assert (tmp_path / "f").read_bytes() == b"payload"
    finally:
        t.close()


def test_one_connection_is_reused(ssh_host: Host, tmp_path: Path) -> None:
    t, _ = ssh_transport(ssh_host)
    try:
        port = client_port(t)
        conn = t._conn
        t.put(b"x", str(tmp_path / "x"))
        t.run("exit 1", check=False)
        assert client_port(t) == port
        assert t._conn is conn
    finally:
        t.close()
    assert t._conn is None


def test_commands_share_the_connection_without_waiting_for_each_other(ssh_host: Host, tmp_path: Path) -> None:
    """A poll held open on the host (as a watcher's is) must not block another call on that host:
    the first command waits for a file only the second one creates."""
    t, _ = ssh_transport(ssh_host)
    flag = tmp_path / "flag"
    try:
        t.run("true")
        conn = t._conn
        with ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(t.run, f"for _ in $(seq 100); do [ -e {quote(str(flag))} ] && exit 0; "
                                         "sleep 0.1; done; exit 1", check=False)
            time.sleep(0.3)
            pool.submit(t.run, f"touch {quote(str(flag))}").result(timeout=20)
            assert waiting.result(timeout=30).exit_code == 0
        assert t._conn is conn
    finally:
        t.close()


def test_connect_keeps_one_transport_per_host(ssh_host: Host) -> None:
    try:
        t = connect(ssh_host)
        assert isinstance(t, SSHTransport)
        assert connect(ssh_host) is t
        port = client_port(t)
        assert client_port(connect(ssh_host)) == port
        changed = ssh_host.model_copy(update={"connect_timeout": 5})
        assert connect(changed) is not t  # a changed inventory entry gets a fresh transport
    finally:
        close_all()


def test_reconnects_after_the_server_restarted(ssh_fleet_restarts: SSHFleet, ssh_host: Host) -> None:
    server = ssh_fleet_restarts.server(1)
    t, _ = ssh_transport(ssh_host)
    try:
        before_port, before_conn = client_port(t), t._conn
        server.restart()
        assert t.run("echo back").stdout == "back\n"
        assert t._conn is not before_conn
        assert client_port(t) != before_port
    finally:
        t.close()


def test_server_down_then_up_again(ssh_fleet_restarts: SSHFleet, ssh_host: Host) -> None:
    """sshd stopped mid-watch: the poll fails as Unreachable after the retries, then works once it is back."""
    server = ssh_fleet_restarts.server(1)
    t, sleeps = ssh_transport(ssh_host)
    try:
        t.run("true")
        server.stop()
        with pytest.raises(Unreachable) as info:
            t.run("true")
        assert not isinstance(info.value, HostKeyError)
        assert info.value.host == "test1"
        assert f"connection refused at {ssh_host.address}:{ssh_host.port}" in str(info.value)
        assert len(sleeps) == 3  # four attempts
        assert sleeps == sorted(sleeps) and sleeps[0] > 0  # backing off

        server.start()
        assert t.run("echo up").stdout == "up\n"
    finally:
        t.close()


def test_unreachable_host_uses_the_named_retry_policy(ssh_fleet_restarts: SSHFleet) -> None:
    server = ssh_fleet_restarts.server(2)
    server.stop()
    t, sleeps = ssh_transport(Host(name="test2", **ssh_fleet_restarts.host_entry(2)))
    with pytest.raises(Unreachable, match="test2: unreachable"):
        t.run("true")
    expected = Sleeps()
    policy = ssh_retry(sleep=expected)
    with pytest.raises(Unreachable):
        for attempt in policy:
            with attempt:
                raise Unreachable("x", "refused")
    assert sleeps == expected and len(sleeps) == 3


def test_connection_lost_during_a_command(ssh_fleet_restarts: SSHFleet, ssh_host: Host) -> None:
    """Not mistaken for the command's own exit code, and not re-run: it may have had effects."""
    server = ssh_fleet_restarts.server(1)
    t, sleeps = ssh_transport(ssh_host)
    try:
        t.run("true")
        stopper = threading.Timer(0.3, server.stop)
        stopper.start()
        with pytest.raises(Unreachable, match="connection lost") as info:
            t.run("sleep 5; echo done", check=False)
        stopper.join()
        assert not isinstance(info.value, HostKeyError)
        assert sleeps == []
        server.start()
        assert t.run("echo again").stdout == "again\n"
    finally:
        t.close()


def test_a_command_killed_by_a_signal_is_not_a_lost_connection(ssh_host: Host) -> None:
    t, sleeps = ssh_transport(ssh_host)
    try:
        r = t.run("kill -9 $$", check=False)
        assert not r.ok and r.exit_code != 0
        assert t.run("echo alive").stdout == "alive\n"
        assert sleeps == []
    finally:
        t.close()


def test_wrong_client_key_is_refused_without_retries(
    ssh_fleet: SSHFleet, isolated_home: Path, tmp_path: Path
) -> None:
    stranger = keygen(tmp_path / "stranger_ed25519")
    t, sleeps = ssh_transport(Host(name="test1", **ssh_fleet.host_entry(1, identity_file=str(stranger))))
    with pytest.raises(AuthFailed, match="authentication failed"):
        t.run("true")
    assert sleeps == []


# -- host keys ------------------------------------------------------------------------------------------


def test_fleet_known_hosts_uses_bracketed_host_and_port(ssh_fleet: SSHFleet) -> None:
    lines = ssh_fleet.known_hosts.read_text().splitlines()
    assert lines == [s.host_key_line for s in ssh_fleet.servers]
    for server, line in zip(ssh_fleet.servers, lines):
        assert re.fullmatch(rf"\[127\.0\.0\.\d+\]:{server.port} ssh-ed25519 AAAA[A-Za-z0-9+/=]+", line)
    assert len({s.address for s in ssh_fleet.servers}) == len(ssh_fleet.servers)


def test_strict_checking_accepts_the_listed_key(ssh_fleet: SSHFleet, isolated_home: Path) -> None:
    for i in (1, 2):
        t, _ = ssh_transport(Host(name=f"test{i}", **ssh_fleet.host_entry(i)))
        try:
            assert t.run("echo hi").stdout == "hi\n"
        finally:
            t.close()
    assert not (isolated_home / ".ssh").exists()


@pytest.mark.parametrize("listing", ["missing file", "empty file", "other host", "address without port"])
def test_unknown_host_key_is_refused(
    ssh_fleet: SSHFleet, isolated_home: Path, tmp_path: Path, listing: str
) -> None:
    server = ssh_fleet.server(1)
    known = tmp_path / "known_hosts"
    if listing == "empty file":
        known.write_text("")
    elif listing == "other host":
        known.write_text(ssh_fleet.server(2).host_key_line + "\n")
    elif listing == "address without port":  # OpenSSH and paramiko look up [host]:port for port != 22
        known.write_text(f"{server.address} {server.host_public_key}\n")
    before = known.read_text() if known.exists() else None
    t, sleeps = ssh_transport(Host(name="test1", **ssh_fleet.host_entry(1, known_hosts=str(known))))
    with pytest.raises(HostKeyError, match="unknown host key") as info:
        t.run("true")
    assert fingerprint(server.host_public_key) in str(info.value)
    assert f"ssh-keyscan -p {server.port} {server.address} >> ~/.ssh/known_hosts" in str(info.value)
    assert sleeps == []  # never retried
    assert (known.read_text() if known.exists() else None) == before
    assert not (isolated_home / ".ssh").exists()


def test_accept_new_host_key_remembers_it(ssh_fleet: SSHFleet, isolated_home: Path, tmp_path: Path) -> None:
    server = ssh_fleet.server(1)
    known = tmp_path / "sub" / "known_hosts"
    t, _ = ssh_transport(
        Host(name="test1", **ssh_fleet.host_entry(1, known_hosts=str(known), accept_new_host_key=True))
    )
    try:
        assert t.run("echo hi").stdout == "hi\n"
    finally:
        t.close()
    assert known.read_text() == server.host_key_line + "\n"

    # and what was written is what strict checking then finds
    strict, _ = ssh_transport(Host(name="test1", **ssh_fleet.host_entry(1, known_hosts=str(known))))
    try:
        assert strict.run("echo again").stdout == "again\n"
    finally:
        strict.close()
    assert known.read_text() == server.host_key_line + "\n"  # not added twice
    assert not (isolated_home / ".ssh").exists()


def test_accept_new_appends_after_a_last_line_without_newline(
    ssh_fleet: SSHFleet, isolated_home: Path, tmp_path: Path
) -> None:
    known = tmp_path / "known_hosts"
    other = ssh_fleet.server(2).host_key_line
    known.write_text(other)  # no trailing newline
    t, _ = ssh_transport(
        Host(name="test1", **ssh_fleet.host_entry(1, known_hosts=str(known), accept_new_host_key=True))
    )
    try:
        t.run("true")
    finally:
        t.close()
    assert known.read_text().splitlines() == [other, ssh_fleet.server(1).host_key_line]


def test_accept_new_without_known_hosts_uses_the_users_file(ssh_fleet: SSHFleet, isolated_home: Path) -> None:
    t, _ = ssh_transport(
        Host(name="test1", **ssh_fleet.host_entry(1, known_hosts=None, accept_new_host_key=True))
    )
    try:
        t.run("true")
    finally:
        t.close()
    user_file = isolated_home / ".ssh" / "known_hosts"
    assert user_file.read_text() == ssh_fleet.server(1).host_key_line + "\n"


@pytest.mark.parametrize("accept_new", [False, True])
def test_changed_host_key_is_refused(
    ssh_fleet: SSHFleet, isolated_home: Path, tmp_path: Path, accept_new: bool
) -> None:
    server = ssh_fleet.server(1)
    impostor = keygen(tmp_path / "impostor_ed25519")
    known = tmp_path / "known_hosts"
    known.write_text(f"{server.known_hosts_name} {public_key(impostor)}\n")
    before = known.read_text()
    t, sleeps = ssh_transport(
        Host(name="test1", **ssh_fleet.host_entry(1, known_hosts=str(known), accept_new_host_key=accept_new))
    )
    with pytest.raises(HostKeyError, match="host key changed") as info:
        t.run("true")
    # both fingerprints as ssh-keygen prints them, and the command that forgets the old key
    assert fingerprint(server.host_public_key) in str(info.value)
    assert fingerprint(public_key(impostor)) in str(info.value)
    assert f"ssh-keygen -R '{server.known_hosts_name}' -f {known}" in str(info.value)
    assert sleeps == []
    assert known.read_text() == before
    assert not (isolated_home / ".ssh").exists()


def test_users_known_hosts_is_consulted_too(ssh_fleet: SSHFleet, isolated_home: Path, tmp_path: Path) -> None:
    (isolated_home / ".ssh").mkdir()
    (isolated_home / ".ssh" / "known_hosts").write_text(ssh_fleet.server(1).host_key_line + "\n")
    t, _ = ssh_transport(Host(name="test1", **ssh_fleet.host_entry(1, known_hosts=str(tmp_path / "none"))))
    try:
        assert t.run("echo ok").stdout == "ok\n"
    finally:
        t.close()


# -- the fixtures themselves ----------------------------------------------------------------------------


def test_stopped_server_refuses_and_restart_keeps_port_and_key(ssh_fleet_restarts: SSHFleet) -> None:
    server = ssh_fleet_restarts.server(2)
    port, line = server.port, server.host_key_line
    server.stop()
    assert not server.running and not server.pid_file.exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((server.address, server.port), timeout=2).close()
    server.start()
    assert server.running and (server.port, server.host_key_line) == (port, line)
    with socket.create_connection((server.address, server.port), timeout=2) as s:
        assert s.recv(64).startswith(b"SSH-2.0-OpenSSH")


def test_hosts_toml_loads_into_the_inventory(ssh_fleet: SSHFleet, tmp_path: Path) -> None:
    text = ssh_fleet.hosts_toml(test2={"gpus": 8, "tags": ["a b", 'q"uote'], "env": {"X": "1\n$y"}})
    assert tomllib.loads(text)["hosts"]["test2"]["env"] == {"X": "1\n$y"}
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    inventory = Inventory.load(path, tmp_path)
    assert inventory.get("test1") == Host(name="test1", **ssh_fleet.host_entry(1))
    assert inventory.get("test2") == Host(
        name="test2", **ssh_fleet.host_entry(2, gpus=8, tags=["a b", 'q"uote'], env={"X": "1\n$y"})
    )
    assert ssh_fleet.host_entry(1)["workdir"] != ssh_fleet.host_entry(2)["workdir"]
    with pytest.raises(KeyError):
        ssh_fleet.hosts_toml(test9={})


def test_a_fleet_leaves_no_sshd_behind(tmp_path: Path) -> None:
    with SSHFleet(1, root=tmp_path / "fleet", first_address=9) as fleet:
        server = fleet.server(1)
        pid = int(server.pid_file.read_text())
        t, sleeps = ssh_transport(Host(name="test1", **fleet.host_entry(1)))
        t.run("true")  # leave a session open
        sessions = descendants(pid)
        assert sessions and alive(pid)
    assert not alive(pid) and not any(alive(p) for p in sessions)
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        assert str(server.config).encode() not in cmdline
    with pytest.raises(Unreachable):
        t.run("true")
    assert len(sleeps) == 3


def test_marker_lines_in_known_hosts_are_understood(ssh_fleet: SSHFleet, ssh_host: Host, private_home: Path,
                                                     tmp_path: Path) -> None:
    """`@cert-authority` and `@revoked` lines (OpenSSH markers paramiko cannot read) break no command;
    a key marked @revoked is refused."""
    other = public_key(keygen(tmp_path / "ca"))
    user_known = private_home / ".ssh" / "known_hosts"
    user_known.parent.mkdir(exist_ok=True)
    user_known.write_text(f"@cert-authority *.example.internal {other}\n@revoked * {other}\nnot a line\n")
    transport = SSHTransport(ssh_host)
    assert transport.run("echo ok").stdout == "ok\n"
    transport.close()
    server_key = ssh_fleet.server(1).host_public_key
    user_known.write_text(f"@revoked {ssh_fleet.server(1).known_hosts_name} {server_key}\n")
    with pytest.raises(HostKeyError, match="marked @revoked in known_hosts"):
        SSHTransport(ssh_host).run("true")


# -- the host's agent over real sshd: the ops that replaced shell --------------------------------------


def test_the_agent_drives_a_job_over_ssh_without_shell(ssh_host: Host, tmp_path: Path) -> None:
    """Launch, a held read woken by a line, tail, the GPU look of a CPU host, kill, and the account of a
    job gone without an exit code: each one request on the agent's one channel."""
    from orchestrator.host import agent, gpu
    from orchestrator.host.executor import HostExecutor
    from orchestrator.host.launch import RunPaths

    transport, _ = ssh_transport(ssh_host)
    try:
        executor = HostExecutor(transport)
        paths = RunPaths(str(tmp_path / "run"))
        go = tmp_path / "go"
        script = f"echo first\nwhile [ ! -e {go} ]; do sleep 0.05; done\necho 'Uvicorn running on x'\nsleep 300\n"
        handle = executor.launch(paths, script, "tok")
        assert executor.launch(paths, script, "tok") == handle  # the same token: the same job
        assert executor.find(paths) == handle
        go.touch()
        state = executor.poll(paths, handle, 0, 1 << 20, hold_s=600, wake=["Uvicorn running"])
        while b"Uvicorn" not in state.data:  # woke by the line (or by "first", read before it came)
            state = executor.poll(paths, handle, state.offset + len(state.data), 1 << 20, hold_s=600,
                                  wake=["Uvicorn running"])
        assert state.alive and executor.tail(paths, 1) == "Uvicorn running on x\n"
        assert gpu.snapshot(transport) is None  # no nvidia-smi on this host's PATH
        assert executor.kill(handle, 5) == "stopped"
        assert not executor.poll(paths, handle, 0, 1 << 20).alive
        assert executor.explain_loss(paths, handle) is not None
        assert agent.shared(transport).alive  # one link for all of it
    finally:
        transport.close()
