"""How fast does a watcher hear that a server is ready, crashed, or hit a fatal line and hung — in real
seconds, over real SSH — and how many round trips does watching cost over a long quiet serve?

An emulated SGLang 0.5.23 server (tests/fakes/sglang_emulator.py) on a real sshd on loopback
(tests/sshd.py) loads 64 shards, turns ready, serves, then (a) crashes and exits, (b) prints a fatal
scheduler line and hangs (the other ranks of a TP job), or (c) keeps serving, quiet. Every watcher reads
the same job at the same time, each with a database of its own:
  agent      orch's watcher of the host, the only way orch watches a run: the host's agent pushes the log's
             new bytes and the job's end as they happen; quiet runs looked at (poked) on the backoff 5 s -> 60 s
  fixed5     the same reading (the recorder's one-shot look), a fixed 5 s poll from the controller (a shell loop)
  sleep600   the `sleep 600; tail -40 log` habit, scaled down 100x (its lag is reported unscaled)
  tail-F     `tail -F log` streamed over one SSH channel, parsed as it comes: the physical limit
Lag: from the emulator printing the line (its --events file) to the watcher recording it. Round trips:
requests to the host (pokes, for the agent) while watching the quiet serve. Writes its section of bench/RESULTS.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from results import write_section
from sshd import SSHFleet

from orchestrator.config.hosts import Host
from orchestrator.config.workspace import Workspace
from orchestrator.host import launch
from orchestrator.host.agent import AgentLink
from orchestrator.host.launch import HostExecutor
from orchestrator.host.remote import Result, SSHTransport, quote
from orchestrator.logparse import LogParser
from orchestrator.runflow.recorder import Recorder, WatchOptions
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.watch.hostwatch import HostWatcher

EMULATOR = ROOT / "tests" / "fakes" / "sglang_emulator.py"
REPEATS = 5
SCALE = 100  # sleep600 polls every 600 / SCALE real seconds; its lag is multiplied back
QUIET_S = 180.0  # the quiet serve over which round trips are counted
LOAD_BEFORE = os.getloadavg()[0]  # the machine's load as the bench starts (1 min)
# (emulator flags, the event it marks, what the watcher records: the run's end, the fatal error, ready)
SCENARIOS = {
    "crash and exit": (["--serve-after", "4", "--crash-after-ready", "0"], "crash", "end"),
    "fatal line, ranks hang": (["--serve-after", "4", "--crash-after-ready", "0", "--linger"], "crash", "fatal"),
    "ready, keeps serving": (["--serve-after", "5"], "ready", "ready"),
}
# The event each watcher writes when it knows: the run ended (failed or lost), the fatal error read, ready.
RECORDED = {"end": (("status",), ("failed", "lost")), "fatal": (("error",), ("",)), "ready": (("phase",), ("ready",))}


class CountingTransport(SSHTransport):
    def __init__(self, host: Host):
        super().__init__(host)
        self.calls = 0

    def run(self, command: str, *, check: bool = True, timeout: float | None = None,
            idle_timeout: float | None = None) -> Result:
        self.calls += 1
        return super().run(command, check=check, timeout=timeout, idle_timeout=idle_timeout)


class CountingExecutor(HostExecutor):
    """Counts the requests to the host's agent: every poll is one (shell commands: CountingTransport)."""

    calls = 0

    def call(self, op: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
        self.calls += 1
        return super().call(op, timeout=timeout, **args)


POKES = [0]  # the host watcher's looks at a quiet run: one request each


def _counting_tell(link: AgentLink, op: str, **args: Any) -> None:
    if op == "poke":
        POKES[0] += 1
    _tell(link, op, **args)


_tell = AgentLink.tell
AgentLink.tell = _counting_tell  # type: ignore[method-assign]


def record_for(tmp: Path, name: str, paths: launch.RunPaths, pid: int, start: str) -> tuple[Store, int]:
    """A database of this watcher's own, holding the one running job."""
    store = Store(tmp / f"{name}.db")
    run_id = store.create_run("command", "test1", {})
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    store.update_run(run_id, remote_dir=paths.root)
    transition(store, run_id, Status.RUNNING, pid=pid, pid_start=start)
    return store, run_id


def polled(host: Host, tmp: Path, name: str, paths: launch.RunPaths, pid: int, start: str, until: str,
           out: dict[str, Any]) -> None:
    """Look with the recorder's one-shot read at a fixed pace, sleeping here between looks, until the event;
    when it was recorded, the calls."""
    transport = CountingTransport(host)
    store, run_id = record_for(tmp, name, paths, pid, start)
    every, scale = {"fixed5": (5.0, 1), "sleep600": (600 / SCALE, SCALE)}[name]
    opts = WatchOptions(poll_min=every, poll_max=every, until_ready=until == "ready", engine="sglang",
                        kill_grace_s=0.5)
    executor = CountingExecutor(transport)
    rec = Recorder(store, run_id, executor, opts)
    if until == "quiet":  # count round trips only, to the deadline
        deadline = time.time() + QUIET_S
        while time.time() < deadline:
            rec.look()
            time.sleep(min(every, max(0.0, deadline - time.time())))
        out[name] = {"calls": transport.calls + executor.calls}
    else:
        while not rec.look():
            time.sleep(every)
        kinds, messages = RECORDED[until]
        seen = next(e["ts"] for e in store.events(run_id) if e["kind"] in kinds and e["message"].startswith(messages))
        out[name] = {"seen": seen, "scale": scale, "calls": transport.calls + executor.calls}
    transport.close()
    store.close()


def pushed(host: Host, fleet: SSHFleet, tmp: Path, paths: launch.RunPaths, pid: int, start: str, until: str,
           out: dict[str, Any]) -> None:
    """Watch with orch's watcher of the host, in a workspace of its own, until the event is recorded."""
    ws = Workspace(root=tmp / "agent", hosts_file=tmp / "agent" / "hosts.toml")
    ws.runs_dir.mkdir(parents=True)
    ws.hosts_file.write_text(fleet.hosts_toml())
    store = Store(ws.db_path)
    run_id = store.create_run("command", "test1", {"cmd": "true", "engine": "sglang", "poll_min": 5, "poll_max": 60})
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    store.update_run(run_id, remote_dir=paths.root)
    transition(store, run_id, Status.RUNNING, pid=pid, pid_start=start)
    watcher = HostWatcher(ws, "test1")
    thread = threading.Thread(target=watcher.serve)
    thread.start()
    kinds, messages = RECORDED["ready" if until == "quiet" else until]
    seen = None
    deadline = time.time() + (QUIET_S if until == "quiet" else 600)
    while seen is None and time.time() < deadline:
        time.sleep(0.02)
        seen = next((e["ts"] for e in store.events(run_id) if e["kind"] in kinds
                     and e["message"].startswith(messages)), None)
    pokes = POKES[0]
    if until == "quiet":
        time.sleep(max(0.0, deadline - time.time()))
    pokes = POKES[0] - pokes  # (counted from ready: the quiet stretch)
    watcher.stopping.set()
    thread.join()
    out["agent"] = {"seen": seen, "scale": 1, "calls": pokes}  # on one channel, kept open
    store.close()


def streamed(host: Host, paths: launch.RunPaths, until: str, out: dict[str, Any], stop: threading.Event) -> None:
    """`tail -F` over one SSH channel, each chunk parsed as it arrives."""
    transport = SSHTransport(host)
    conn = transport._connection()
    channel = conn.client.get_transport().open_session()
    channel.exec_command(f"tail -c +1 -F {quote(paths.log)} 2>/dev/null")
    channel.settimeout(0.2)
    parser = LogParser(engine="sglang")
    while not stop.is_set():
        try:
            data = channel.recv(65536)
        except TimeoutError:
            continue
        if not data:
            break
        parser.feed(data)
        if (until == "ready" and parser.phase in ("ready", "running")) or (
                until != "ready" and parser.error is not None and parser.error.fatal):
            out["tail-F"] = {"seen": time.time(), "scale": 1, "calls": 1}
            break
    channel.close()
    transport.close()


def one(host: Host, fleet: SSHFleet, tmp: Path, flags: list[str], event: str, until: str = "end",
        quiet: bool = False) -> tuple[dict[str, Any], float]:
    events = tmp / "events"
    transport = SSHTransport(host)
    paths = launch.RunPaths.for_run(host.workdir, int(time.time() * 1000) % 10**9)
    cmd = " ".join(quote(a) for a in [sys.executable, str(EMULATOR), "--shards", "64", "--shard-time", "0.05",
                                      "--capture-time", "0.5", "--events", str(events), *flags])
    if quiet:
        cmd += " --serve-after " + str(QUIET_S + 30)
    job = HostExecutor(transport).launch(paths, launch.job_script(cmd, {}), f"bench-{paths.root}")
    pid, start = job.id, job.proof
    out: dict[str, Any] = {}
    stop = threading.Event()
    until = "quiet" if quiet else until
    names = ["fixed5"] if quiet else ["fixed5", "sleep600"]
    threads = [threading.Thread(target=polled, args=(host, tmp, n, paths, pid, start, until, out)) for n in names]
    threads.append(threading.Thread(target=pushed, args=(host, fleet, tmp, paths, pid, start, until, out)))
    if not quiet:
        threads.append(threading.Thread(target=streamed, args=(host, paths, until, out, stop)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=QUIET_S + 900)
    stop.set()
    HostExecutor(transport).kill(job, 0.5)
    transport.close()
    printed = next(float(line.split()[0]) for line in events.read_text().splitlines() if line.endswith(event))
    return out, printed


def main() -> None:
    global REPEATS, QUIET_S
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--quiet-s", type=float, default=QUIET_S)
    args = ap.parse_args()
    REPEATS, QUIET_S = args.repeats, args.quiet_s
    with tempfile.TemporaryDirectory() as tmp, SSHFleet(1, root=Path(tmp) / "sshd") as fleet:
        host = Host(name="test1", **fleet.host_entry(1))
        rows: list[tuple[str, str, float, float]] = []
        for scenario, (flags, event, until) in SCENARIOS.items():
            lags: dict[str, list[float]] = {}
            for i in range(REPEATS):
                work = Path(tmp) / f"{scenario[:5]}-{i}"
                work.mkdir()
                out, printed = one(host, fleet, work, flags, event, until)
                for name, found in out.items():
                    lags.setdefault(name, []).append((found["seen"] - printed) * found["scale"])
            for name, values in lags.items():
                rows.append((scenario, name, statistics.median(values), max(values)))
                print(f"{scenario:24} {name:9} median {rows[-1][2]:7.2f} s  max {rows[-1][3]:7.2f} s", flush=True)
        work = Path(tmp) / "quiet"
        work.mkdir()
        quiet, _ = one(host, fleet, work, [], "ready", quiet=True)
        print(f"quiet serve of {QUIET_S:.0f} s: agent {quiet['agent']['calls']} pokes,"
              f" fixed5 {quiet['fixed5']['calls']} round trips", flush=True)
    write(rows, quiet)


def write(rows: list[tuple[str, str, float, float]], quiet: dict[str, Any]) -> None:
    lines = [
        "## Detection lag (bench/detection_lag.py)",
        "",
        (f"Real time over a real sshd on loopback: an emulated SGLang 0.5.23 server loads 64 shards, turns ready,"
         f" serves, then crashes and exits, or prints a fatal scheduler line and hangs, or keeps serving; every"
         f" watcher reads the same job at once. Lag in real seconds from the line being printed to it being"
         f" recorded, median and max of {REPEATS} runs. agent: orch's watcher of the host, the log's bytes and"
         f" the job's end pushed by the host's agent over one channel as they happen;"
         f" fixed5: a 5 s poll (the recorder's one-shot look) with the sleep on the controller;"
         f" sleep600: `sleep 600; tail` (run 1/{SCALE} scale, lag scaled back); tail-F: the log streamed over"
         " one SSH channel, the physical limit."
         f" Load average {LOAD_BEFORE:.1f} before and {os.getloadavg()[0]:.1f} at the end (1 min), on"
         f" {os.cpu_count()} cores shared with other jobs."),
        "",
        "| scenario | watcher | median lag (s) | max lag (s) |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {scenario} | {name} | {median:.2f} | {worst:.2f} |" for scenario, name, median, worst in rows]
    o, f = quiet["agent"]["calls"], quiet["fixed5"]["calls"]
    lines += [
        "",
        (f"Round trips over a {QUIET_S:.0f} s quiet serve: the agent's pokes on the backoff {o}, fixed5 {f}"
         f" ({o / max(f, 1):.2f}x); the agent keeps one channel open and sends nothing while the run is quiet"
         " but a poke on the backoff."),
        "",
    ]
    write_section("\n".join(lines))
    print("wrote the detection lag section of bench/RESULTS.md")


if __name__ == "__main__":
    main()
