"""Every argument of every op, checked before the op runs: a request names files, pids and numbers,
nothing in it is evaluated, and a field an op does not know refuses the request."""



from .common import CHUNK, ENTRIES
from .leases import ACTIONS as LEASE_ACTIONS
from .leases import LOCK_WAIT_S
from .patcher import FIELDS as PATCH_FIELDS
from .slurm import SINFO_FORMATS


def _path(v):
    return isinstance(v, str) and v.startswith("/") and "\0" not in v and len(v) < 4096


def _count(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62


def _ticks(v):
    return isinstance(v, str) and len(v) < 32 and (v == "" or v.isdigit())


def _seconds(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 86400


def _text(v):
    return isinstance(v, str)


def _word(v):
    return isinstance(v, str) and 0 < len(v) <= 256 and all(c.isalnum() or c in "-_.:" for c in v)


def _token(v):
    return isinstance(v, str) and 0 < len(v) <= 4096 and not any(c in v for c in "\0\n\r")


def _option(v):
    return isinstance(v, str) and v.startswith("-") and len(v) <= 4096 and not any(c in v for c in "\0\n\r")


def _arg(v):
    return isinstance(v, str) and "\0" not in v and len(v) <= 1 << 20


def _argv(v):
    return isinstance(v, list) and 0 < len(v) <= 4096 and all(_arg(x) for x in v) and v[0] != ""


def _arg_word(v):
    return _arg(v) and v != "" and len(v) < 4096


def _sha256(v):
    return isinstance(v, str) and len(v) == 64 and _hex(v)


def _maybe_word(v):
    return v == "" or _word(v)


def _hex(v):
    return isinstance(v, str) and len(v) % 2 == 0 and all(c in "0123456789abcdef" for c in v)


def _flag(v):
    return isinstance(v, bool)


def _url(v):
    return isinstance(v, str) and v.startswith(("http://", "https://")) and len(v) < 2048 and not any(
        c.isspace() for c in v)


def _facts(v):
    """What a launch is asked to look at for the run's receipt: the engine's python and distributions, and
    the model's config files."""
    return (isinstance(v, dict) and set(v) <= {"python", "packages", "files", "gpus"} and _flag(v.get("gpus", True))
            and _maybe(_arg_word)(v.get("python")) and _list_of(_word, 32)(v.get("packages", []))
            and _list_of(_path, 64)(v.get("files", [])))


def _maybe(check):
    return lambda v: v is None or check(v)


def _list_of(check, most=10000):
    return lambda v: isinstance(v, list) and len(v) <= most and all(check(x) for x in v)


def _pid_start(v):
    return isinstance(v, list) and len(v) == 2 and _count(v[0]) and v[0] > 0 and _ticks(v[1]) and v[1] != ""


REQUIRED = object()
# op -> {argument: (check, default)}
ARGS = {
    "hello": {}, "ping": {},
    # a batch job is followed under its scheduler's handle (job id, "slurm:<name>"): never signalled here
    "follow": {"key": (_word, REQUIRED), "dir": (_path, REQUIRED), "pid": (_count, 0), "start": (_maybe_word, ""),
               "offset": (_count, 0), "inode": (_maybe(_count), None), "tail": (_hex, ""),
               "scheduled": (_flag, False)},
    "unfollow": {"key": (_word, REQUIRED)},
    "poke": {"keys": (_list_of(_word), [])},
    "ack": {"bytes": (_count, REQUIRED)},
    "launch": {"dir": (_path, REQUIRED), "script": (_text, REQUIRED), "token": (_token, REQUIRED),
               "facts": (_maybe(_facts), None)},
    "kill": {"pid": (_count, REQUIRED), "start": (_ticks, REQUIRED), "grace_s": (_seconds, REQUIRED)},
    "stacks": {"pid": (_count, REQUIRED), "start": (_ticks, "")},
    "kill_pids": {"procs": (_list_of(_pid_start, 4096), REQUIRED), "grace_s": (_seconds, REQUIRED)},
    "find": {"dir": (_path, REQUIRED)},
    "loss": {"dir": (_path, REQUIRED), "start": (_ticks, "")},
    "read": {"dir": (_path, REQUIRED), "pid": (_count, 0), "start": (_ticks, ""), "offset": (_count, 0),
             "max_bytes": (_count, CHUNK), "inode": (_maybe(_count), None), "tail": (_hex, ""),
             "hold_s": (_seconds, 0), "wake": (_list_of(_text, 8), []), "scheduled": (_flag, False)},
    "tail": {"path": (_path, REQUIRED), "lines": (_count, REQUIRED)},
    "chunk": {"path": (_path, REQUIRED), "offset": (_count, 0), "length": (_count, CHUNK)},
    "size": {"path": (_path, REQUIRED)},
    "stat": {"path": (_path, REQUIRED)},
    "listdir": {"path": (_path, REQUIRED), "most": (_count, 100000)},
    "usage": {"path": (_path, REQUIRED)},
    "exec": {"argv": (_argv, REQUIRED), "timeout_s": (_seconds, 120)},
    "program": {"python": (_arg_word, REQUIRED), "path": (_path, REQUIRED), "sha256": (_sha256, REQUIRED),
                "entry": (lambda v: isinstance(v, str) and v in ENTRIES, REQUIRED),
                "input": (_text, ""), "pythonpath": (_maybe(_arg), None), "timeout_s": (_seconds, 120)},
    "submit": {"dir": (_path, REQUIRED), "script": (_text, REQUIRED), "token": (_token, REQUIRED),
               "options": (_list_of(_option, 256), []), "facts": (_maybe(_facts), None)},
    "squeue": {"job_id": (_maybe(_count), None)},
    "sacct": {"ids": (_list_of(_count, 10000), REQUIRED)},
    "scancel": {"job_id": (_count, REQUIRED), "kill": (_flag, False)},
    "sinfo": {"what": (lambda v: isinstance(v, str) and v in SINFO_FORMATS, REQUIRED)},
    "files": {"dir": (_path, REQUIRED), "skip": (_word, "pulled")},
    "health": {"url": (_url, REQUIRED), "timeout_s": (_seconds, 5)},
    "gpus": {"timeout_s": (_seconds, 60), "facts": (_flag, False)},
    "port": {},
    # a patch set for the agent's own python (patcher.py, which checks every name, path and diff it is given)
    "patch": {"request": (lambda v: isinstance(v, dict) and set(v) <= PATCH_FIELDS, REQUIRED)},
    # the host's lease files (leases.py, which checks every path against the workdir and every key's name)
    "lease": {"action": (lambda v: isinstance(v, str) and v in LEASE_ACTIONS, REQUIRED), "workdir": (_path, REQUIRED),
              "shared": (_flag, False), "lock_wait_s": (_seconds, LOCK_WAIT_S), "run_dir": (_path, ""),
              "token": (_token, ""), "keys": (_list_of(_word, 4096), [])},
}
OPS = tuple(ARGS)
MAX_READ = 16 << 20  # the most log bytes one read answers with


def checked(op, req):
    """The op's arguments from a request, each one checked; raises ValueError naming what is wrong."""
    spec = ARGS[op]
    unknown = sorted(set(req) - set(spec) - {"id", "op"})
    if unknown:
        raise ValueError(f"{op}: unknown argument(s) {', '.join(unknown)}")
    args = {}
    for name, (check, default) in spec.items():
        if name not in req:
            if default is REQUIRED:
                raise ValueError(f"{op}: missing argument {name}")
            args[name] = default
        elif not check(req[name]):
            raise ValueError(f"{op}: bad {name}: {str(req[name])[:80]!r}")
        else:
            args[name] = req[name]
    return args
