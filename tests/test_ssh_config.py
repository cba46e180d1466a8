"""A host name that is an alias in ~/.ssh/config works, ProxyJump included, with host keys checked."""

from __future__ import annotations

from pathlib import Path

from orchtest import FAST, Orch


def write_ssh_config(home, fleet) -> None:
    one, two = fleet.server(1), fleet.server(2)
    ssh = home / ".ssh"
    ssh.mkdir(parents=True, exist_ok=True)
    (ssh / "config").write_text(
        f"Host jump\n  HostName {one.address}\n  Port {one.port}\n  User {fleet.user}\n"
        f"  IdentityFile {fleet.client_key}\n"
        f"Host behind\n  HostName {two.address}\n  Port {two.port}\n  User {fleet.user}\n"
        f"  IdentityFile {fleet.client_key}\n  ProxyJump jump\n"
    )
    (ssh / "known_hosts").write_text(fleet.known_hosts.read_text())


def test_alias_and_proxyjump(tmp_path, ssh_fleet):
    home = tmp_path / "home"
    write_ssh_config(home, ssh_fleet)
    hosts = (f'[hosts.jump]\nworkdir = "{tmp_path / "w1"}"\npython = "{ssh_fleet.host_entry(1)["python"]}"\n'
             f'[hosts.behind]\nworkdir = "{tmp_path / "w2"}"\npython = "{ssh_fleet.host_entry(2)["python"]}"\n')
    orch = Orch(tmp_path / "ws", hosts)
    orch.env["HOME"] = str(home)
    orch.env.pop("SSH_AUTH_SOCK", None)
    res = orch("run", "command", "--host", "behind", "--set", "cmd=echo via $SSH_CONNECTION", *FAST)
    assert res.returncode == 0, res.stderr
    server_two = ssh_fleet.server(2)
    log = orch("logs", "1", check=0).stdout
    assert f"{server_two.address} {server_two.port}" in log  # it ran on the second server
    assert (Path(orch.status(1)["remote_dir"]) / "log").exists()
    assert orch.status(1)["remote_dir"].startswith(str(tmp_path / "w2" / "runs") + "/")


def test_proxyjump_checks_the_jump_hosts_key(tmp_path, ssh_fleet):
    home = tmp_path / "home"
    write_ssh_config(home, ssh_fleet)
    only_behind = [line for line in ssh_fleet.known_hosts.read_text().splitlines()
                   if str(ssh_fleet.server(2).port) in line]
    (home / ".ssh" / "known_hosts").write_text("\n".join(only_behind) + "\n")
    orch = Orch(tmp_path / "ws", f'[hosts.behind]\nworkdir = "{tmp_path / "w2"}"\n')
    orch.env["HOME"] = str(home)
    res = orch("run", "command", "--host", "behind", "--set", "cmd=true", *FAST)
    assert res.returncode == 2 and "host key" in res.stderr
    assert not (tmp_path / "w2").exists()
