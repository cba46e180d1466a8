"""Host leases and run dirs in a workdir that several workspaces (or Unix users) may share, on the host.

Who holds a host: the run whose token its lease files in `<workdir>/leases/` name, taken by one `take`
request to the agent in the transaction that creates the run (granted under the host's lock, or refused
naming the holder, and then no run is made) and freed by one `release` after the run's end steps. Whether a
holder still holds is judged here alone, for every workspace alike, from what the host can prove: its run
prepares (no pid yet, under an hour old), its job runs (its wrapper, or the processes that carry its
mark), or its job ended under ENDING_S ago (its end steps, the log read to its end and the patches
reverted, come before the next run).

Each action is a function of its own (`take`, `release`, `owner`, `remove`), called by the agent's `lease`
op in its own process (`answer`: a reply with `ok`, or `ok: false` and the refusal's kind and words). A
start makes one request here, `take`: granted, or refused naming the holder.

Everything read here may have been written by someone else: lease files are parsed as JSON into known
shapes (numbers as numbers, paths checked to lie under `<workdir>/runs/`), never evaluated; files and
folders are opened without following symlinks (a symlink is refused, never written through); lease files
are written to a temporary file and renamed into place. `leases/` and run dirs owned by another user are
refused unless the request says the workdir is shared (a run dir never: it is always its run's own).

Layout under the workdir: `leases/.lock` (the flock every change holds), `leases/host` and
`leases/gpu-N` (one per key: {token, run_dir, taken_at, uid}; a lease naming a uid that is not its file's
owner is none; `KEY.UID` where a sticky shared `leases/` keeps another user's ended lease at KEY); a run
dir holds its run's token in
`.orch/token` (or, from an older layout, `token`).
"""

import errno
import fcntl
import json
import math
import os
import posixpath
import re
import shutil
import stat
import time

from .common import CONTROL, Refusal, read_small, write_whole
from .procs import ours
from .rundirs import claim_run_dir

LEASES = "leases"
LOCK = ".lock"
KEY_RE = re.compile(r"^(host|gpu-[0-9]{1,4})$")
# A lease file is `leases/KEY`, or `leases/KEY.UID` where a sticky shared leases/ keeps another user's
# ended lease at KEY (only its owner may replace it).
FILE_RE = re.compile(r"^(host|gpu-[0-9]{1,4})(?:\.([0-9]{1,10}))?$")
# A lease whose run has no pid yet (it prepares: patches, GPU cleanup) is believed this long.
STARTING_S = 3600.0
# A lease whose job ended is held this long after its exit code (or, for a stopped job, which has none, after
# a take first found it over) while its end steps run; they release it within seconds, and a finisher that
# died never blocks the host for longer.
ENDING_S = 900.0
# Clocks of the hosts that share a filesystem differ a little; a lease further in the future is not
# believed, or it would block its keys for ever.
FUTURE_SLACK_S = 300.0
LOCK_WAIT_S = 30.0
# An older orch wrote lease lines `token<TAB>run dir<TAB>epoch seconds`.
LEGACY_RE = re.compile(r"^([^\t\n]{1,4096})\t(/[^\t\n]{0,4096})\t([0-9]{1,12}(?:\.[0-9]{1,9})?)\n?$")
PID_RE = re.compile(r"^([0-9]{1,10}) ([0-9]{1,20})\n?$")


def workspace_of(token):
    """The workspace part of a run token (`hostname:db path:run id:created`)."""
    return token.rsplit(":", 2)[0]


# --- files, without following symlinks -----------------------------------------------------------


def _lstat(path):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _check_dir(path, what, shared=False):
    """A real folder (not a symlink), ours unless `shared`; None when it does not exist."""
    st = _lstat(path)
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise Refusal(f"{what} {path} is a symlink; refusing to use it", kind="symlink", path=path)
    if not stat.S_ISDIR(st.st_mode):
        raise Refusal(f"{what} {path} is not a folder", kind="not-a-dir", path=path)
    if not shared and st.st_uid != os.geteuid():
        raise Refusal(f"{what} {path} belongs to uid {st.st_uid}, not to this user (declare the workdir "
                      "shared if several users share it)", kind="owner", path=path)
    return st


SHARED_MODE = 0o3070  # a shared folder: group-writable, setgid (what is made inside keeps the group) and
# sticky (only an entry's owner renames or deletes it: nobody swaps another user's run dir or lease file)


def _make_dir(path, what, shared=False, mode=0o755, group=False):
    """Make a folder (none a symlink). `group`: the workdir's users share it, so it is made SHARED_MODE
    whatever the umask, by whoever owns it."""
    if _check_dir(path, what, shared) is None:
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            pass  # made meanwhile by someone else: checked below like any other
    st = _check_dir(path, what, shared)
    if group and st.st_uid == os.geteuid() and st.st_mode & SHARED_MODE != SHARED_MODE:
        os.chmod(path, stat.S_IMODE(st.st_mode) | SHARED_MODE)


# --- the lock -----------------------------------------------------------------------------------


def lock_holder(fd):
    """Who holds the flock on `fd`'s file, from /proc/locks: 'pid N (user U: command)'."""
    st = os.fstat(fd)
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown (no /proc/locks)"
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] == "->" or parts[1] != "FLOCK":
            continue
        dev_ino = parts[5].split(":")
        if len(dev_ino) != 3 or not parts[4].isdigit() or not dev_ino[2].isdigit():
            continue
        if int(dev_ino[2]) != st.st_ino:
            continue
        pid = int(parts[4])
        return f"pid {pid} ({describe_process(pid)})"
    return "unknown"


def describe_process(pid):
    user, command = "?", "?"
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    try:
                        import pwd

                        user = pwd.getpwuid(uid).pw_name
                    except (KeyError, ImportError):
                        user = str(uid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(400)
        command = " ".join(p.decode("utf-8", "replace") for p in raw.split(b"\0") if p)
        command = "".join(c if c.isprintable() else "?" for c in command)[:200]
    except OSError:
        pass
    return f"user {user}: {command}"


class Lock:
    """The flock on `leases/.lock`, taken within `wait_s` or refused naming its holder."""

    def __init__(self, leases_dir, wait_s=LOCK_WAIT_S, sleep=time.sleep):
        self.path = os.path.join(leases_dir, LOCK)
        self.wait_s, self.sleep, self.fd = wait_s, sleep, -1

    def __enter__(self):
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:  # never O_TRUNC: the lock file is nobody's data, but a symlink must not truncate a victim's
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | flags, 0o664)
        except PermissionError:
            self.fd = os.open(self.path, os.O_RDONLY | flags)  # another user's lock file: flock works read-only
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refusal(f"{self.path} is a symlink; refusing to use it", kind="symlink",
                              path=self.path) from None
            raise
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise Refusal(f"{self.path} is not a regular file", kind="not-a-file", path=self.path)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = lock_holder(self.fd)
                    os.close(self.fd)
                    raise Refusal(f"the lease lock {self.path} is held by {holder} for more than "
                                  f"{self.wait_s:g} s", kind="lock-busy", holder=holder) from None
                self.sleep(0.05)

    def __exit__(self, *exc):
        os.close(self.fd)  # closing drops the flock


# --- lease files ---------------------------------------------------------------------------------


def _finite(value):
    """A JSON number that is one (not a bool, not nan or inf)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def parse_lease(text, runs_dirs):
    """{token, run_dir, taken_at, over_at} from a lease file's text, or None when it is not one: every field
    checked for its shape, the run dir for lying under one of `runs_dirs`; `over_at` (when the host first
    saw its job over) None when not recorded."""
    lease, over_at = None, None
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        if isinstance(doc, dict):
            lease = (doc.get("token"), doc.get("run_dir"), doc.get("taken_at"))
            over_at = doc.get("over_at")
    else:
        m = LEGACY_RE.match(text)
        if m:
            lease = (m.group(1), m.group(2), float(m.group(3)))
    if lease is None:
        return None
    token, run_dir, taken_at = lease
    if not isinstance(token, str) or token.count(":") < 3 or len(token) > 4096 or not token.isprintable():
        return None
    if not _finite(taken_at):
        return None
    if not isinstance(run_dir, str) or not under(run_dir, runs_dirs):
        return None
    return {"token": token, "run_dir": posixpath.normpath(run_dir), "taken_at": float(taken_at),
            "over_at": float(over_at) if _finite(over_at) else None}


def under(path, parents):
    """Is `path` (normalised, no `..`) strictly below one of `parents`?"""
    if not path.startswith("/") or "\0" in path:
        return False
    norm = posixpath.normpath(path)
    return any(norm.startswith(p.rstrip("/") + "/") for p in parents)


def dir_token(run_dir):
    """The token a run dir holds (either layout), or None."""
    for name in (os.path.join(CONTROL, "token"), "token"):
        text = read_small(os.path.join(run_dir, name))
        if text is not None:
            return text.strip()
    return None


def liveness(lease, now, mark=None):
    """(live, why): whether the lease's run still holds, and what decided it. A job seen over for the first
    time, with no exit code to date its end (a stopped job), holds from then on for ENDING_S when `mark(now)`
    records that moment in its lease file (False: it cannot, and the job's lease is over at once)."""
    run_dir = lease["run_dir"]
    age = now - lease["taken_at"]
    if age < -FUTURE_SLACK_S:
        return False, "dated in the future"
    young = age < STARTING_S
    try:
        st = _lstat(run_dir)
        if st is None or not stat.S_ISDIR(st.st_mode):  # not made yet: the run prepares
            return young, "preparing"
        token = dir_token(run_dir)
        if token is None:
            return young, "preparing"
        if token != lease["token"]:
            return False, "its run dir is another run's"
        control = os.path.join(run_dir, CONTROL)
        if _lstat(control) is None:
            control = run_dir
        ended = _lstat(os.path.join(control, "exit_code"))
        m = PID_RE.match(read_small(os.path.join(control, "pid")) or "")
    except Refusal:
        return False, "its run dir is not trusted"
    over = "its job ended, its end steps run"
    if ended is not None:
        return now - ended.st_mtime < ENDING_S, over
    if m is None:
        return young, "preparing"
    if ours(int(m.group(1)), m.group(2)) is not None:  # the wrapper, or the job's marked processes
        return True, "running"
    if lease["over_at"] is not None:  # a moment in the future is not believed, or it would hold for ever
        return -FUTURE_SLACK_S < now - lease["over_at"] < ENDING_S, over
    return mark is not None and mark(now), over


def _lease_files(leases_dir, names):
    """(name, path, text) of the lease files among `names`; text None for anything that is not one: a
    symlink or worse, or a file whose owner is not the uid it names (a lease in someone else's name)."""
    for name in names:
        if not FILE_RE.match(name):
            continue
        path = os.path.join(leases_dir, name)
        st = _lstat(path)
        if st is None:
            continue
        if not stat.S_ISREG(st.st_mode):
            yield name, path, None  # a symlink or worse: not a lease, and replaced when the key is taken
            continue
        try:
            text = read_small(path)
        except Refusal:
            yield name, path, None
            continue
        yield name, path, text if _written_by(text, st.st_uid) else None


def _written_by(text, uid):
    """Does a lease's text name `uid` (its file's owner) as its taker? An older orch's names none."""
    try:
        doc = json.loads(text) if text.startswith("{") else None
    except ValueError:
        return True  # not a lease at all: parse_lease says so
    named = doc.get("uid") if isinstance(doc, dict) else None
    return named is None or named == uid


def _key_files(leases_dir, keys):
    """The names in leases/ of the lease files of `keys` (every key for `host`)."""
    try:
        names = os.listdir(leases_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if FILE_RE.match(n) and (keys == ["host"] or FILE_RE.match(n).group(1)
                                                             in ("host", *keys)))


# --- actions -------------------------------------------------------------------------------------


def _runs_dirs(workdir):
    return sorted({posixpath.join(workdir, "runs"), posixpath.join(os.path.realpath(workdir), "runs")})


def check_run_dir(workdir, run_dir, token):
    """Refuse a run dir outside `<workdir>/runs/`, reached through a symlink, not ours, or holding another
    run's token. Returns whether it exists."""
    runs = posixpath.join(workdir, "runs")
    if not under(run_dir, [runs]) or posixpath.normpath(run_dir) != run_dir:
        raise Refusal(f"{run_dir} is not a run dir under {runs}/", kind="outside", path=run_dir)
    path = runs
    for part in [""] + run_dir[len(runs) + 1:].split("/"):
        path = posixpath.join(path, part) if part else path
        what = "run dir" if path == run_dir else "folder"
        if _check_dir(path, what, shared=path == runs) is None:
            return False
    found = dir_token(run_dir)
    if found is not None and found != token:
        mine = workspace_of(found) == workspace_of(token)
        raise Refusal(f"run dir in use by {'another' if mine else 'another workspace'}'s run: {run_dir}",
                      kind="dir-in-use", path=run_dir)
    return True


def _claim_in(workdir, run_dir, token, shared=False):
    """Make the run dir the run's own (rundirs.claim_run_dir, as the launch claims it again), in the workdir's
    `runs/`, which the workdir's users share when `shared`."""
    _make_dir(posixpath.join(workdir, "runs"), "folder", shared=True, group=shared)
    try:
        claim_run_dir(run_dir, token).close()
    except Refusal:
        raise
    except RuntimeError as exc:  # a link, or a folder not this user's, on the way
        raise Refusal(str(exc), path=run_dir) from None


def conflicts(workdir, keys, token, now):
    """Refuse (Refusal kind `held`, naming the lease) while another run that still holds (`liveness`) has
    one of `keys` or the whole host, whichever workspace it is of; else the warnings about lease files
    ignored. The run `token` itself may take again what it holds."""
    leases_dir = posixpath.join(workdir, LEASES)
    names = _key_files(leases_dir, keys)
    warnings = []
    for name, path, text in _lease_files(leases_dir, names):
        lease = parse_lease(text, _runs_dirs(workdir)) if text is not None else None
        if lease is None:
            warnings.append(f"ignored {name}: not a lease file")
            continue
        if lease["token"] == token:
            continue
        live, why = liveness(lease, now, lambda at, path=path, text=text: _mark_over(path, text, at))
        if live:
            raise Refusal(f"{name} held by {lease['token']} ({why})", kind="held", key=FILE_RE.match(name).group(1),
                          token=lease["token"], run_dir=lease["run_dir"], taken_at=lease["taken_at"],
                          why=why)
        if why == "dated in the future":
            warnings.append(f"ignored {name}: taken at {lease['taken_at']:.0f}, in the future")
    return warnings


def _mark_over(path, text, at):
    """Record in a lease file of this user's when its job was first seen over; False for another user's."""
    st = _lstat(path)
    if st is None or st.st_uid != os.geteuid() or not text.startswith("{"):
        return False
    write_whole(path, json.dumps(dict(json.loads(text), over_at=at)) + "\n", stat.S_IMODE(st.st_mode))
    return True


def take(workdir, run_dir, token, keys, shared=False, now=None, lock_wait_s=LOCK_WAIT_S):
    """Claim the run dir and take the lease files `keys` (`host`, or `gpu-N`), under the lock; refuse
    (Refusal kind `held`) while another run that still holds has a conflicting key (`conflicts`)."""
    workdir = posixpath.normpath(workdir)
    for key in keys:
        if not KEY_RE.match(key):
            raise Refusal(f"not a lease key: {key!r}")
    os.makedirs(workdir, 0o755, exist_ok=True)  # a first run on a host whose workdir nothing has made yet
    check_run_dir(workdir, run_dir, token)
    warnings = []
    if keys:
        leases_dir = posixpath.join(workdir, LEASES)
        _make_dir(leases_dir, "leases folder", shared=shared, group=shared)
        with Lock(leases_dir, lock_wait_s):
            now = time.time() if now is None else now
            warnings = conflicts(workdir, keys, token, now)
            _claim_in(workdir, run_dir, token, shared)
            doc = json.dumps({"token": token, "run_dir": run_dir, "taken_at": now, "uid": os.geteuid()})
            for key in keys:
                _write_lease(leases_dir, key, doc + "\n")
    else:
        _claim_in(workdir, run_dir, token, shared)
    return {"warnings": warnings}


def _write_lease(leases_dir, key, text):
    """The lease file of `key`; beside another user's ended lease there when a sticky leases/ keeps it
    (`KEY.UID`, read as the key's too)."""
    mine = f"{key}.{os.geteuid()}"
    try:
        write_whole(os.path.join(leases_dir, key), text, 0o664)
    except PermissionError:
        write_whole(os.path.join(leases_dir, mine), text, 0o664)
        return
    if _lstat(os.path.join(leases_dir, mine)) is not None:
        os.unlink(os.path.join(leases_dir, mine))  # an older one of this user's, beside a lease gone since


def release(workdir, token, shared=False, lock_wait_s=LOCK_WAIT_S):
    """Remove the lease files naming `token`."""
    leases_dir = posixpath.join(posixpath.normpath(workdir), LEASES)
    if _check_dir(leases_dir, "leases folder", shared) is None:
        return {"released": []}
    released = []
    with Lock(leases_dir, lock_wait_s):
        for name, path, text in _lease_files(leases_dir, sorted(os.listdir(leases_dir))):
            lease = parse_lease(text, _runs_dirs(workdir)) if text is not None else None
            if lease is not None and lease["token"] == token:
                os.unlink(path)
                released.append(name)
    return {"released": released}


def owner(workdir, run_dir, token):
    """Whose the run dir is: `mine` (it holds the token), `other`, `none` (no token) or `missing`."""
    try:
        if not check_run_dir(posixpath.normpath(workdir), run_dir, token):
            return {"owner": "missing"}
    except Refusal as exc:
        if exc.kind == "dir-in-use":
            return {"owner": "other"}
        raise
    return {"owner": "mine" if dir_token(run_dir) == token else "none"}


def remove(workdir, run_dir, token):
    """Delete a run dir: only one under `<workdir>/runs/`, reached without symlinks, holding `token`."""
    found = owner(workdir, run_dir, token)["owner"]
    if found == "missing":
        return {"removed": False, "why": "already gone"}
    if found != "mine":
        raise Refusal(f"{run_dir} holds {'another run' if found == 'other' else 'no'} token of this "
                      "workspace's run; left as it is", kind="not-mine", path=run_dir)
    shutil.rmtree(run_dir)  # fd-based: a symlink inside is unlinked, never followed
    return {"removed": True}


ACTIONS = {
    "take": lambda r: take(r["workdir"], r["run_dir"], r["token"], r["keys"], bool(r.get("shared")),
                           lock_wait_s=float(r.get("lock_wait_s", LOCK_WAIT_S))),
    "release": lambda r: release(r["workdir"], r["token"], bool(r.get("shared")),
                                 lock_wait_s=float(r.get("lock_wait_s", LOCK_WAIT_S))),
    "owner": lambda r: owner(r["workdir"], r["run_dir"], r["token"]),
    "remove": lambda r: remove(r["workdir"], r["run_dir"], r["token"]),
}


def handle(request):
    action = ACTIONS.get(request.get("action"))
    if action is None:
        raise Refusal(f"unknown action {request.get('action')!r}")
    return dict(action(request), ok=True)


def answer(request):
    """The reply to one request: the action's result, or `ok: false` with the refusal's kind and words."""
    try:
        return handle(request)
    except Refusal as exc:
        return {"ok": False, "error": exc.as_dict()}
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return {"ok": False, "error": {"kind": "error", "message": f"{type(exc).__name__}: {exc}"}}
