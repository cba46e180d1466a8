"""Properties of LogParser over arbitrary bytes: no crash, chunking and persistence change nothing,
and a huge single line of tqdm redraws is read in bounded memory."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_logparse import CRASHES, SGLANG_0_5_23_EAGLE, SPECULATORS_OLD, VLLM_0_11, VLLM_0_33

from orchestrator.logparse import LogParser

LOGS = Path(__file__).parent / "logs"

REAL_LOGS = [
    *(path.read_bytes() for path in sorted(LOGS.glob("*.log"))),
    SGLANG_0_5_23_EAGLE.encode(),
    VLLM_0_11.encode(),
    VLLM_0_33.encode(),
    SPECULATORS_OLD.encode(),
    *(log.encode() for log, *_ in CRASHES.values()),
]

# Pieces that exercise the interesting paths when glued together at random.
FRAGMENTS = [
    b"\r", b"\n", b"\r\n", b"\x1b[1;36m(Worker_TP0 pid=3)\x1b[0;0m ", b"\xe2\x96\x88", b"\xe2\x96", b"\xff",
    b"Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01,  1.00it/s]",
    b"Generating hidden states:  10%|\xe2\x96\x88         | 1/10 [00:01<00:09,  1.00it/s]",
    b"12it [00:01, 9.50it/s]", b"Traceback (most recent call last):", b'  File "x.py", line 1', b"TypeError",
    b"ValueError: boom", b"[rank1]: ", b"Scheduler hit an exception: ", b"Received sigquit from a child process.",
    b"torch.OutOfMemoryError: CUDA out of memory.",
    (b"Decode batch, #running-req: 1, #token: 5, token usage: 0.00, "
     b"accept len: 2.00, accept rate: 0.50, cuda graph: True, gen throughput (token/s): 10.00, #queue-req: 0"),
    b"The server is fired up and ready to roll!", b"Load weight begin. avail mem=1.00 GB", b"Killed",
    b"During handling of the above exception, another exception occurred:", b"Data generation complete!",
    b"INFO 10-01 12:00:00 [x.py:1] ", b"Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 2.0 tokens/s",
    b"(EngineCore_DP0 pid=9) ERROR 10-01 12:00:00 [core.py:1] ", b"(VllmWorker rank=1 pid=5) ", b"**",
    b"ERROR 11-20 12:00:00 engine.py:366] ", b"[2026-01-02 10:00:00] ", b'  File "x.py", line 1, in <module>',
    b"The above exception was the direct cause of the following exception:", b"orch-metric loss=0.5 acc=1e-2",
    b"[02/10/26 11:00:41] ERROR    Data generation failed               generate.py:17",
    b"                             ", b"Killed process 1 (python)", b"Out of memory: ",
    b"============ Serving Benchmark Result ============", b"=" * 50, b"Request throughput (req/s):  4.82",
]

log_bytes = st.one_of(
    st.binary(max_size=400),
    st.lists(st.sampled_from(FRAGMENTS), max_size=60).map(b"".join),
    st.sampled_from(REAL_LOGS),
)


def run_whole(data: bytes) -> LogParser:
    p = LogParser()
    p.feed(data)
    return p


def cut(data: bytes, points: list[float]) -> list[bytes]:
    """`data` cut at the given fractions of its length."""
    edges = sorted({int(x * len(data)) for x in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


fractions = st.lists(st.floats(min_value=0, max_value=1), max_size=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=log_bytes)
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    p = LogParser()
    samples = p.feed(data) + p.finish()
    state = p.to_dict()
    json.dumps(state)
    assert p.phase in ("starting", "loading", "capturing", "ready", "running", "finished", "failed")
    assert all(m.line <= p.lines for m in samples)
    if p.error is not None:
        assert 1 <= p.error.line <= p.lines


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=log_bytes, points=fractions)
def test_chunking_does_not_matter(data: bytes, points: list[float]) -> None:
    whole = LogParser()
    whole_samples = whole.feed(data)
    chunked = LogParser()
    chunked_samples = []
    for piece in cut(data, points):
        chunked_samples += chunked.feed(piece)
    assert same(chunked.progress, whole.progress)
    assert same(chunked_samples, whole_samples)
    assert same(chunked.finish(), whole.finish())
    assert same(chunked.to_dict(), whole.to_dict())


def same(a: object, b: object) -> bool:
    """Equal, a NaN the log printed (kept as one) equal to a NaN: as JSON, samples by their repr."""
    return json.dumps(a, sort_keys=True, default=repr) == json.dumps(b, sort_keys=True, default=repr)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=log_bytes, split=st.floats(min_value=0, max_value=1), points=fractions)
def test_persisted_state_resumes_exactly(data: bytes, split: float, points: list[float]) -> None:
    reference = LogParser()
    reference.feed(data)
    reference.finish()

    at = int(split * len(data))
    first = LogParser()
    for piece in cut(data[:at], points):
        first.feed(piece)
    # what a watcher stores in SQLite, then reads back after a crash
    resumed = LogParser.from_dict(json.loads(json.dumps(first.to_dict())))
    assert same(resumed.to_dict(), first.to_dict())
    assert same(resumed.progress, first.progress)
    resumed.feed(data[at:])
    resumed.finish()
    assert same(resumed.to_dict(), reference.to_dict())


def test_every_real_log_fed_in_small_chunks_matches_whole() -> None:
    for data in REAL_LOGS:
        whole = run_whole(data)
        for size in (1, 2, 7, 64):
            chunked = LogParser()
            for i in range(0, len(data), size):
                chunked.feed(data[i:i + size])
            assert same(chunked.to_dict(), whole.to_dict()), (size, data[:60])


def test_resume_keeps_user_settings() -> None:
    p = LogParser(engine="vllm", ready_pattern=r"listening on \d+")
    p.feed(b"booting\nlisten")
    q = LogParser.from_dict(json.loads(json.dumps(p.to_dict())))
    q.feed(b"ing on 8000\n")
    assert (q.engine, q.phase) == ("vllm", "ready")


def test_resume_mid_traceback() -> None:
    log = CRASHES["scheduler_cuda_oom"][0].encode()
    at = log.index(b"torch.OutOfMemoryError") - 30  # inside the frames
    p = LogParser()
    p.feed(log[:at])
    q = LogParser.from_dict(json.loads(json.dumps(p.to_dict())))
    q.feed(log[at:])
    assert q.error is not None and (q.error.kind, q.error.exception, q.error.fatal) == (
        "cuda_oom", "torch.OutOfMemoryError", True)


def _write_redraws(path: Path, size: int) -> int:
    """tqdm redraws of one bar, '\\r'-separated, no newline at all: ~size bytes on one physical line."""
    written = count = 0
    with path.open("wb") as f:
        while written < size:
            batch = []
            for _ in range(5000):
                n = count % 100_000
                cells = ("\u2588" * (n // 10_000)).ljust(10)
                batch.append(f"\rGenerating hidden states: {n // 1000:3d}%|{cells}| {n}/100000 "
                             f"[1:{n // 60 % 60:02d}:{n % 60:02d}<2:00:00,  1.21it/s, samples={n}]")
                count += 1
            chunk = "".join(batch).encode()
            f.write(chunk)
            written += len(chunk)
    return count


# What inspect_file reads of the log named by argv[1], and the peak of what it allocated meanwhile.
MEASURED = """
import json, sys, tracemalloc
from orchestrator.logparse import inspect_file
tracemalloc.start()
got = inspect_file(sys.argv[1])
print(json.dumps([got, tracemalloc.get_traced_memory()[1]], default=str))
"""


def test_huge_single_line_of_redraws_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "huge.log"
    count = _write_redraws(path, 100 * 1024 * 1024)
    assert path.stat().st_size >= 100 * 1024 * 1024
    assert b"\n" not in path.read_bytes()[:1 << 20]
    # read in a process of its own: tracemalloc counts what every thread allocates, and in a worker that ran
    # other tests first a thread of theirs may still be at work (3.4 MiB alone, 22 MiB seen in the suite)
    res = subprocess.run([sys.executable, "-c", MEASURED, str(path)], capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stderr
    got, peak = json.loads(res.stdout.strip().splitlines()[-1])  # how fast: bench/inspect_log.py
    assert peak < 20 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"
    last = (count - 1) % 100_000
    assert got["phase"] == "running"
    assert got["progress"]["done"] == last
    assert got["progress"]["total"] == 100_000
    assert got["progress"]["label"] == "Generating hidden states"


def test_huge_line_without_breaks_is_capped(tmp_path: Path) -> None:
    """A line that never ends keeps only its head; what follows it is still read."""
    p = LogParser()
    for _ in range(200):
        p.feed(b"x" * 65536)
    assert len(json.dumps(p.to_dict())) < 200_000
    p.feed(b"\nThe server is fired up and ready to roll!\n")
    assert p.lines == 2 and p.phase == "ready"


def _redraws(n: int, shapes: int = 1) -> bytes:
    """n '\\r'-ended redraws of one bar; with shapes > 1 the count's width changes along the way."""
    out = []
    for i in range(n):
        done = i if shapes == 1 else (i * 10 ** (i % shapes))
        out.append(f"Generating hidden states:  10%|\u2588         | {done}/1000000 [00:{i % 60:02d}<01:00,  "
                   f"2.00it/s]\r")
    return "".join(out).encode()


SKIP_CASES = [
    b"Generating hidden states:  10%|\xe2\x96\x88         | 1/1000000 [00:00<01:00,  2.00it/s]\n" + _redraws(300)
    + b"done\n",
    b"Generating hidden states:  10%|\xe2\x96\x88         | 1/1000000 [00:00<01:00,  2.00it/s]\n" + _redraws(300, 3)
    + b"\n",
    # a line that is no redraw inside the run, and a run ended by '\r\n'
    b"Generating hidden states:  10%|\xe2\x96\x88         | 1/1000000 [00:00<01:00,  2.00it/s]\n" + _redraws(50)
    + b"Generating hidden states: Killed\r" + _redraws(50) + b"\r\nTraceback (most recent call last):\n",
    # a label with digits: the run is checked line by line
    b"Capturing batches (bs=16 avail_mem=20.50 GB):  10%|\xe2\x96\x88         | 1/10 [00:00<00:09,  1.00it/s]\n"
    + b"".join(b"Capturing batches (bs=16 avail_mem=20.50 GB):  %d0%%|\xe2\x96\x88         | %d/10 "
               b"[00:0%d<00:09,  1.00it/s]\r" % (i, i, i) for i in range(1, 10)) + b"\n",
]


def _without_fast_path() -> LogParser:
    p = LogParser()
    p._skip_redraws = lambda data, start, end: start  # type: ignore[method-assign]
    return p


@given(case=st.sampled_from(SKIP_CASES), points=fractions)
@settings(max_examples=100, deadline=None)
def test_redraw_runs_taken_whole_read_as_one_by_one(case: bytes, points: list[float]) -> None:
    fast, slow = LogParser(), _without_fast_path()
    for piece in cut(case, points):
        fast.feed(piece)
        slow.feed(piece)
    fast.finish()
    slow.finish()
    assert same(fast.to_dict(), slow.to_dict())


@pytest.mark.parametrize("ready, taken_whole", [(r"Uvicorn running on", True), (r" 150/1000000 ", False)])
def test_a_ready_pattern_leaves_redraw_runs_taken_whole_unless_one_of_them_is_the_ready_line(
        ready: str, taken_whole: bool) -> None:
    """A server's parser (it has a ready pattern) takes a run of redraws at once as well; a run in which a
    redraw matches the pattern is read one by one, so that the ready line is seen where it is."""
    case = SKIP_CASES[0]
    fast, slow = LogParser(ready_pattern=ready), LogParser(ready_pattern=ready)
    slow._skip_redraws = lambda data, start, end: start  # type: ignore[method-assign]
    one_by_one: list[bytes] = []
    line = fast._line
    fast._line = lambda raw, by_cr, found: (one_by_one.append(raw), line(raw, by_cr, found))[1]  # type: ignore[method-assign]
    for p in (fast, slow):
        p.feed(case)
        p.finish()
    assert same(fast.to_dict(), slow.to_dict())
    assert ("ready" in fast.phases_passed) is not taken_whole
    assert (len(one_by_one) < 10) is taken_whole
