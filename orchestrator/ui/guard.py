"""What keeps the dashboard safe by default: read-only unless actions are allowed; a token for every API
call, on loopback too (any local user can reach a loopback port); beyond loopback only with a token given;
actions only from the dashboard's own pages."""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

TOKEN_HEADER = "x-orch-token"
TOKEN_ENV = "ORCH_UI_TOKEN"


def is_loopback(bind: str) -> bool:
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def given_token(file: Path | None) -> str | None:
    """The token the user chose: from `file` (which no one else may read: a token others can read guards
    nothing), else $ORCH_UI_TOKEN; never from the command line, which every local user sees in `ps`."""
    if file is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError(f"--token-file {file}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"--token-file {file}: not a plain file")
        if st.st_mode & 0o077 or st.st_uid != os.geteuid():
            raise UsageError(f"--token-file {file}: others may read it (mode {st.st_mode & 0o777:o}, owner uid "
                             f"{st.st_uid}): it must be yours alone, chmod 600")
        data = f.read(4096)
    try:
        token = data.decode().strip()
    except UnicodeDecodeError:
        raise UsageError(f"--token-file {file}: not UTF-8 text") from None
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise UsageError(f"--token-file {file}: expected the token alone (one word)")
    return token


@dataclass(frozen=True)
class Guard:
    token: str
    allow_actions: bool
    hosts: frozenset[str] | None  # the Host headers answered (loopback: no DNS rebinding); None: any

    @classmethod
    def make(cls, bind: str, port: int, allow_actions: bool = False, token: str | None = None) -> Guard:
        loopback = is_loopback(bind)
        if not loopback and not token:
            raise UsageError(f"--bind {bind} lets other machines in: give a token they must show (ORCH_UI_TOKEN or "
                             "--token-file FILE)")
        if token is not None and len(token) < 16:
            raise UsageError("the token must be at least 16 characters")
        names = {"localhost", "127.0.0.1", "[::1]", bind if ":" not in bind else f"[{bind.strip('[]')}]"}
        hosts = frozenset(f"{n}:{port}" for n in names) if loopback else None
        # Every API call shows the token, read or action: another user of this machine can reach a loopback
        # port, and the pages show specs, logs and hosts. Without one given, a new one each start.
        return cls(token or secrets.token_urlsafe(24), allow_actions, hosts)

    def host_ok(self, headers: Mapping[str, str]) -> bool:
        return self.hosts is None or headers.get("host", "") in self.hosts

    def token_ok(self, headers: Mapping[str, str]) -> bool:
        return secrets.compare_digest(headers.get(TOKEN_HEADER, "").encode(), self.token.encode())

    def same_origin(self, headers: Mapping[str, str], scheme: str) -> bool:
        """A browser says where a request comes from: only the dashboard's own pages may act."""
        origin = headers.get("origin")
        site = headers.get("sec-fetch-site")
        return origin == f"{scheme}://{headers.get('host', '')}" and site in (None, "same-origin")

    def action_refusal(self, headers: Mapping[str, str], scheme: str) -> str | None:
        """Why an action is refused, or None when it may run."""
        if not self.allow_actions:
            return "actions are off: start the dashboard with --allow-actions"
        if not self.same_origin(headers, scheme):
            return "actions are taken only from the dashboard's own pages (same origin)"
        if not self.token_ok(headers):
            return "actions need the token `orch ui` printed when it started"
        return None
