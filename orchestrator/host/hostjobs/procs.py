"""Processes on the host: start times from /proc, proof that a process is a job's, and signals sent only
through a hold on the proved process (a pidfd), never to a pid that may have been reused."""

import errno
import os
import shutil
import signal
import subprocess
import time

from .common import JOB_MARK


def _stat_fields(pid):
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def start_time(pid):
    """The process start time in clock ticks (field 22), or None when there is no such process."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def live_start(pid):
    """Like start_time, None for a zombie too (where nothing reaps orphans a dead wrapper lingers)."""
    fields = _stat_fields(pid)
    return fields[19] if fields and fields[0] != "Z" else None


def group_pids(pgid):
    """The live (non-zombie) members of a process group."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(name)
        if fields and fields[0] != "Z" and fields[2] == str(pgid):
            found.append(int(name))
    return found


def _marked(pid, mark):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False


def _job_member(m, pid, start):
    """Whether process m is the job's though its wrapper is gone: live, in the job's group, started after
    the wrapper, carrying the wrapper's mark."""
    fields = _stat_fields(m)
    return (fields is not None and fields[0] != "Z" and fields[2] == str(pid) and int(fields[19]) >= int(start)
            and _marked(m, f"{JOB_MARK}={int(pid)}:{start}".encode()))


def ours(pid, start):
    """What of the job's process group is provably the job's now: "group" while its leader (the wrapper,
    a zombie included) has the job's start time and the group has live members; with no process at the
    pid (the wrapper died, its group runs on), the members started after it that carry its mark; None
    when the pid is another process now, or nothing is left."""
    if not str(start).isdigit():
        return None
    now = start_time(pid)
    if now == str(start):
        return "group" if group_pids(pid) else None
    if now is not None:
        return None
    return [m for m in group_pids(pid) if _job_member(m, pid, start)] or None


PIDFD_SIGNAL_PROCESS_GROUP = 4  # linux/pidfd.h (Linux 6.9): signal the held process's whole group
# Python 3.8 has no os.pidfd_open: the system calls themselves, numbered alike on every Linux architecture
SYS_PIDFD_SEND_SIGNAL, SYS_PIDFD_OPEN = 424, 434


def _syscall(number, *args):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    res = libc.syscall(number, *[ctypes.c_long(a) for a in args])
    if res < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))  # ESRCH comes out a ProcessLookupError
    return res


def _pidfd_send(fd, sig, flags=0):
    if hasattr(signal, "pidfd_send_signal"):
        signal.pidfd_send_signal(fd, sig, None, flags)
    else:
        _syscall(SYS_PIDFD_SEND_SIGNAL, fd, sig, 0, flags)


def _hold(pid):
    """A pidfd on this very process (Linux 5.3), taken before the process is proved ours: a signal sent
    through it reaches that process or nothing, never a later one that took its pid after the proof. None
    where the host has no pidfds (there the proof and the signal by number follow each other as closely as
    they can); raises ProcessLookupError when the process is gone."""
    try:
        return os.pidfd_open(pid) if hasattr(os, "pidfd_open") else _syscall(SYS_PIDFD_OPEN, pid, 0)
    except ProcessLookupError:
        raise
    except (OSError, ImportError, AttributeError):  # ENOSYS, a sandbox's EPERM, a Python built without ctypes
        return None


def _signal_proved(pid, sig, proof, group=False):
    """Hold the process, prove it (`proof()` reads /proc afresh), signal it (or, with `group`, its
    process group) through the hold. True when signalled."""
    try:
        fd = _hold(pid)
    except ProcessLookupError:
        return False
    try:
        if not proof():
            return False
        if fd is None:
            (os.killpg if group else os.kill)(pid, sig)
        elif not group:
            _pidfd_send(fd, sig)
        else:
            try:
                _pidfd_send(fd, sig, PIDFD_SIGNAL_PROCESS_GROUP)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                return _signal_members(fd, pid, sig)  # before Linux 6.9
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _signal_each(sig, proofs):
    """Signal every (pid, proof) on its own, not only up to the first that is; True when any was."""
    sent = False
    for pid, proof in proofs:
        sent = _signal_proved(pid, sig, proof) or sent
    return sent


def _signal_members(leader, pgid, sig):
    """Each member of the held leader's group on its own: held, then proved in the group while the
    leader still exists (until it is reaped, no other group can have its pid for an id)."""
    def in_group(m):
        fields = _stat_fields(m)
        if fields is None or fields[2] != str(pgid):
            return False
        _pidfd_send(leader, 0)  # raises ProcessLookupError once the leader is reaped
        return True

    return _signal_each(sig, [(m, lambda m=m: in_group(m)) for m in group_pids(pgid)])


def signal_job(pid, start, sig):
    """Signal what is provably the job's; False when nothing is. Each process is held before its proof
    and signalled through the hold, so a pid freed and given to another process meanwhile (in the
    grace window, say) is never reached. A process of the job that left its group (`setsid`) is the
    job's by its mark, and signalled too."""
    if not str(start).isdigit():
        return False
    pid = int(pid)
    strays = _signal_each(sig, [(m, lambda m=m: _stray(m, pid, start)) for m in strays_of(pid, start)])
    if _signal_proved(pid, sig, lambda: ours(pid, start) == "group", group=True):
        return True
    who = ours(pid, start)  # the wrapper gone: its marked members, each proved again once held
    members = who if isinstance(who, list) else []
    return _signal_each(sig, [(m, lambda m=m: _job_member(m, pid, start)) for m in members]) or strays


def _stray(m, pid, start):
    """Whether process m is the job's outside its group: this user's, live, started after the wrapper,
    carrying its mark (a child that left the group with `setsid`)."""
    fields = _stat_fields(m)
    try:
        mine = os.stat(f"/proc/{m}").st_uid == os.geteuid()
    except OSError:
        return False
    return (mine and fields is not None and fields[0] != "Z" and fields[2] != str(pid)
            and int(fields[19]) >= int(start) and _marked(m, f"{JOB_MARK}={int(pid)}:{start}".encode()))


def strays_of(pid, start):
    """The job's processes outside its group (see _stray)."""
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and _stray(int(n), pid, start)]


def terminate(send, alive, grace_s):
    """Every stop here: SIGTERM, a grace period, SIGKILL: 'gone' | 'stopped' | 'killed'. `send(sig)` signals
    what is still provably the target (False: nothing is); `alive()` says whether anything of it is left."""
    if not send(signal.SIGTERM):
        return "gone"
    deadline = time.monotonic() + max(0.0, float(grace_s))
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if not alive():
            return "stopped"
    return "killed" if send(signal.SIGKILL) else "stopped"


def kill(pid, start, grace_s):
    """Stop the job's process group, proved the job's before each signal."""
    return terminate(lambda sig: signal_job(pid, start, sig),
                     lambda: ours(pid, start) is not None or bool(strays_of(pid, start)), grace_s)


def stacks(pid, start):
    """py-spy's stacks of every live process of the job's group (only those proven the job's when its
    start time is known): read-only, a stalled job's picture."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "py-spy is not installed on this host"
    who = ours(pid, start) if start else "group"
    members = group_pids(pid) if who == "group" else (who or [])
    parts = []
    for m in sorted(members):
        try:
            out = subprocess.run([spy, "dump", "--pid", str(m)], capture_output=True, timeout=60, check=False)
            said = (out.stdout + out.stderr).decode(errors="replace")
        except (OSError, subprocess.SubprocessError) as exc:
            said = f"{type(exc).__name__}: {exc}\n"
        parts.append(f"== pid {m}\n{said}")
    return "".join(parts)

def kill_pids(procs, grace_s):
    """Stop each process that still has the start time seen. Each process is held before its start time is
    checked, and signalled through the hold: a reused pid is left alone."""
    def signal_all(sig):
        return _signal_each(sig, [(pid, lambda pid=pid, start=start: live_start(pid) == start)
                                  for pid, start in procs])

    return terminate(signal_all, lambda: any(live_start(pid) == start for pid, start in procs), grace_s)
