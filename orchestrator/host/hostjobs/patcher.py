"""Apply, check, revert and report orch patch sets on the host, against the installed package.

An op of the host's agent (`patch`: `answer`, in the agent's own process) when the run's python is the one
the agent runs on, the host's: the package is looked for where that python finds it when it runs a job
(`search_path`). A run with a python of its own, or a run's copy of the package (found through a PYTHONPATH
that python may set otherwise), is patched by the archive's `patch` entry (main.py), started by the agent's
`program` op under that python (3.8 or newer, standard library only), since only it knows where it finds
its engine: one JSON request on stdin, one JSON reply on stdout; the exit code is 0
whenever a reply was written, including a refusal (`ok: false`), so the caller always gets a reason it can
show.

Request (JSON, as orch's agent feeds it): {action:
check|apply|revert|status, set_name, set_hash, package, distribution, versions, strip, files: {relpath: diff},
force, state_dir, run_id, within?}. `within`: the package must be found below this folder (a run's
own copy) or nothing is done. `relpath` is the file's path below the
directory that holds the package's top-level folder (site-packages for an ordinary install).

Reply: {ok, error?: {file, hunk, line, message}, package, version, root,
files: [{file, path, sha_before, sha_after, state}], sets? (status)}.

State kept per set in `state_dir/<set>/`: state.json (set hash, run id, package, version, per-file
sha256 before/after) and pristine copies of every file under `pristine/<relpath>`, so a revert
restores the original bytes whatever the diff says.
"""

import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import site
import sys
import time

from .common import write_whole
from .versions import version_matches

# What a request may hold (the agent's `patch` op refuses anything else).
FIELDS = frozenset({"action", "set_name", "set_hash", "package", "distribution", "versions", "strip", "files",
                    "force", "state_dir", "run_id", "within"})
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
# How far (in lines, either way) a hunk may have moved from the line its header states. Context must
# still match exactly: an offset is tolerated, fuzz is not.
MAX_OFFSET = 100


class PatchFailure(Exception):
    """A refusal with the file and hunk it concerns; becomes the reply's `error`."""

    def __init__(self, message, file=None, hunk=None, line=None):
        Exception.__init__(self, message)
        self.message = message
        self.file = file
        self.hunk = hunk
        self.line = line

    def as_dict(self):
        return {"message": self.message, "file": self.file, "hunk": self.hunk, "line": self.line}


def sha256(data):
    return hashlib.sha256(data).hexdigest()


# --- locating the package ------------------------------------------------------------------------


def search_path():
    """The folders this python finds packages in when it runs a job, though the agent itself runs isolated
    (-I): the environment's PYTHONPATH (as a wrapper script at the python's name set it), this user's
    site-packages where that python adds it, then its own; relative entries left out, as the bootstrap
    leaves them out."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p.startswith("/")]
    if _user_site_added():
        path.append(site.getusersitepackages())
    return path + [p for p in sys.path if p.startswith("/")]


def _user_site_added():
    """Does this python, started without -I or -s, add the user's site-packages (site.py's rules)?"""
    if os.environ.get("PYTHONNOUSERSITE") or os.geteuid() != os.getuid() or os.getegid() != os.getgid():
        return False
    if sys.prefix == sys.base_prefix:
        return True
    try:  # a virtual environment adds it only when it includes the system's site-packages
        with open(os.path.join(sys.prefix, "pyvenv.cfg")) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip().lower() == "include-system-site-packages":
            return value.strip().lower() == "true"
    return False


def find_package(package, distribution, path=None):
    """(root, version): the directory holding the package's folder, and the installed version; looked for
    on `path` when given (the agent's op), else on this process's sys.path (the `patch` entry)."""
    # The bootstrap kept only absolute folders on sys.path: no stray folder where it started shadows it.
    # For a top-level name find_spec only locates the package; nothing of it is imported, which
    # matters because the engine's own dependencies (torch, CUDA) need not import here.
    if path is None:
        spec = importlib.util.find_spec(package)
    else:
        importlib.invalidate_caches()  # a long-lived agent: what was installed since is found too
        spec = importlib.machinery.PathFinder.find_spec(package, path)
    if spec is None:
        raise PatchFailure(f"package {package} is not installed for {sys.executable}")
    if spec.submodule_search_locations:
        package_dir = next(iter(spec.submodule_search_locations))
    elif spec.origin:
        package_dir = spec.origin  # a single-module distribution
    else:
        raise PatchFailure(f"cannot locate the files of package {package}")
    dist = distribution or package
    version = installed_version(dist, path)
    if version is None:
        raise PatchFailure(f"no installed distribution {dist} to read the version of")
    return os.path.dirname(os.path.abspath(package_dir)), version


def installed_version(dist, path=None):
    """The version of an installed distribution (looked for on `path` when given), or None."""
    import importlib.metadata  # here: it costs the host side's every start 40 % more, and only a patch needs it

    if path is None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None
    found = next(iter(importlib.metadata.Distribution.discover(name=dist, path=path)), None)
    return None if found is None else found.version


def target_path(root, relpath):
    """The absolute path of `relpath` under `root`; refuses anything that would leave `root`."""
    parts = relpath.split("/")
    if not relpath or relpath.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise PatchFailure(f"refusing unsafe path {relpath!r}", file=relpath)
    path = os.path.join(root, *parts)
    if os.path.commonpath([os.path.realpath(path), os.path.realpath(root)]) != os.path.realpath(root):
        raise PatchFailure(f"refusing a path that leaves the package root: {relpath!r}", file=relpath)
    return path


# --- unified diffs -------------------------------------------------------------------------------


class Hunk:
    def __init__(self, number, old_start, old_lines, new_lines):
        self.number = number  # 1-based within its file, for messages
        self.old_start = old_start  # 1-based line the header states
        self.old_lines = old_lines  # lines as bytes, each with its ending
        self.new_lines = new_lines


def split_lines(data):
    """Lines of `data` with their endings kept, so joining them gives the same bytes back."""
    lines = data.split(b"\n")
    out = [line + b"\n" for line in lines[:-1]]
    if lines[-1]:
        out.append(lines[-1])
    return out


def header_path(line, strip):
    """The path of a `---`/`+++` header line with `strip` leading components removed."""
    name = line[4:].split("\t")[0].strip()
    if name.startswith('"') and name.endswith('"'):
        name = name[1:-1]
    if name == "/dev/null":
        return None
    parts = [p for p in name.split("/") if p]
    if len(parts) <= strip:
        return None
    return "/".join(parts[strip:])


def parse_diff(relpath, text, strip):
    """The hunks of a one-file unified diff; refuses a header naming another file."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    hunks = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            named = header_path(line, strip)
            if named != relpath:
                raise PatchFailure(f"diff header names {named!r}, expected {relpath!r}", file=relpath)
            i += 1
            continue
        m = HUNK_RE.match(line)
        if not m:
            i += 1  # '---' headers and free text before the first hunk
            continue
        old_count = int(m.group(2)) if m.group(2) is not None else 1
        new_count = int(m.group(4)) if m.group(4) is not None else 1
        hunk = Hunk(len(hunks) + 1, int(m.group(1)), [], [])
        i += 1
        old_seen = new_seen = 0
        # Counting lines (not looking for the next header) is what tells a removed line that
        # starts with '--' apart from a header.
        while old_seen < old_count or new_seen < new_count:
            if i >= len(lines):
                raise PatchFailure("diff ends inside a hunk", file=relpath, hunk=hunk.number)
            body = lines[i]
            kind, content = (body[:1], body[1:]) if body else (" ", "")  # blank context line
            raw = content.encode("utf-8", "surrogateescape") + b"\n"
            if kind == " ":
                hunk.old_lines.append(raw)
                hunk.new_lines.append(raw)
                old_seen += 1
                new_seen += 1
            elif kind == "-":
                hunk.old_lines.append(raw)
                old_seen += 1
            elif kind == "+":
                hunk.new_lines.append(raw)
                new_seen += 1
            elif kind == "\\":
                pass
            else:
                raise PatchFailure(f"malformed hunk line {body[:40]!r}", file=relpath, hunk=hunk.number)
            i += 1
            # "\ No newline at end of file" belongs to the line just read.
            if i < len(lines) and lines[i].startswith("\\"):
                if kind in (" ", "-"):
                    hunk.old_lines[-1] = hunk.old_lines[-1][:-1]
                if kind in (" ", "+"):
                    hunk.new_lines[-1] = hunk.new_lines[-1][:-1]
                i += 1
        hunks.append(hunk)
    if not hunks:
        raise PatchFailure("diff has no hunks", file=relpath)
    return hunks


def apply_hunks(relpath, data, hunks):
    """The patched bytes, or PatchFailure naming the first hunk whose context is not found."""
    lines = split_lines(data)
    out = []
    pos = 0  # next unconsumed line of the original
    offset = 0  # how far earlier hunks were found from their stated lines
    for hunk in hunks:
        at = find_hunk(lines, hunk, hunk.old_start - 1 + offset, pos)
        if at is None:
            raise PatchFailure(
                "context mismatch", file=relpath, hunk=hunk.number, line=hunk.old_start
            )
        offset = at - (hunk.old_start - 1)
        out.extend(lines[pos:at])
        out.extend(hunk.new_lines)
        pos = at + len(hunk.old_lines)
    out.extend(lines[pos:])
    return b"".join(out)


def find_hunk(lines, hunk, expected, lowest):
    """The index where the hunk's old lines match exactly, nearest to `expected`, not before `lowest`."""
    if not hunk.old_lines:  # pure insertion: the header line is the place
        return max(lowest, min(expected + 1 if hunk.old_start else 0, len(lines)))
    n = len(hunk.old_lines)
    for delta in range(MAX_OFFSET + 1):
        for at in (expected - delta, expected + delta) if delta else (expected,):
            if lowest <= at <= len(lines) - n and lines[at : at + n] == hunk.old_lines:
                return at
    return None


# --- state on the host ---------------------------------------------------------------------------


def set_dir(request):
    name = request.get("set_name") or ""
    if not NAME_RE.match(name):
        raise PatchFailure(f"invalid patch set name {name!r}")
    return os.path.join(os.path.expanduser(request["state_dir"]), name)


def load_state(directory):
    path = os.path.join(directory, "state.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_atomic(path, data, like=None):
    """Replace `path` with `data` whole (common.write_whole, synced), keeping `like`'s mode; its folder made."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory)
    write_whole(path, data, 0o600 if like is None else like.st_mode & 0o7777, exact=True, sync=True)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def file_state(current_sha, entry):
    if current_sha is None:
        return "missing"
    if current_sha == entry["sha_after"]:
        return "applied"
    if current_sha == entry["sha_before"]:
        return "pristine"
    return "modified"


def current_sha(path):
    return sha256(read_bytes(path)) if os.path.exists(path) else None


# --- actions -------------------------------------------------------------------------------------


def plan(request, root):
    """Every file's original and patched bytes, computed in memory; nothing is written here."""
    planned = []
    for relpath in sorted(request["files"]):
        path = target_path(root, relpath)
        if not os.path.isfile(path):
            raise PatchFailure(f"file not found: {path}", file=relpath)
        before = read_bytes(path)
        hunks = parse_diff(relpath, request["files"][relpath], int(request.get("strip", 1)))
        after = apply_hunks(relpath, before, hunks)
        planned.append({"file": relpath, "path": path, "before": before, "after": after})
    return planned


def recorded_files(state, root):
    return [dict(e, path=target_path(root, e["file"])) for e in state["files"]]


def check_already(request, state, root):
    """Reply files when this exact set is applied and intact; refuses a stale or altered one."""
    if state.get("set_hash") != request.get("set_hash"):
        raise PatchFailure(
            f"{request['set_name']} is applied here in another version"
            f" (set hash {(state.get('set_hash') or '?')[:12]}, run {state.get('run_id')}); revert it first"
        )
    files = []
    for entry in recorded_files(state, root):
        sha = current_sha(entry["path"])
        if sha != entry["sha_after"]:
            raise PatchFailure(
                f"{request['set_name']} is recorded as applied but the file changed since"
                f" ({file_state(sha, entry)}); revert it first",
                file=entry["file"],
            )
        files.append(reply_file(entry, "already"))
    return files


def reply_file(entry, state):
    return {
        "file": entry["file"],
        "path": entry["path"],
        "sha_before": entry["sha_before"],
        "sha_after": entry["sha_after"],
        "state": state,
    }


def do_check(request, root):
    state = load_state(set_dir(request))
    if state is not None:
        return check_already(request, state, root)
    return [
        reply_file(dict(p, sha_before=sha256(p["before"]), sha_after=sha256(p["after"])), "pristine")
        for p in plan(request, root)
    ]


def do_apply(request, root, version):
    directory = set_dir(request)
    state = load_state(directory)
    if state is not None:
        return check_already(request, state, root)
    planned = plan(request, root)
    entries = []
    for p in planned:
        entries.append(
            {"file": p["file"], "sha_before": sha256(p["before"]), "sha_after": sha256(p["after"]),
             "mtime_ns": os.stat(p["path"]).st_mtime_ns}
        )
        write_atomic(os.path.join(directory, "pristine", *p["file"].split("/")), p["before"])
    state = {
        "set_name": request["set_name"],
        "set_hash": request.get("set_hash"),
        "run_id": request.get("run_id"),
        "package": request["package"],
        "distribution": request.get("distribution"),
        "version": version,
        "root": root,
        "applied_at": time.time(),
        "files": entries,
    }
    # The state goes down before the files: a crash in between leaves files that revert and status
    # still know about, never patched files nobody recorded.
    write_atomic(os.path.join(directory, "state.json"), json.dumps(state, indent=1).encode())
    written = []
    current = None
    try:
        for current in planned:
            write_atomic(current["path"], current["after"], like=os.stat(current["path"]))
            written.append(current)
    except BaseException as exc:  # noqa: BLE001 - even an interrupt must not leave half a set
        for done in written:  # all files or none
            write_atomic(done["path"], done["before"], like=os.stat(done["path"]))
        shutil.rmtree(directory, ignore_errors=True)
        failed = current["file"] if current else None
        raise PatchFailure(f"writing {failed} failed ({exc}); every file was restored", file=failed)
    return [reply_file(dict(e, path=p["path"]), "applied") for e, p in zip(entries, planned)]


def do_revert(request):
    """Restore the recorded originals; needs only the state, not the diffs or the package."""
    directory = set_dir(request)
    state = load_state(directory)
    if state is None:
        raise PatchFailure(f"{request['set_name']} is not applied here")
    entries = recorded_files(state, state["root"])
    restore = []
    for entry in entries:
        sha = current_sha(entry["path"])
        if sha == entry["sha_before"]:
            continue  # already the original bytes (e.g. an apply that was interrupted)
        if sha != entry["sha_after"] and not request.get("force"):
            raise PatchFailure(
                f"{entry['file']} changed since it was patched (sha256 {(sha or 'missing')[:12]});"
                " force to restore the original anyway",
                file=entry["file"],
            )
        restore.append(entry)
    pristine = {}
    for entry in restore:  # read and verify every pristine copy before touching any file
        data = read_bytes(os.path.join(directory, "pristine", *entry["file"].split("/")))
        if sha256(data) != entry["sha_before"]:
            raise PatchFailure(f"the saved original of {entry['file']} is damaged", file=entry["file"])
        pristine[entry["file"]] = data
    for entry in restore:
        path = entry["path"]
        like = os.stat(path) if os.path.exists(path) else None
        write_atomic(path, pristine[entry["file"]], like=like)
        if entry.get("mtime_ns"):
            # The original timestamp makes the byte-code cached before patching valid again.
            os.utime(path, ns=(time.time_ns(), entry["mtime_ns"]))
    for entry in entries:
        if current_sha(entry["path"]) != entry["sha_before"]:
            message = f"{entry['file']} does not match its original after the revert"
            raise PatchFailure(message, file=entry["file"])
    shutil.rmtree(directory)
    files = [reply_file(e, "reverted" if e in restore else "pristine") for e in entries]
    return state, files


def do_status(request, path=None):
    """Every set recorded under state_dir, with the state of each of its files."""
    base = os.path.expanduser(request["state_dir"])
    sets = []
    names = sorted(os.listdir(base)) if os.path.isdir(base) else []
    if request.get("set_name"):
        names = [n for n in names if n == request["set_name"]]
    for name in names:
        state = load_state(os.path.join(base, name))
        if state is None:
            continue
        installed = installed_version(state.get("distribution") or state["package"], path)  # None: uninstalled since
        files = []
        for entry in state["files"]:
            path = os.path.join(state["root"], *entry["file"].split("/"))
            files.append(reply_file(dict(entry, path=path), file_state(current_sha(path), entry)))
        sets.append(
            {
                "set_name": state["set_name"],
                "set_hash": state.get("set_hash"),
                "run_id": state.get("run_id"),
                "package": state["package"],
                "version": state.get("version"),
                "installed_version": installed,
                "root": state["root"],
                "applied_at": state.get("applied_at"),
                "files": files,
            }
        )
    return sets


def handle(request, path=None):
    action = request.get("action")
    reply = {"ok": True, "files": []}
    if action == "status":
        reply["sets"] = do_status(request, path)
        return reply
    if action not in ("check", "apply", "revert"):
        raise PatchFailure(f"unknown action {action!r}")
    set_dir(request)  # validates the name before anything else
    if action == "revert":
        state, reply["files"] = do_revert(request)
        reply.update(
            package=state["package"], version=state.get("version"), root=state["root"],
            set_hash=state.get("set_hash"), applied_by_run=state.get("run_id"),
        )
        return reply
    root, version = find_package(request["package"], request.get("distribution"), path)
    within = request.get("within")
    if within and os.path.commonpath([os.path.realpath(root), os.path.realpath(within)]) != os.path.realpath(within):
        # the run's copy was put first on PYTHONPATH, yet the python found another: a wrapper that sets
        # PYTHONPATH itself, say. Patching what it found would change the shared install.
        raise PatchFailure(f"{sys.executable} finds {request['package']} in {root}, not in the run's copy "
                           f"{within} (does the host's python set PYTHONPATH itself?); nothing was patched")
    reply.update(package=request["package"], version=version, root=root, set_hash=request.get("set_hash"))
    versions = request.get("versions") or ""
    if versions and not version_matches(version, versions):
        raise PatchFailure(
            f"{request['package']} {version} is installed; the set accepts {versions}"
        )
    reply["files"] = do_check(request, root) if action == "check" else do_apply(request, root, version)
    return reply


def answer(request, path=None):
    """The reply to one request (`path`: where to look for the package, see find_package); a refusal is a
    reply too (`ok: false`, with the file and hunk it concerns)."""
    try:
        return handle(request, path)
    except PatchFailure as exc:
        return {"ok": False, "error": exc.as_dict()}
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return {"ok": False, "error": {"message": f"{type(exc).__name__}: {exc}"}}


def main():
    """The `patch` entry: a request on stdin, under a python of its own, looked for on its own sys.path."""
    try:
        request = json.loads(sys.stdin.read())
    except ValueError as exc:
        reply = {"ok": False, "error": {"message": f"{type(exc).__name__}: {exc}"}}
    else:
        reply = answer(request) if isinstance(request, dict) else {"ok": False, "error": {"message": "not a request"}}
    sys.stdout.write(json.dumps(reply))
    sys.stdout.write("\n")
    return 0
