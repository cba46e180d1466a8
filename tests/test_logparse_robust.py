"""The transcripts under tests/logs read the same after what happens to a real log on its way to a user.

Each transcript's expected reading (tests/logs/labels.json) must survive every transformation below,
unchanged or degraded only in the way the transformation's entry in TRANSFORMS documents:

  - a prefix on every line, of any shape a launcher or collector writes: torchrun's '[rank3]: ', vLLM's
    '(VllmWorker rank=2 pid=1234) ' / '(EngineCore_DP0 pid=99) ' (also before each tqdm redraw, in colour),
    docker compose's 'svc-1  | ', kubectl's / docker's RFC 3339 time, an SGLang-style '[time TP0] ', Slurm's
    'srun --label' task number '0: ' / '12: ', journald's 'Jan 01 10:00:00 host unit[pid]: ', and
    several of them nested. A prefix that only one engine writes may name that engine for a log whose own
    lines name none (generic, transformers, slurm); nothing else changes.
  - ANSI colour codes around levels and words; CRLF line ends.
  - unknown INFO noise between lines (other loggers, other ranks' chatter): nothing changes.
  - lines of several ranks interleaved: the same log written by two ranks, each line tagged with its rank
    and the two merged in any order: nothing changes.
  - the log cut at the end, mid-line: each part of the reading, each metric too, is the whole log's or the
    log's up to the line or redraw the cut falls in; or it is the same failure named less specifically
    (python_exception or other; the class or none), the line that named it cut before the words that say more.
  - the log cut mid-traceback: a failure (unless the run had finished before it) of kind python_exception,
    import_error or timeout (a frame's `raise` names the class) or of the kind that stood before it.
  - a traceback whose exception line never arrived: engine, phase, failed and progress as labelled; a
    failure's kind as labelled or python_exception (import_error, timeout); a survivable traceback stays
    survived when healthy work follows it.
  - a TUI pane that clips every line at 80 or 120 columns: what the clipped words said is lost, and nothing
    is misread. The engine is the labelled one or not known (generic); a run that did not fail is not read
    as failed, and its phase is the labelled one or an earlier one (loading and capturing count as one); a
    failed run still fails while a traceback's header shows; its kind may fall back to python_exception or
    other or to what the lines the clip left whole say, its class may be lost or be a later consequence's.
    A metric is either not read, or read with a value the whole log printed (or its first digits, where
    the clip cut a number at the line's end); the progress is an earlier redraw's or none where the clip
    cut a bar before its counts.

Besides the cases one by one, a property test stacks several of the transformations that change nothing.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.logparse import LogParser
from orchestrator.logparse.text import clean

LOGS = Path(__file__).parent / "logs"
LABELS: list[dict[str, Any]] = json.loads((LOGS / "labels.json").read_text())
TEXTS = {x["file"]: (LOGS / x["file"]).read_bytes().decode("utf-8") for x in LABELS}


# ---- reading ------------------------------------------------------------------------------------------

def read(data: str) -> dict[str, Any]:
    p = LogParser()
    samples = p.feed(data.encode())
    samples += p.finish()
    err = p.error
    progress = p.progress
    return {
        "engine": p.engine,
        "phase": p.phase,
        "failed": p.phase == "failed",
        "error_kind": err.kind if err else "none",
        "exception": err.exception if err else None,
        "metrics": dict(p.metrics),
        "progress": (progress.done, progress.total) if progress else None,
        "seen": {(m.name, m.value) for m in samples},
        "chain": [c.split(":", 1)[0] for c in err.chain] if err else [],
        "stopping": p.stopping,
    }


def labelled(label: dict[str, Any], key: str) -> list[Any]:
    allowed = [label[key], *label["also"].get(key, [])]
    if key == "progress":
        return [(p["done"], p["total"]) if p else None for p in allowed]
    return allowed


def wrong(label: dict[str, Any], got: dict[str, Any], keys: tuple[str, ...] = (
        "engine", "phase", "failed", "error_kind", "exception", "progress")) -> list[str]:
    out = [f"{k}: {got[k]!r}, expected {label[k]!r}" for k in keys if got[k] not in labelled(label, k)]
    for name, value in label["metrics"].items():
        if got["metrics"].get(name) != pytest.approx(value):
            out.append(f"metric {name}: {got['metrics'].get(name)!r}, expected {value!r}")
    return out


# ---- transformations of the text ----------------------------------------------------------------------

def lines_of(text: str) -> list[str]:
    """Physical lines with their '\\n'; a tqdm line's '\\r' redraws stay inside it."""
    return text.splitlines(keepends=True) if "\r\n" not in text else re.findall(r"[^\n]*\n|[^\n]+$", text)


def per_line(prefix: Callable[[int], str]) -> Callable[[str, random.Random], str]:
    def apply(text: str, rng: random.Random) -> str:
        return "".join(prefix(i) + line for i, line in enumerate(lines_of(text)))
    return apply


def per_write(prefix: str) -> Callable[[str, random.Random], str]:
    """vLLM 0.11's worker prefix, written before every write: before each tqdm redraw too."""
    def apply(text: str, rng: random.Random) -> str:
        return re.sub(r"(^|\n|\r(?!\n))(?=[^\n])", lambda m: m.group(1) + prefix, text)
    return apply


def stamp(i: int) -> str:
    return f"2025-01-01T10:{i // 60 % 60:02d}:{i % 60:02d}.{i * 37 % 1000:03d}Z "


NOISE = [
    "INFO 2025-01-01 10:00:00,120 urllib3.connectionpool: Starting new HTTPS connection (1): example.org:443",
    "DEBUG:filelock:Attempting to acquire lock 140 on /root/.cache/lock",
    "INFO:     Waiting for background tasks to finish.",
    "[2025-01-01 10:00:01] INFO telemetry.py:40: heartbeat sent",
    "I0101 10:00:02.123456 140 some_module.cc:88] opened channel",
    "W0101 10:00:03.000001 140 gc.cc:12] deprecated option ignored",
    "2025-01-01 10:00:04,500 - monitor - INFO - gpu temps nominal",
    "INFO: [sidecar] checkpoint directory is writable",
    "  warnings.warn(",
    "",
]


def noise(text: str, rng: random.Random) -> str:
    out = []
    for line in lines_of(text):
        out.append(line)
        if rng.random() < 0.3:
            out.append(rng.choice(NOISE) + "\n")
    return "".join(out)


def ranks(text: str, rng: random.Random) -> str:
    """Two ranks write the same log; their lines reach the file interleaved."""
    lines = [ln if ln.endswith("\n") else ln + "\n" for ln in lines_of(text)]
    a = [f"[rank0]: {ln}" for ln in lines]
    b = [f"[rank1]: {ln}" for ln in lines]
    out: list[str] = []
    while a or b:
        src = a if (a and (not b or rng.random() < 0.5)) else b
        out.append(src.pop(0))
    return "".join(out)


def colour(text: str, rng: random.Random) -> str:
    levels = r"\b(INFO|WARNING|ERROR|DEBUG|CRITICAL)\b"
    text = re.sub(levels, lambda m: f"\x1b[32m{m.group(1)}\x1b[0m", text)
    return "".join(("\x1b[2m" + ln.rstrip("\n") + "\x1b[0m" + ("\n" if ln.endswith("\n") else ""))
                   if rng.random() < 0.3 else ln for ln in lines_of(text))


def crlf(text: str, rng: random.Random) -> str:
    return text.replace("\r\n", "\n").replace("\n", "\r\n")


# Prefixes that only one engine writes name it; otherwise the engine stays.
_NAMING = {"vllm_worker": "vllm", "vllm_enginecore": "vllm", "vllm_write": "vllm", "sglang_tp": "sglang"}

PREFIXES: dict[str, Callable[[str, random.Random], str]] = {
    "rank": per_line(lambda i: "[rank3]: "),
    "vllm_worker": per_line(lambda i: "(VllmWorker rank=2 pid=1234) "),
    "vllm_enginecore": per_line(lambda i: "(EngineCore_DP0 pid=99) "),
    "vllm_write": per_write("\x1b[1;36m(Worker_TP1 pid=4321)\x1b[0;0m "),
    "compose": per_line(lambda i: "svc-1  | "),
    "kubectl": per_line(stamp),
    "sglang_tp": per_line(lambda i: f"[2025-06-01 12:{i // 60 % 60:02d}:{i % 60:02d} TP0] "),
    "srun_label": per_line(lambda i: "0: "),
    "srun_label_wide": per_line(lambda i: " 3: "),
    "journald": per_line(lambda i: f"Jan 01 10:{i // 60 % 60:02d}:{i % 60:02d} gpu-node-07 python3[4242]: "),
    "nested": per_line(lambda i: stamp(i) + "12: [rank12]: "),
}

def ranks_noise(text: str, rng: random.Random) -> str:
    """Rank 0 writes the log; ranks 1-3 write their own chatter between its lines."""
    out = []
    for line in lines_of(text):
        out.append("[rank0]: " + line)
        if rng.random() < 0.3:
            out.append(f"[rank{rng.randint(1, 3)}]: {rng.choice(NOISE)}\n")
    return "".join(out)


# ---- what may change, by transformation ---------------------------------------------------------------

_TRACEBACK_KINDS = ("python_exception", "import_error", "timeout")


def same(label: dict[str, Any], got: dict[str, Any], name: str) -> list[str]:
    prefix_engine = _NAMING.get(name.removeprefix("prefix_"))
    if label["engine"] in ("generic", "transformers", "slurm") and got["engine"] == prefix_engine:
        got["engine"] = label["engine"]  # the prefix named the engine of a log that named none
    return wrong(label, got)


# name -> (transformation, how the reading may change)
TRANSFORMS: dict[str, Callable[[str, random.Random], str]] = {
    **{f"prefix_{k}": f for k, f in PREFIXES.items()},
    "colour": colour,
    "crlf": crlf,
    "noise": noise,
    "ranks": ranks,
    "ranks_noise": ranks_noise,
}


def check(name: str, label: dict[str, Any], text: str, seed: int) -> list[str]:
    got = read(TRANSFORMS[name](text, random.Random(seed)))
    return same(label, got, name)


# ---- cuts and clips: compared with readings of the untouched text ---------------------------------------

def cut_last_line(text: str, rng: random.Random) -> tuple[str, str] | None:
    """(the text cut inside its last line, the text up to the line or redraw the cut falls in)."""
    body = text.rstrip("\n")
    start = body.rfind("\n") + 1
    if len(body[start:].strip()) < 2:
        return None
    at = start + rng.randint(1, len(body) - start - 1)
    return body[:at], body[:max(body.rfind("\n", 0, at), body.rfind("\r", 0, at)) + 1]


def exception_name_cut(got: dict[str, Any], full: dict[str, Any]) -> bool:
    """The same failure, the line that named it cut before the words that say more: named by its class
    alone, or as a failure of no more specific kind."""
    return (got["failed"] == full["failed"] and got["exception"] in (full["exception"], None)
            and got["error_kind"] in (full["error_kind"], *_TRACEBACK_KINDS, "other"))


KEYS = ("engine", "phase", "failed", "error_kind", "exception", "progress", "metrics")


def as_label(r: dict[str, Any]) -> dict[str, Any]:
    return {**{k: r[k] for k in KEYS}, "also": {}, "progress": (
        {"done": r["progress"][0], "total": r["progress"][1]} if r["progress"] else None)}


def check_cut_mid_line(label: dict[str, Any], text: str, seed: int) -> list[str] | None:
    cut = cut_last_line(text, random.Random(seed))
    if cut is None:
        return None
    got, full, before = read(cut[0]), read(text), read(cut[1])
    if exception_name_cut(got, full):
        return []
    out = [f"{k}: {got[k]!r}, expected {full[k]!r} or {before[k]!r}" for k in KEYS[:-1]
           if got[k] not in (full[k], before[k])]
    for name in full["metrics"].keys() | before["metrics"].keys() | got["metrics"].keys():
        value = got["metrics"].get(name)
        if value not in (full["metrics"].get(name), before["metrics"].get(name)):
            out.append(f"metric {name}: {value!r}, expected {full['metrics'].get(name)!r}"
                       f" or {before['metrics'].get(name)!r}")
    return out


_HEADER = "Traceback (most recent call last):"
_FRAME = re.compile(r'^(?:\s|File "|\[Previous line|\.\.\.|[~^]+\s*$|$)')
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?::|$)")


def tracebacks(text: str) -> list[tuple[int, int | None]]:
    """(header line, exception line or None) of each traceback not logged at DEBUG or WARNING, by index in
    lines_of(text). Lines are told apart by what wrote them, as interleaved ranks write them."""
    lines = [clean(ln.rstrip("\r\n")) for ln in lines_of(text)]
    found: list[tuple[int, int | None]] = []
    open_: dict[str, int] = {}
    for i, ln in enumerate(lines):
        if _HEADER in ln.text:
            if ln.level not in ("DEBUG", "WARNING"):
                open_[ln.source] = len(found)
                found.append((i, None))
            continue
        at = open_.get(ln.source)
        if at is None or _FRAME.match(ln.text) or (i > 0 and 'File "' in lines[i - 1].text):
            continue
        del open_[ln.source]
        if _EXCEPTION.match(ln.text):
            found[at] = (found[at][0], i)
    return found


def check_cut_mid_traceback(label: dict[str, Any], text: str, seed: int) -> list[str] | None:
    """The log ends inside a traceback: a python_exception failure, unless an error before it stands or a stop
    was asked for before it (the server failed as it shut down)."""
    rng = random.Random(seed)
    found = [t for t in tracebacks(text) if t[1] is not None and t[1] - t[0] >= 2]
    if not found:
        return None
    header, exc = rng.choice(found)
    assert exc is not None
    lines = lines_of(text)
    stop = rng.randint(header + 1, exc - 1)
    cut = "".join(lines[:stop]) + lines[stop][:rng.randint(0, len(lines[stop]))]
    got, before = read(cut), read("".join(lines[:header]))
    out = []
    if not got["failed"] and before["phase"] != "finished" and not before["stopping"]:
        out.append("not failed")
    if got["error_kind"] not in (*_TRACEBACK_KINDS, before["error_kind"]):
        out.append(f"error_kind {got['error_kind']!r}")
    if got["engine"] not in (before["engine"], *labelled(label, "engine")):
        out.append(f"engine {got['engine']!r}")
    return out


def check_exception_line_missing(label: dict[str, Any], text: str, seed: int) -> list[str] | None:
    """The last traceback's exception line never arrived: the same failure, or a python_exception one; a
    survivable traceback is still survived."""
    found = [t[1] for t in tracebacks(text) if t[1] is not None]
    if not found:
        return None
    lines = lines_of(text)
    del lines[found[-1]]
    got = read("".join(lines))
    kinds = {label["error_kind"], *label["also"].get("error_kind", [])}
    if label["failed"]:
        kinds |= set(_TRACEBACK_KINDS)
    return wrong({**label, "metrics": {}, "also": {**label["also"], "error_kind": sorted(kinds)}}, got,
                 ("engine", "phase", "failed", "error_kind", "progress"))


def clip(width: int) -> Callable[[str], str]:
    """What a TUI pane of `width` columns shows: every line, and every redraw of a bar, clipped."""
    def apply(text: str) -> str:
        return re.sub(r"[^\r\n]+", lambda m: m.group()[:width], text)
    return apply


# Phases in the order a run goes through them; an engine goes back and forth between loading and capturing.
_ORDER = {"starting": 0, "loading": 1, "capturing": 1, "ready": 2, "running": 3, "finished": 4}


def check_clipped(width: int, label: dict[str, Any], text: str) -> list[str] | None:
    """What the clipped words said is lost; nothing is misread."""
    clipped = clip(width)(text)
    if clipped == text:
        return None
    got, full = read(clipped), read(text)
    out = []
    if got["engine"] not in (*labelled(label, "engine"), "generic"):
        out.append(f"engine: {got['engine']!r}, expected {label['engine']!r}")
    if label["failed"]:
        if not got["failed"] and any(t[0] is not None for t in tracebacks(clipped)):
            out.append("not failed, with a traceback in sight")
    elif got["failed"] or _ORDER[got["phase"]] > max(_ORDER[p] for p in labelled(label, "phase")):
        out.append(f"phase: {got['phase']!r}, expected {label['phase']!r} or one before it")
    # What the lines the clip left whole say alone is a right reading too.
    whole = read("".join(ln for ln in lines_of(text) if len(ln.rstrip("\r\n")) <= width))
    if got["failed"]:
        if got["error_kind"] not in (*labelled(label, "error_kind"), "python_exception", "other",
                                     whole["error_kind"]):
            out.append(f"error_kind: {got['error_kind']!r}, expected {label['error_kind']!r}")
        # The root cause's line clipped before its class: a consequence's class, seen later, or none.
        if got["exception"] not in (*labelled(label, "exception"), None, *full["chain"]):
            out.append(f"exception: {got['exception']!r}, expected {label['exception']!r}")
    # A bar clipped before its counts: an earlier redraw's, or none.
    if got["progress"] is not None and not any(
            p is not None and got["progress"][1] == p[1] and got["progress"][0] <= p[0]
            for p in labelled(label, "progress")):
        out.append(f"progress: {got['progress']!r}, expected {label['progress']!r}")
    for name, value in got["metrics"].items():
        if not printed(name, value, full["seen"]) and not read_short(name, value, full["seen"]):
            out.append(f"metric {name}={value!r} never printed")
    return out


def printed(name: str, value: float, seen: set[tuple[str, float]]) -> bool:
    """The metric was read so from the whole log (a NaN, which equals nothing, as a NaN)."""
    return (name, value) in seen or (math.isnan(value) and any(n == name and math.isnan(v) for n, v in seen))


def read_short(name: str, value: float, seen: set[tuple[str, float]]) -> bool:
    """A number the clip cut at the line's end, read with the digits that show: what no reader can tell
    from a number printed so."""
    shown = f"{value:g}".rstrip("0").rstrip(".")
    return any(n == name and f"{v:g}".startswith(shown) and len(f"{v:g}") > len(shown) for n, v in seen)


CHECKS: dict[str, Callable[[dict[str, Any], str, int], list[str] | None]] = {
    "cut_mid_line": check_cut_mid_line,
    "cut_mid_traceback": check_cut_mid_traceback,
    "exception_line_missing": check_exception_line_missing,
    "clip_80": lambda label, text, seed: check_clipped(80, label, text),
    "clip_120": lambda label, text, seed: check_clipped(120, label, text),
}
def failures(label: dict[str, Any]) -> dict[str, list[str]]:
    """Each transformation the transcript does not survive as documented, with how its reading differs
    (a check that does not apply to it, a cut with no traceback to cut in, is left out)."""
    text, seed = TEXTS[label["file"]], len(label["file"])
    found = {name: check(name, label, text, seed) for name in TRANSFORMS}
    found.update({name: CHECKS[name](label, text, seed) for name in CHECKS})
    return {name: wrong for name, wrong in found.items() if wrong}


@pytest.mark.parametrize("label", LABELS, ids=[x["file"] for x in LABELS])
def test_transcript_reads_the_same_however_it_reached_the_user(label: dict[str, Any]) -> None:
    assert failures(label) == {}


# ---- prefixes by shape ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "text", "level", "source"), [
    ("[rank3]: Traceback (most recent call last):", "Traceback (most recent call last):", None, "/rank3"),
    ("[default1]:  File \"x.py\", line 1, in f", " File \"x.py\", line 1, in f", None, "/default1"),
    ("[1,0]<stderr>:ValueError: bad", "ValueError: bad", None, "/1,0"),
    ("[12]:RuntimeError: x", "RuntimeError: x", None, "/12"),
    ("12: step 3 | loss 2.0", "step 3 | loss 2.0", None, "/task12"),
    (" 3:   File \"x.py\", line 1, in f", "  File \"x.py\", line 1, in f", None, "/task3"),
    ("web_1    | INFO:     Uvicorn running on http://0.0.0.0:8000", "INFO:     Uvicorn running on http://0.0.0.0:8000",
     "INFO", ""),
    ("2025-01-01T10:00:00.123456789Z   File \"x.py\", line 1, in f", "  File \"x.py\", line 1, in f", None, ""),
    ("2025-01-01 10:00:00,123 WARNING low disk", "low disk", "WARNING", ""),
    ("2025-01-01 10:00:00.123 | ERROR    | app.main:run:40 - boom", "app.main:run:40 - boom", "ERROR", ""),
    ("[2026-01-14 18:02:11,402] [INFO] [logging.py:128:log_dist] [Rank 0] step=10, lr=[1e-05]",
     "step=10, lr=[1e-05]", "INFO", ""),
    ("[pod/trainer-0/main] RuntimeError: x", "RuntimeError: x", None, ""),
    ("(RayWorkerWrapper pid=77, ip=10.0.0.2) ERROR 01-01 10:00:00 [w.py:1] Error executing method",
     "Error executing method", "ERROR", "RayWorkerWrapper"),
    ("Jan 01 10:00:00 node7 python3[4242]: [rank0]: oom", "oom", None, "/rank0"),
    # what is no prefix stays: a message in brackets, a dict of numbers, a table row
    ("[after training is done]", "[after training is done]", None, ""),
    ("[1, 2, 3] is the order", "[1, 2, 3] is the order", None, ""),
    ("0 | model | GPT        | 124 M", "0 | model | GPT        | 124 M", None, ""),
])
def test_prefixes_are_peeled_by_shape(raw: str, text: str, level: str | None, source: str) -> None:
    line = clean(raw)
    assert (line.text, line.level, line.source) == (text, level, source)


# ---- several at once ----------------------------------------------------------------------------------

# Transformations that leave the reading as it is, in an order a real path applies them: the program's
# own ranks, then a launcher's prefix, then a collector's, then the terminal.
_STACKABLE = ("ranks", "ranks_noise", "noise")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(label=st.sampled_from(LABELS), inner=st.sampled_from([None, *_STACKABLE]),
       prefixes=st.lists(st.sampled_from(sorted(PREFIXES)), max_size=2), terminal=st.sets(st.sampled_from(
           ["colour", "crlf"])), seed=st.integers(0, 2**16))
def test_stacked_transformations_read_as_labelled(label: dict[str, Any], inner: str | None, prefixes: list[str],
                                                  terminal: set[str], seed: int) -> None:
    rng = random.Random(seed)
    text = TEXTS[label["file"]]
    names = [*([inner] if inner else []), *(f"prefix_{p}" for p in prefixes), *sorted(terminal)]
    for name in names:
        text = TRANSFORMS[name](text, rng)
    got = read(text)
    named = {_NAMING[p] for p in prefixes if p in _NAMING}
    if label["engine"] in ("generic", "transformers", "slurm") and got["engine"] in named:
        got["engine"] = label["engine"]
    assert wrong(label, got) == [], names


if __name__ == "__main__":  # a tally, by transformation
    import collections
    tally: collections.Counter[str] = collections.Counter()
    cases = 0
    for x in LABELS:
        text, seed = TEXTS[x["file"]], len(x["file"])
        results = {n: check(n, x, text, seed) for n in TRANSFORMS} | {n: CHECKS[n](x, text, seed) for n in CHECKS}
        for name, wrong_ in results.items():
            cases += wrong_ is not None
            if wrong_:
                tally[name] += 1
                print(name, x["file"], wrong_)
    print(f"{sum(tally.values())} of {cases} cases fail", dict(tally))
