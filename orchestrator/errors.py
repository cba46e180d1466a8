"""One error hierarchy; every message is meant for the user, shown without a traceback."""


class OrchError(Exception):
    """An error the user can act on. Exit code 1 unless a subclass says otherwise."""

    exit_code = 1


class UsageError(OrchError):
    """Bad input: a malformed spec, an unknown host or run, a hostile value. Nothing was touched."""

    exit_code = 2


class SpecError(UsageError):
    pass


class HostError(UsageError):
    pass


class NotFound(UsageError):
    pass


class TransitionError(OrchError):
    """A run was asked to move to a status its lifecycle does not allow."""


class RemoteError(OrchError):
    """A remote command failed; carries the command, its exit code and the last lines of output."""

    def __init__(self, host: str, command: str, exit_code: int | None, output: str, reason: str = ""):
        self.host = host
        self.command = command
        self.remote_exit_code = exit_code  # the command's; `exit_code` stays orch's own (1)
        self.output = output
        tail = "\n".join(output.strip().splitlines()[-10:])
        what = reason or f"exit code {exit_code}"
        super().__init__(f"{host}: command failed ({what}): {command[:200]}" + (f"\n{tail}" if tail else ""))


class Unreachable(OrchError):
    """The host could not be reached (connection refused, timeout, authentication, host key)."""

    def __init__(self, host: str, reason: str):
        self.host = host
        self.reason = reason
        super().__init__(f"{host}: unreachable: {reason}")


class HostKeyError(Unreachable):
    """The host's key is unknown or changed; never accepted silently."""

    exit_code = 2


class AuthFailed(HostKeyError):
    """The host refused our user or key. Like a host-key refusal it does not heal on retry (hence the base)."""


class DatabaseUnavailable(OrchError):
    """The workspace's database is locked past the busy timeout, read-only, or cannot be opened."""
