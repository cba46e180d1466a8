"""Writing files on a host and connecting to a busy sshd, against real OpenSSH servers on loopback.

A file is put through a temporary name nobody can guess, created only if absent: a symlink planted where
the temporary file used to go (`<target>.tmp`) or at the target itself redirects nothing. An sshd that
drops a connection past its MaxStartups is said in one line and retried, with no traceback on stderr.
"""

from __future__ import annotations

import getpass
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sshd import SSHServer, keygen, public_key

from orchestrator.config.hosts import local_host
from orchestrator.host.remote import LocalTransport, SSHTransport, Transport


@pytest.fixture(params=["ssh", "local"])
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Transport]:
    t: Transport = (SSHTransport(request.getfixturevalue("ssh_host")) if request.param == "ssh"
                    else LocalTransport(local_host(tmp_path)))
    try:
        yield t
    finally:
        t.close()


def test_a_symlink_at_the_old_temporary_name_redirects_nothing(transport: Transport, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "dir" / "program.py"
    target.parent.mkdir()
    (target.parent / "program.py.tmp").symlink_to(victim)  # where a put used to write first
    transport.put(b"new content", str(target), mode=0o600)
    assert victim.read_bytes() == b"precious"
    assert target.read_bytes() == b"new content" and not target.is_symlink()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    # nothing left behind but the planted link (it is someone else's to remove)
    assert sorted(p.name for p in target.parent.iterdir()) == ["program.py", "program.py.tmp"]


def test_a_symlink_at_the_target_is_replaced_not_written_through(transport: Transport, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "request.json"
    target.symlink_to(victim)
    transport.put(b"{}", str(target))
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and target.read_bytes() == b"{}"


def test_open_file_reads_only_a_plain_file_never_through_a_symlink(transport: Transport, tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"precious")
    (tmp_path / "link").symlink_to(tmp_path / "secret")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for name in ("link", "folder", "fifo", "missing"):
        with pytest.raises(FileNotFoundError):
            transport.open_file(str(tmp_path / name))
    # what was there when it was opened: bytes appended later are not read
    data = bytes(range(256)) * 40000 + b"no newline at the end"  # ~10 MiB: more than one read-ahead
    (tmp_path / "log").write_bytes(data)
    with transport.open_file(str(tmp_path / "log")) as f:
        with (tmp_path / "log").open("ab") as grow:
            grow.write(b"later")
        got = b"".join(iter(lambda: f.read(1 << 20), b""))
    assert f.size == len(data) and got == data
    with transport.open_file(str(tmp_path / "log")) as f:  # the session is free again
        assert f.read(3) == bytes([0, 1, 2])


def test_a_large_put_is_metered(transport: Transport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    from orchestrator.host import session
    from orchestrator.host import transport as transport_module

    told: list[tuple[str, int, list[int]]] = []

    @contextlib.contextmanager
    def meter(what: str, total: int) -> Iterator[Any]:
        told.append((what, total, []))
        yield told[-1][2].append

    monkeypatch.setattr(session.current(), "transfer_meter", meter)
    transport.put(b"small", str(tmp_path / "small"))
    data = os.urandom(transport_module.LARGE_UPLOAD + 12345)
    transport.put(data, str(tmp_path / "big"))
    assert (tmp_path / "big").read_bytes() == data
    assert [(what, total, sum(pieces)) for what, total, pieces in told] == [("upload big", len(data), len(data))]


# -- a busy sshd --------------------------------------------------------------------------------------------

DRIVER = textwrap.dedent("""
    import socket, sys
    from orchestrator.host import session
    from orchestrator.config.hosts import Host
    from orchestrator.host.remote import connect

    address, port, user, key, known, relay_port = sys.argv[1:7]
    # to the test, which lets go of sshd's only startup slot when orch says it retries
    relay = socket.create_connection(("127.0.0.1", int(relay_port)))

    def notice(line):
        print("retry: " + line, file=sys.stderr, flush=True)
        if relay.fileno() != -1:  # the first retry: sshd may take a moment to free the slot
            relay.sendall(b"release")
            relay.close()

    session.current().retry_notice = notice
    host = Host(name="busy", address=address, port=int(port), user=user, identity_file=key, known_hosts=known,
                workdir="/tmp")
    print(connect(host).run("echo reached").stdout, end="")
""")


def test_a_connection_dropped_past_maxstartups_is_one_line_and_retried(tmp_path: Path) -> None:
    key = keygen(tmp_path / "id_ed25519")
    (tmp_path / "authorized_keys").write_text(public_key(key) + "\n")
    server = SSHServer(tmp_path / "sshd", "127.0.0.7", tmp_path / "authorized_keys")
    server.config.write_text(server.config.read_text().replace("MaxStartups 100", "MaxStartups 1"))
    server.start()
    known = tmp_path / "known_hosts"
    known.write_text(server.host_key_line + "\n")
    # A helper here holds an unauthenticated connection to sshd (its one startup) until the driver, told
    # of the retry, asks it to let go.
    relay = socket.create_server(("127.0.0.1", 0))
    try:
        hog = _take_the_only_startup(server)
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, server.address, str(server.port), getpass.getuser(), str(key), str(known),
             str(relay.getsockname()[1])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
        relay.settimeout(60)
        told, _ = relay.accept()
        with told:
            told.settimeout(60)
            assert told.recv(16) == b"release"
        hog.close()
        out, err = driver.communicate(timeout=60)
    finally:
        relay.close()
        server.stop()
    assert driver.returncode == 0, err
    assert out == "reached\n"
    lines = err.splitlines()
    assert lines and all(line.startswith("retry: ") for line in lines), err  # no traceback, no paramiko log
    assert "closed the connection before SSH began" in lines[0] and "MaxStartups" in lines[0], lines[0]


def _take_the_only_startup(server: SSHServer) -> socket.socket:
    """A connection sshd has taken as a startup: it got the SSH banner (the readiness probe's own
    connection may still hold the slot for a moment, and then sshd says so instead)."""
    for _ in range(200):
        conn = socket.create_connection((server.address, server.port), timeout=10)
        if conn.recv(64).startswith(b"SSH-2.0-"):
            return conn
        conn.close()
        time.sleep(0.05)  # sshd is still ending the readiness probe's connection
    raise AssertionError("sshd never took a connection")
