"""Start a job under `setsid nohup` in its remote run dir, read its state, and stop its process group.

The wrapper records `pid start_time` (start time in clock ticks from /proc, so a reused pid is never
taken for the job), writes the combined stdout+stderr to `log`, and the exit code to `.orch/exit_code`.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
import signal
from dataclasses import dataclass

from .errors import OrchError
from .remote import Transport, env_exports, quote

# Shell templates shared by everything that tells one process from another on a host ({pid} is a
# number or a shell expansion).
# Field 22 of /proc/PID/stat; the command name (field 2) may hold spaces, so cut after its ")".
START_TIME = "sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -d' ' -f20"
# The same, empty for a zombie: where nothing reaps orphans (containers without an init) a dead
# wrapper lingers as a zombie with its pid and start time intact.
LIVE_START = "sed -n 's/.*) [^Z] //p' /proc/{pid}/stat 2>/dev/null | cut -d' ' -f19"
# The live (non-zombie) pids of a process group.
GROUP_PIDS = "ps -eo pid=,pgid=,stat= | awk -v g={pid} '$2 == g && $3 !~ /^Z/ {{print $1}}'"
# The mark the wrapper leaves in the environment of everything the job starts ("pid:start" of the wrapper),
# so members that outlive it can still be told from a later group that took the same id.
JOB_MARK = "ORCH_JOB"

# orch's own files of a run (pid, exit code, start and end, token) are in a folder of the run dir, out of
# the way of a job that writes `./exit_code` or `./pid` in its working dir (the run dir by default).
CONTROL = ".orch"
# The control folder of a poll's `$d`, or the run dir itself for a run launched before there was one.
CONTROL_OF_D = f'c="$d/{CONTROL}"; [ -d "$c" ] || c="$d"\n'

# Runs in the run dir as the session leader, so its pid is also the job's process group id. The log is
# opened for appending, so a log truncated under the job (copytruncate rotation) gets no hole of zeros.
# The job's own start and end times (epoch seconds, the host's clock) are written beside its exit code;
# the end time first, so a run seen ended has both.
WRAPPER = f"""\
date +%s.%N > {CONTROL}/started_at
start=$({START_TIME.format(pid='$$')})
export {JOB_MARK}="$$:$start"
echo "$$ $start" > {CONTROL}/pid.tmp && mv {CONTROL}/pid.tmp {CONTROL}/pid
bash ./job.sh >> log 2>&1 < /dev/null
code=$?
date +%s.%N > {CONTROL}/ended_at
echo $code > {CONTROL}/exit_code.tmp && mv {CONTROL}/exit_code.tmp {CONTROL}/exit_code
"""

POLL_MARK = "orch-poll"


@dataclass(frozen=True)
class RunPaths:
    """Every remote path of a run derives from here."""

    root: str

    def __post_init__(self) -> None:
        # An empty root would quote to '' and turn `cd` into a no-op: refuse it outright.
        if not self.root or not self.root.startswith("/"):
            raise OrchError(f"not an absolute remote run dir: {self.root!r}")

    @classmethod
    def for_run(cls, workdir: str, run_id: int, workspace: str | None = None) -> RunPaths:
        """`<workdir>/runs/<id>`, or `<workdir>/runs/<workspace>/<id>` where workspaces may share the workdir."""
        return cls(posixpath.join(workdir, "runs", *([workspace] if workspace else []), str(run_id)))

    @property
    def log(self) -> str:
        return posixpath.join(self.root, "log")

    @property
    def control(self) -> str:
        return posixpath.join(self.root, CONTROL)

    @property
    def pid(self) -> str:
        return posixpath.join(self.control, "pid")


def job_script(body: str, env: dict[str, str], cwd: str | None = None) -> str:
    """The script the wrapper runs: environment, working directory, then the job's own command lines."""
    head = "export PYTHONUNBUFFERED=1\n" + env_exports(env)
    if cwd:
        head += f"cd {quote(cwd)} || exit 97\n"
    return head + body.rstrip("\n") + "\n"


# Bytes of job script sent inside the launch command itself. One argument of `bash -c` holds at most
# 128 KiB (MAX_ARG_STRLEN), base64 adds a third: a bigger script is uploaded first.
INLINE_SCRIPT_MAX = 32 << 10


def stage_script(transport: Transport, paths: RunPaths, script: str, token: str) -> str | None:
    """Upload a script too big to travel inside one command, beside the run dir (whose owner is not known
    yet); its path, or None for a script sent inline."""
    data = script.encode()
    if len(data) <= INLINE_SCRIPT_MAX:
        return None
    staged = f"{paths.root}.{hashlib.sha256(token.encode()).hexdigest()[:16]}.job.sh"
    transport.put(data, staged)
    return staged


def write_script(script: str, staged: str | None, name: str = "job.sh") -> str:
    """Shell lines that write the job script into the current dir: the staged upload moved in, or inline."""
    if staged is not None:
        return f"mv -f {quote(staged)} {name} || exit 93\n"
    return f"printf %s {base64.b64encode(script.encode()).decode()} | base64 -d > {name}\n"


def launch_command(paths: RunPaths, script: str, token: str, staged: str | None = None) -> str:
    """One remote call: create the run dir, write the scripts, start the wrapper detached, print the pid.

    Idempotent for the same token, so a retry after a dropped connection never starts the job twice;
    a run dir left by another workspace's run of the same id is refused, never reused. The token may be
    there already: the run flow claims the run dir before it patches or frees GPUs.
    """
    root = quote(paths.root)
    wrapper_b64 = base64.b64encode(WRAPPER.encode()).decode()
    drop = f"rm -f {quote(staged)}; " if staged is not None else ""  # an upload that is not needed after all
    return (
        f"mkdir -p {root} && cd {root} || exit 96\n"
        # a token at the top: a run dir of the layout before the control folder, never reused either
        f"if [ -e {CONTROL}/token ] || [ -e token ]; then [ \"$(cat {CONTROL}/token 2>/dev/null)\" = {quote(token)} ] "
        f"|| {{ {drop}echo \"run dir in use by another run: $(pwd)\" >&2; exit 94; }}\n"
        f"  [ -s {CONTROL}/pid ] && {{ {drop}cat {CONTROL}/pid; exit 0; }}\n"
        f"else mkdir -p {CONTROL} && printf '%s' {quote(token)} > {CONTROL}/token; fi\n"
        + write_script(script, staged)
        + f"printf %s {wrapper_b64} | base64 -d > {CONTROL}/wrapper.sh\n"
        f"setsid nohup bash ./{CONTROL}/wrapper.sh > /dev/null 2>&1 < /dev/null &\n"
        f"for _ in $(seq 200); do [ -s {CONTROL}/pid ] && break; sleep 0.05; done\n"
        f"cat {CONTROL}/pid\n"
    )


def launch(transport: Transport, paths: RunPaths, script: str, token: str) -> tuple[int, str]:
    staged = stage_script(transport, paths, script, token)
    out = transport.run(launch_command(paths, script, token, staged), timeout=60).stdout.split()
    if len(out) != 2 or not out[0].isdigit():
        raise OrchError(f"{transport.host.name}: the job did not start (wrapper wrote {out!r})")
    return int(out[0]), out[1]


@dataclass
class JobState:
    alive: bool
    exit_code: int | None
    size: int  # log size in bytes
    offset: int  # where `data` starts (0 again after the log was truncated)
    data: bytes
    run_dir: bool = True  # the run dir still exists on the host
    started_at: float | None = None  # the job's own start and end (the host's clock), when known
    ended_at: float | None = None
    # What a batch scheduler adds: why the job still waits in its queue, the end it decided
    # ("TIMEOUT: ..."), the job's node.
    queued: str | None = None
    cause: str | None = None
    node: str | None = None
    # the wrapper itself lives; False while `alive` means its process group runs on without it
    wrapper: bool = True
    inode: int | None = None  # the identity of the file `data` is from
    rotated: bool = False  # `data` is the rest of a rotated log (`size` is that file's); the new one is next


KEEPALIVE_S = 5  # a held poll writes a byte to stderr this often, so a dark link is noticed by its silence


def poll_command(paths: RunPaths, pid: int, start: str, offset: int, max_bytes: int, hold_s: float = 0,
                 wake: str | None = None, wake_perl: str | None = None, inode: int | None = None,
                 mark: str | None = None) -> str:
    """One remote call that answers: is the job alive, its exit code, and the new bytes of its log.

    With `hold_s`, the call first waits on the host until the job dies, a new log line matches `wake`
    (an extended regex: the lines the watcher waits for) or `wake_perl` (a Perl-style regex: the user's
    ready pattern), or the time is up — checked about once a second, reading only the bytes that came
    since the last check. Liveness is read before the exit code, and both before the log, so a job
    seen dead has its last bytes in this same answer.
    """
    wrapper = f'[ "$({LIVE_START.format(pid=int(pid))})" = {quote(start)} ]'
    # the job lives while its wrapper does, or while members of its group provably its run on without it
    alive = f'{{ {wrapper} || [ -n "$(ours)" ]; }}' if start.isdigit() else wrapper
    hold = ""
    if hold_s > 0:
        step = 1.0 if hold_s >= 5 else max(hold_s / 10, 0.02)
        beats = max(1, round(KEEPALIVE_S / step))
        tests = [f"grep -aqE {quote(wake)}"] if wake else []
        if wake_perl:  # a grep without -P fails here, and simply never wakes on it
            tests.append(f"grep -aqP {quote(wake_perl)} 2>/dev/null")
        check = ""
        if tests:
            # the bytes since the last check, with a margin for a line the last check saw half of
            check = "".join([
                'size=$(stat -c %s "$d/log" 2>/dev/null || echo 0)\n',
                '  [ "$size" -lt "$seen" ] && break\n',  # truncated or replaced: that is news too
                '  if [ "$size" -gt "$seen" ]; then\n',
                f"    from=$(( seen - 4096 > {int(offset)} ? seen - 4096 : {int(offset)} ))\n",
                *(f'    tail -c +$((from + 1)) "$d/log" 2>/dev/null | head -c $((size - from)) | {t} && break\n'
                  for t in tests),
                "    seen=$size\n",
                "  fi\n  ",
            ])
        # a deadline, not a count of steps, so the checks' own time does not stretch the hold
        hold = (f"end=$(( $(date +%s%N) + {int(hold_s * 1e9)} )); seen={int(offset)}; beat=0\n"
                f'while {alive} && [ ! -s "$c/exit_code" ] && [ "$(date +%s%N)" -lt "$end" ]; do\n'
                f"  {check}sleep {step:.3f}\n"
                f"  beat=$((beat + 1)); [ $((beat % {beats})) -eq 0 ] && printf . >&2\n"
                "done\n")
    # A run dir that vanished (a reboot cleaning /tmp, a wiped scratch disk) is reported, not an error:
    # with the process gone too, the run is lost.
    return (
        (ours_function(pid, start) if start.isdigit() else "")
        + f"d={quote(paths.root)}\n"
        + CONTROL_OF_D
        + hold
        + f"if {wrapper}; then wrapper=1; else wrapper=0; fi\n"
        + f"if {alive}; then alive=1; else alive=0; fi\n"
        '[ -d "$d" ] && present=1 || present=0\n'  # after the hold: the dir may have gone during it
        'ec=none; [ -s "$c/exit_code" ] && ec=$(cat "$c/exit_code")\n'
        'size=$(stat -c %s "$d/log" 2>/dev/null || echo 0)\n'
        + _rotation(int(offset), inode, mark)
        + 'began=$(cat "$c/started_at" 2>/dev/null); ended=$(cat "$c/ended_at" 2>/dev/null)\n'
        f'echo "{POLL_MARK} $alive $ec $size $off $present ${{began:-none}} ${{ended:-none}} $wrapper $ino $rot"\n'
        f'tail -c +$((off + 1)) "$src" 2>/dev/null | head -c {int(max_bytes)} | base64 -w0\n'
    )


TAIL_MARK = 64  # bytes before the offset that must still be there, or the log was rewritten under it


def tail_mark(tail: bytes) -> str:
    """What the poll compares the bytes before its offset with."""
    return f"{len(tail)}:{hashlib.md5(tail).hexdigest()}"


def _rotation(offset: int, inode: int | None, mark: str | None = None) -> str:
    """Shell lines choosing the file the poll reads (`src`) and from where (`off`), by the log's identity.

    Renamed away (another inode at `log`): the old file, found by its inode in the run dir, is read on
    while the new log is empty (the wrapper's output still goes to the old one), else to its end and then
    the new log from 0. Truncated in place (copytruncate: same inode, shorter): the rest of the copy,
    `log.1`, then the log from 0. Truncated and written past the offset again is told by `mark`: the
    bytes before the offset are not those read there. `rot=1` says the bytes are the rest of an old
    file, the new one next.
    """
    lines = ['ino=$(stat -c %i "$d/log" 2>/dev/null || echo none); src="$d/log"; rot=0\n', f"off={offset}\n"]
    same = "true"
    if mark is not None and offset > 0:
        n, digest = mark.split(":")
        lines.append(f'same() {{ [ "$(tail -c +$(({offset} - {int(n)} + 1)) "$1" 2>/dev/null | head -c {int(n)} '
                     f'| md5sum | cut -c1-32)" = {quote(digest)} ]; }}\n')
        same = "same"
    if inode is not None:
        old = f'src=$old; off={offset}; size=$osize; ino={int(inode)}'
        lines.append(
            f'if [ "$ino" != {int(inode)} ]; then\n'
            f'  off=0; old=$(find "$d" -maxdepth 1 -type f -inum {int(inode)} 2>/dev/null | head -n 1)\n'
            '  if [ -n "$old" ]; then\n'
            '    osize=$(stat -c %s "$old" 2>/dev/null || echo 0)\n'
            f'    if [ "$size" -eq 0 ]; then {old}\n'
            f'    elif [ "$osize" -gt {offset} ]; then {old}; rot=1\n'
            "    fi\n"
            "  fi\n"
            f'elif [ "$size" -lt "$off" ] || ! {same} "$d/log"; then\n'
            '  if [ -f "$d/log.1" ] && [ "$(stat -c %s "$d/log.1")" -gt "$off" ] && '
            f'{same} "$d/log.1"; then src="$d/log.1"; rot=1; size=$(stat -c %s "$d/log.1")\n'
            "  else off=0\n"
            "  fi\n"
            "fi\n"
        )
    lines.append('[ "$rot" = 0 ] && [ "$size" -lt "$off" ] && off=0\n')
    return "".join(lines)


def _epoch(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def read_state(transport: Transport, paths: RunPaths, pid: int, start: str, offset: int,
               max_bytes: int = 4 << 20, hold_s: float = 0, wake: str | None = None,
               wake_perl: str | None = None, inode: int | None = None, mark: str | None = None) -> JobState:
    command = poll_command(paths, pid, start, offset, max_bytes, hold_s, wake, wake_perl, inode, mark)
    # the answer starts at once after a hold, and a held poll writes a byte every KEEPALIVE_S: silence
    # for longer than a few of those is a link gone dark, noticed long before the timeout
    out = transport.run(command, timeout=hold_s + 60, idle_timeout=4 * KEEPALIVE_S).stdout
    head, _, body = out.partition("\n")
    fields = head.split()
    if len(fields) != 11 or fields[0] != POLL_MARK:
        raise OrchError(f"{transport.host.name}: unexpected answer while polling: {head[:200]!r}")
    _, alive, ec, size, off, present, *times, wrapper, ino, rot = fields
    exit_code = int(ec) if ec.lstrip("-").isdigit() else None
    data = base64.b64decode(body.strip() or b"")
    began, ended = (_epoch(t) for t in times) if times else (None, None)
    return JobState(alive == "1", exit_code, int(size), int(off), data, run_dir=present == "1",
                    started_at=began, ended_at=ended, wrapper=wrapper == "1",
                    inode=int(ino) if ino.isdigit() else None, rotated=rot == "1")


DISK_FULL_KIB = 64  # less room than this on the run dir's disk: the wrapper could not write the exit code


def loss_command(paths: RunPaths, start: str) -> str:
    """What the host can say of a job gone without an exit code: the room left on its run dir's disk, and
    the kernel's last OOM kill since the job started (empty where the kernel log cannot be read)."""
    since = f"$(( {int(start)} / $(getconf CLK_TCK) ))" if start.isdigit() else "0"
    return (
        f"df -Pk {quote(paths.root)} 2>/dev/null | awk 'NR == 2 {{print \"free\", $4}}'\n"
        f"dmesg 2>/dev/null | awk -F'[][]' -v t={since} '/oom-kill|Out of memory|Killed process/ && $2 + 0 >= t' "
        "| tail -n 1 | sed 's/^/oom /'\n"
    )


def explain_loss(transport: Transport, paths: RunPaths, start: str) -> str:
    """Why a job is gone without an exit code, as far as its host can tell."""
    free, oom = None, ""
    for line in transport.run(loss_command(paths, start), timeout=60, check=False).stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "free" and rest.strip().isdigit():
            free = int(rest)
        elif word == "oom":
            oom = rest.strip()
    if free is not None and free < DISK_FULL_KIB:
        return (f"the job ended but its exit code could not be written: the disk of {paths.root} is full "
                f"({free} KiB free)")
    if oom:
        return f"killed by the kernel's OOM killer: {oom[:200]}"
    return "the process is gone and wrote no exit code (killed by SIGKILL with its wrapper, or the host rebooted)"


def group_pids_command(pgid: int) -> str:
    """Lists the live (non-zombie) pids of a process group."""
    return GROUP_PIDS.format(pid=int(pgid))


def ours_function(pid: int, start: str) -> str:
    """Defines the shell function `ours`: what of the job's process group is provably the job's, now.

    It prints `group` while the group's leader (the wrapper, a zombie included) has the job's start time
    and the group has live members: then every member is the job's. With no process at all at the pid
    (the wrapper died and its group runs on; a group's id is not handed out again while the group lives)
    it prints the members that started after the wrapper and carry its mark. Nothing when the pid is
    another process now: the job's group is gone.
    """
    p, s = int(pid), quote(start)
    mark = quote(f"{JOB_MARK}={p}:{start}")
    return (
        "ours() {\n"
        f"  s=$({START_TIME.format(pid=p)})\n"
        f'  if [ "$s" = {s} ]; then [ -n "$({GROUP_PIDS.format(pid=p)})" ] && echo group; return 0; fi\n'
        '  [ -n "$s" ] && return 0\n'
        f"  for m in $({GROUP_PIDS.format(pid=p)}); do\n"
        f'    ms=$({START_TIME.format(pid="$m")}); [ "${{ms:-0}}" -ge {s} ] 2>/dev/null || continue\n'
        f"    tr '\\0' '\\n' < /proc/$m/environ 2>/dev/null | grep -qxF {mark} && echo \"$m\"\n"
        "  done\n"
        "}\n"
    )


def kill_command(pid: int, start: str, grace_s: float) -> str:
    """SIGTERM, a grace period, SIGKILL; the job's identity is proved again right before each signal, so a
    pid recycled meanwhile (an init that reaps at once) is never signalled, nor a group it leads."""
    if not start.isdigit():  # no start time recorded: nothing can be proved to be the job
        return "echo gone\n"
    steps = max(1, int(grace_s * 10))
    return (
        ours_function(pid, start)
        + 'sig() { w=$(ours); [ -n "$w" ] || return 1\n'
        f'  if [ "$w" = group ]; then kill -"$1" -- -{int(pid)}; else kill -"$1" $w; fi 2>/dev/null; return 0; }}\n'
        "sig TERM || { echo gone; exit 0; }\n"
        f'for _ in $(seq {steps}); do sleep 0.1; [ -n "$(ours)" ] || {{ echo stopped; exit 0; }}; done\n'
        "if sig KILL; then echo killed; else echo stopped; fi\n"
    )


def kill(transport: Transport, pid: int, start: str, grace_s: float = 10.0) -> str:
    """Stop the job's whole process group: SIGTERM, a grace period, then SIGKILL. Returns what happened."""
    return transport.run(kill_command(pid, start, grace_s), timeout=grace_s + 30).stdout.strip()


TAIL_BYTES = 1 << 20  # the last lines of a log come from its last MiB, however long its lines


def tail_command(paths: RunPaths, lines: int) -> str:
    # a log without newlines would otherwise be sent whole
    return f"tail -c {TAIL_BYTES} {quote(paths.log)} 2>/dev/null | tail -n {int(lines)} || true"


__all__ = ["RunPaths", "job_script", "kill", "launch", "read_state"]


def describe_exit(code: int) -> str:
    if code > 128:
        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"
