"""Leases on the host itself, so that two workspaces sharing a host's workdir never hold the same GPUs.

The SQLite lease (lease.py) keeps the runs of one workspace apart; another workspace's database cannot
see it. So before GPU cleanup a run also takes, under an flock in `<workdir>/leases/`, one file per key —
`host` for the whole host, `gpu-N` per GPU of its set — naming its run token (workspace and run), its run
dir and when it was taken. Another workspace's file stands while its run can still be alive: its run dir
is there without an exit code, and its wrapper lives (or, before a pid was written, it is under an hour
old). The same call refuses a run dir that another workspace's run already uses, before anything is
touched. The files are removed when the run ends; a file left by a host that was unreachable then is
stale as soon as its run is over.
"""

from __future__ import annotations

import posixpath

from .errors import OrchError
from .launch import CONTROL, LIVE_START, RunPaths
from .remote import Transport, quote

DIR = "leases"
STARTING_S = 3600  # a lease whose run has no pid yet is believed this long


class HostLeaseBusy(OrchError):
    """Another workspace's run holds the host or some of the GPUs here."""


def keys(gpus: list[int] | None) -> list[str]:
    return ["host"] if gpus is None else [f"gpu-{i}" for i in sorted(gpus)]


def workspace_of(token: str) -> str:
    """The workspace part of a run token (`hostname:db path:run id:created`)."""
    return token.rsplit(":", 2)[0]


def take_command(workdir: str, paths: RunPaths, token: str, gpus: list[int] | None) -> str:
    w = quote(posixpath.join(workdir, DIR))
    mine = quote(workspace_of(token))
    line = quote(f"{token}\t{paths.root}\t")
    # for the whole host every file conflicts; for a GPU set, `host` and its own GPUs
    wanted = keys(gpus)
    conflicts = '"$W"/*' if gpus is None else " ".join(f'"$W"/{k}' for k in ["host", *wanted])
    return (
        f"W={w}; mkdir -p \"$W\" && exec 9>\"$W/.lock\" && flock -w 30 9 || {{ echo 'lease lock busy'; exit 90; }}\n"
        f"d={quote(paths.root)}\n"
        f"t=$(cat \"$d/{CONTROL}/token\" 2>/dev/null || cat \"$d/token\" 2>/dev/null)\n"
        f'if [ -n "$t" ] && [ "${{t%:*:*}}" != {mine} ]; then echo "run dir in use by another workspace\'s run: $d"; '
        "exit 91; fi\n"
        "live() {  # $1: a lease file; 0 while its run may still be alive\n"
        '  IFS="$(printf "\\t")" read -r tok dir at < "$1" || return 1\n'
        '  [ "${tok%:*:*}" = ' + mine + " ] && return 1  # this workspace's own: its SQLite lease rules\n"
        '  c="$dir/' + CONTROL + '"; [ -d "$c" ] || c="$dir"\n'
        '  [ -d "$dir" ] && [ ! -s "$c/exit_code" ] || return 1\n'
        '  if [ -s "$c/pid" ]; then read -r p s < "$c/pid"; '
        f'[ "$({LIVE_START.format(pid="$p")})" = "$s" ]; return; fi\n'
        f'  [ $(( $(date +%s) - ${{at%.*}} )) -lt {STARTING_S} ]\n'
        "}\n"
        f"for f in {conflicts}; do\n"
        '  [ -f "$f" ] || continue; [ "$(basename "$f")" = .lock ] && continue\n'
        '  if live "$f"; then echo "held: $(basename "$f") $(cut -f1,2 "$f")"; exit 92; fi\n'
        "done\n"
        + "".join(f'printf "%s%s\\n" {line} "$(date +%s)" > "$W/{k}"\n' for k in wanted)
    )


def take(transport: Transport, workdir: str, paths: RunPaths, token: str, gpus: list[int] | None) -> None:
    """Take the host's lease files for the run, or refuse (HostLeaseBusy) naming who holds them."""
    res = transport.run(take_command(workdir, paths, token, gpus), check=False, timeout=60)
    if res.exit_code == 0:
        return
    said = (res.stdout.strip().splitlines() or [res.stderr.strip()[-300:] or f"exit {res.exit_code}"])[-1]
    what = "the host" if gpus is None else f"GPUs {','.join(map(str, gpus))}"
    if said.startswith("held: "):
        key, _, holder = said.removeprefix("held: ").partition(" ")
        token, _, run_dir = holder.partition("\t")
        raise HostLeaseBusy(f"{transport.host.name}: {what} held by another workspace's run ({key}: run dir "
                            f"{run_dir}, {token}); choose other GPUs or a workdir of this workspace's own")
    raise HostLeaseBusy(f"{transport.host.name}: cannot take {what}: {said}")


def release(transport: Transport, workdir: str, token: str) -> None:
    """Remove this run's lease files (those naming its token)."""
    w = quote(posixpath.join(workdir, DIR))
    transport.run(f"W={w}; [ -d \"$W\" ] || exit 0; exec 9>\"$W/.lock\" && flock -w 30 9 || exit 0\n"
                  f"for f in \"$W\"/*; do [ -f \"$f\" ] && [ \"$(cut -f1 \"$f\")\" = {quote(token)} ] && rm -f \"$f\"; "
                  "done; exit 0", check=False, timeout=60)
