"""Which host keys orch trusts over SSH: known_hosts read as OpenSSH reads it (@revoked keys refused, marker
lines paramiko cannot read skipped), an unknown key refused with how to trust it, or accepted and saved as
`StrictHostKeyChecking=accept-new` does."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any


class SaveNewKeyPolicy:
    """Accept an unknown (never a changed) host key and remember it, as `StrictHostKeyChecking=accept-new`."""

    def __init__(self, known_hosts: str):
        self.known_hosts = known_hosts

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        path = Path(self.known_hosts)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a+b") as f:
            # a last line without its newline would otherwise swallow the new entry
            f.seek(0, os.SEEK_END)
            sep = b""
            if f.tell():
                f.seek(-1, os.SEEK_END)
                sep = b"" if f.read(1) == b"\n" else b"\n"
            f.write(sep + f"{hostname} {key.get_name()} {key.get_base64()}\n".encode())


def fingerprint(key: Any) -> str:
    """`SHA256:...`, as ssh and ssh-keygen -l print it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class UnknownKey(Exception):
    pass


class RefuseUnknownKey:
    """Refuse a host key that is not in known_hosts, saying which key it was and how to trust it."""

    def __init__(self, known_name: str, port: int | None):
        self.known_name, self.port = known_name, port

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        address = self.known_name.strip("[").split("]")[0]
        scan = f"ssh-keyscan {'-p ' + str(self.port) + ' ' if self.port not in (None, 22) else ''}{address}"
        raise UnknownKey(
            f"unknown host key for {self.known_name}: it offers {key.get_name()} {fingerprint(key)}. "
            f"If that is the host's key (ask its admin, or compare `ssh-keygen -lf` on the host), add it: "
            f"{scan} >> ~/.ssh/known_hosts — or set accept_new_host_key = true for this host")


class RefuseRevoked:
    """A key marked `@revoked` in known_hosts is refused, known or not; others go to the next policy."""

    def __init__(self, revoked: set[str], known_name: str, then: Any):
        self.revoked, self.known_name, self.then = revoked, known_name, then

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        if key.get_base64() in self.revoked:
            raise UnknownKey(f"the host key of {self.known_name} ({key.get_name()} {fingerprint(key)}) is marked "
                              "@revoked in known_hosts; refusing to connect")
        if self.then is not None:
            self.then.missing_host_key(client, hostname, key)


def load_known_hosts(keys: Any, path: str) -> set[str]:
    """Add the host keys of an OpenSSH known_hosts file to paramiko's `keys`; the keys marked @revoked.

    paramiko's own reader stops with a traceback at a marker line, so the file is read here: @revoked keys
    are refused whoever offers them; @cert-authority lines are skipped (paramiko cannot check host
    certificates: such a host needs its own key listed); a line no parser takes is skipped, as ssh does.
    """
    from paramiko.hostkeys import HostKeyEntry

    revoked: set[str] = set()
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return revoked
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("@"):
            fields = line.split()
            if fields[0] == "@revoked" and len(fields) >= 4:
                revoked.add(fields[3])
            continue
        try:
            entry = HostKeyEntry.from_line(line, number)
        except Exception:  # noqa: BLE001, S112 - a malformed line, whatever paramiko raises for it
            continue
        if entry is not None and entry.key is not None:
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)
    return revoked
