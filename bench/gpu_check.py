"""orch on a real GPU machine, in one run of a few minutes (bench/gpu_check.sh starts it there).

1. install orch from bench/wheels (`make gpu-wheels`) into a venv that sees the machine's torch;
2. `orch gpus --json` against nvidia-smi's own CSV: the GPUs, their memory, the processes;
3. a torch process holding GPU memory launched through orch (`orch run command`), and a foreign one
   started beside it, outside orch;
4. a new run with `--replace`: orch stops its own run (nvidia-smi shows the memory freed), names the
   foreign process and spares it (still alive, still holding its memory); then this script kills it;
5. `orch run extract-hidden-states` on the GPU (a tiny random Llama made on the fly), timed;
6. the figures printed and written as RESULTS.md's `## GPU check`, and with orch's output under $OUT
   (what comes back from a lent machine): `--record $FILES_AT/gpu_check.md` puts the section in here.

`--dry` runs the same steps on a machine with no GPU: tests/fakes/nvidia-smi on PATH, the holders enter
themselves in its state file instead of allocating memory, extract-hidden-states on the CPU; with
`--python PY` (a CPython 3.12) step 1 installs the wheels too. A dry run writes nothing
to RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
WHEELS = ROOT / "bench" / "wheels"
FAKE_SMI = ROOT / "tests" / "fakes"
ORCH_MIB, FOREIGN_MIB = 4096, 2048  # different sizes: each holder is known by its memory, whatever pid it shows
SLACK_MIB = 256  # readings taken a moment apart, and the CUDA context each process adds


# --- a process that holds GPU memory (run as `gpu_check.py --hold MIB`) ------------------------------


def hold(mib: int, fake_state: str | None) -> None:
    """Hold `mib` MiB of GPU 0 until killed; with a stand-in's state file, enter this pid there instead."""
    if fake_state:
        state = json.loads(Path(fake_state).read_text())
        state["processes"].append({"pid": os.getpid(), "gpu": 0, "used_memory": mib, "name": "python"})
        tmp = Path(fake_state + f".{os.getpid()}")
        tmp.write_text(json.dumps(state))
        tmp.replace(fake_state)
    else:
        import torch

        block = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
        block.fill_(1)
        torch.cuda.synchronize()
    print(f"holding {mib} MiB", flush=True)
    while True:
        time.sleep(3600)


# --- reading nvidia-smi and orch ----------------------------------------------------------------------


def smi() -> dict[str, Any]:
    """nvidia-smi's own view: GPUs by uuid (memory in MiB) and compute processes."""
    def query(what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", what, "--format=csv,noheader,nounits"], check=True,
                             capture_output=True, text=True, timeout=60).stdout
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]

    gpus = {uuid: {"index": int(i), "used": int(used), "total": int(total)}
            for i, uuid, used, total in query("--query-gpu=index,uuid,memory.used,memory.total")}
    apps = [{"pid": int(pid), "uuid": uuid, "used": int(used) if used.isdigit() else None}
            for pid, uuid, used in query("--query-compute-apps=pid,gpu_uuid,used_memory")]
    return {"gpus": gpus, "apps": apps}


def card() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             check=True, capture_output=True, text=True, timeout=60).stdout
        names = sorted(set(out.strip().splitlines()))
        return "; ".join(f"{line.split(',')[0].strip()}, driver {line.split(',')[1].strip()}" for line in names)
    except (subprocess.CalledProcessError, IndexError, OSError):
        return "no card named by nvidia-smi"


def compare(doc: dict[str, Any], seen: dict[str, Any]) -> list[str]:
    """What `orch gpus --json` (of `local`) says that nvidia-smi does not."""
    host = doc.get("local") or {}
    if not host.get("ok") or not host.get("nvidia_smi"):
        return [f"orch gpus: ok={host.get('ok')} nvidia_smi={host.get('nvidia_smi')} error={host.get('error')}"]
    problems = []
    ours = {g["uuid"]: g for g in host["gpus"]}
    if set(ours) != set(seen["gpus"]):
        problems.append(f"GPUs: orch {sorted(ours)}, nvidia-smi {sorted(seen['gpus'])}")
    for uuid, g in seen["gpus"].items():
        o = ours.get(uuid)
        if o is None:
            continue
        if o["index"] != g["index"] or o["memory_total_mib"] != g["total"]:
            problems.append(f"GPU {g['index']}: orch index {o['index']} total {o['memory_total_mib']}, "
                            f"nvidia-smi total {g['total']}")
        if o["memory_used_mib"] is None or abs(o["memory_used_mib"] - g["used"]) > SLACK_MIB:
            problems.append(f"GPU {g['index']}: orch used {o['memory_used_mib']} MiB, nvidia-smi {g['used']}")
    theirs = {(a["pid"], a["uuid"]) for a in seen["apps"]}
    listed = {(p["pid"], uuid) for uuid, g in ours.items() for p in g["processes"]}
    if theirs != listed:
        problems.append(f"processes: orch {sorted(listed)}, nvidia-smi {sorted(theirs)}")
    return problems


def describe(app: dict[str, Any] | None, before: dict[str, Any], after: dict[str, Any]) -> str:
    grew = f"{total_used(before)} -> {total_used(after)} MiB in use"
    return f"pid {app['pid']} holds {app['used']} MiB ({grew})" if app else f"{grew}, but no new process listed"


def total_used(seen: dict[str, Any]) -> int:
    return sum(g["used"] for g in seen["gpus"].values())


def holder(seen: dict[str, Any], mib: int, before: set[int]) -> dict[str, Any] | None:
    """The new process that holds about `mib` MiB (by memory, since a container may show other pids)."""
    new = [a for a in seen["apps"] if a["pid"] not in before and (a["used"] or 0) >= mib]
    return min(new, key=lambda a: a["used"]) if new else None


# --- the check ----------------------------------------------------------------------------------------


class Check:
    def __init__(self, python: str, ws: Path, env: dict[str, str], log: Path, dry: bool, fake_state: str | None):
        self.python, self.ws, self.env, self.log, self.dry = python, ws, env, log, dry
        self.fake_state = fake_state
        self.rows: list[tuple[str, str, str]] = []  # (step, ok or FAILED, figures)
        self.foreign: subprocess.Popen[str] | None = None

    def note(self, text: str) -> None:
        with self.log.open("a") as f:
            f.write(text.rstrip("\n") + "\n")

    def row(self, step: str, ok: bool, figures: str) -> bool:
        self.rows.append((step, "ok" if ok else "FAILED", figures))
        print(f"{'ok    ' if ok else 'FAILED'} {step}: {figures}", flush=True)
        return ok

    def orch(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        res = subprocess.run([self.python, "-m", "orchestrator", *args], cwd=self.ws, env=self.env, check=False,
                             capture_output=True, text=True, timeout=timeout)
        self.note(f"$ orch {' '.join(args)}  # rc {res.returncode}, {time.monotonic() - t0:.1f} s\n"
                  f"{res.stdout}{res.stderr}")
        return res

    def orch_json(self, *args: str, timeout: float = 120) -> Any:
        return json.loads(self.orch(*args, "--json", timeout=timeout).stdout)

    def hold_cmd(self, mib: int) -> list[str]:
        return [self.python, str(HERE), "--hold", str(mib)] + (["--fake-state", self.fake_state] if self.fake_state else [])

    def wait_for(self, what: str, probe: Any, timeout: float = 120) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            found = probe()
            if found:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not seen in {timeout:.0f} s")
            time.sleep(0.5)

    def gpus_match(self, step: str) -> bool:
        doc = self.orch_json("gpus")
        seen = smi()
        problems = compare(doc, seen)
        if problems:  # readings a moment apart: one more pair before calling it a mismatch
            doc, seen = self.orch_json("gpus"), smi()
            problems = compare(doc, seen)
        self.note(f"nvidia-smi: {json.dumps(seen)}")
        return self.row(step, not problems, "; ".join(problems) or
                        f"{len(seen['gpus'])} GPU(s), {total_used(seen)}/{sum(g['total'] for g in seen['gpus'].values())} "
                        f"MiB, {len(seen['apps'])} process(es), as nvidia-smi says")

    def held(self, mib: int, since: dict[str, Any], known: set[int]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Wait until nvidia-smi shows `mib` MiB more in use than `since`; that reading and the new process
        holding it (None where nvidia-smi lists no process: a container's own pids, for one)."""
        def grown() -> dict[str, Any] | None:
            seen = smi()
            return seen if total_used(seen) - total_used(since) >= mib - SLACK_MIB else None

        seen = self.wait_for(f"{mib} MiB more in use on nvidia-smi", grown)
        return seen, holder(seen, mib, known)

    def holders_and_replace(self) -> None:
        base = smi()
        before = {a["pid"] for a in base["apps"]}
        t0 = time.monotonic()
        res = self.orch("run", "command", "--until-ready", "--name", "gpu-holder", "--set", "ready_pattern=^holding",
                        "--set", "cmd=" + " ".join(self.hold_cmd(ORCH_MIB)))  # a text key takes the text as given
        if not self.row("a torch holder launched through orch", res.returncode == 0, f"rc {res.returncode}"):
            return
        with_ours, ours = self.held(ORCH_MIB, base, before)
        run1 = self.orch_json("status", "1")
        self.row("its memory on nvidia-smi", ours is not None, f"{describe(ours, base, with_ours)}, "
                 f"{time.monotonic() - t0:.1f} s from `orch run` (run 1 {run1['status']}, pid {run1.get('pid')})")

        self.foreign = subprocess.Popen(self.hold_cmd(FOREIGN_MIB), stdout=subprocess.DEVNULL,
                                        start_new_session=True, env=self.env, text=True)
        both, theirs = self.held(FOREIGN_MIB, with_ours, before | {a["pid"] for a in with_ours["apps"]})
        self.row("a foreign holder beside it", theirs is not None,
                 f"{describe(theirs, with_ours, both)} (this script's child, pid {self.foreign.pid})")
        self.gpus_match("orch gpus --json = nvidia-smi, two holders")
        shown = {p["pid"]: p for g in self.orch_json("gpus")["local"]["gpus"] for p in g["processes"]}
        a = shown.get(ours["pid"] if ours else -1, {})
        b = shown.get(theirs["pid"] if theirs else -1, {})
        self.row("orch tells its own from the foreign", a.get("run_id") == 1 and bool(b) and b.get("run_id") is None,
                 f"orch's holder: run {a.get('run_id')}; the foreign: run {b.get('run_id')}, user {b.get('user')}")

        t0 = time.monotonic()
        res = self.orch("run", "command", "--replace", "--name", "replacer", "--set", "cmd=true", timeout=240)
        took = time.monotonic() - t0
        after = smi()
        first, second = self.orch_json("status", "1"), self.orch_json("status", "2")
        pids = {a["pid"] for a in after["apps"]}
        freed = total_used(both) - total_used(after)
        gone = ours is not None and ours["pid"] not in pids
        self.row("--replace stops orch's run", first["status"] == "cancelled" and gone and freed >= ORCH_MIB - SLACK_MIB,
                 f"run 1 {first['status']} ({first.get('reason')}); nvidia-smi: its process "
                 f"{'gone' if gone else 'STILL LISTED (or never)'}, {freed} MiB freed "
                 f"({total_used(both)} -> {total_used(after)} MiB); `orch run --replace` rc {res.returncode} in {took:.1f} s")
        named = theirs is not None and f"pid {theirs['pid']}" in (second.get("reason") or "") + json.dumps(
            second.get("events", []))
        alive = self.foreign.poll() is None and theirs is not None and theirs["pid"] in pids
        self.row("the foreign one named and spared", named and alive,
                 f"run 2 {second['status']}: {second.get('reason')}; the foreign "
                 f"{'alive, still on nvidia-smi' if alive else 'GONE (or never listed)'}")
        self.gpus_match("orch gpus --json = nvidia-smi, after --replace")
        self.kill_foreign()
        self.wait_for("the GPUs free again", lambda: total_used(smi()) <= total_used(base) + SLACK_MIB, timeout=60)

    def kill_foreign(self) -> None:
        if self.foreign is not None and self.foreign.poll() is None:
            os.killpg(self.foreign.pid, signal.SIGTERM)
            self.foreign.wait(timeout=30)

    def extract(self, device: str, *sets: str) -> None:
        args = [f"--set=device={device}", *(f"--set={s}" for s in sets)]
        label = ", ".join([device, *(s.split("=")[0] if s.startswith("dataset=") else s for s in sets)])
        t0 = time.monotonic()
        res = self.orch("run", "extract-hidden-states", *args, "--json", timeout=300)
        took = time.monotonic() - t0
        try:
            summary = json.loads(res.stdout)
        except json.JSONDecodeError:
            summary = {}
        m = summary.get("metrics") or {}
        ok = res.returncode == 0 and summary.get("status") == "succeeded"
        said = (summary.get("log_lines") or res.stderr.strip().splitlines() or ["?"])[-1]
        why = "" if ok else f"; {summary.get('cause')}: {said}"
        self.row(f"extract-hidden-states ({label})", ok,
                 f"{m.get('samples')} samples, {m.get('tokens')} tokens, {m.get('tokens_per_s')} tok/s; "
                 f"run {summary.get('duration_s')} s, `orch run` {took:.1f} s{why}")

    def stop_leftovers(self) -> None:
        self.kill_foreign()
        try:
            for run in self.orch_json("status", "--active"):
                self.orch("stop", str(run["id"]), timeout=200)
        except (json.JSONDecodeError, subprocess.SubprocessError, OSError):
            pass


def install(base: str, venv: Path, log: Path) -> tuple[str, str]:
    """orch and what it needs from the carried wheels, into a venv beside the base python's own packages
    (torch); the venv's python and what was installed."""
    wheels = sorted(WHEELS.glob("*.whl"))
    pip_whl = next((w for w in wheels if w.name.startswith("pip-")), None)
    orch_whl = next((w for w in wheels if w.name.startswith("orch-")), None)
    if pip_whl is None or orch_whl is None:
        raise RuntimeError(f"no wheels in {WHEELS}: run `make gpu-wheels` first")
    subprocess.run([base, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, str(pip_whl / "pip"), "install", "--no-index", "--find-links", str(WHEELS), "--no-cache-dir",
           "--no-compile"]
    for argv in (["-r", str(WHEELS / "requirements.txt"), "-c", str(WHEELS / "constraints.txt")],
                 ["--no-deps", str(orch_whl)]):  # orch last, without what gpu_wheels.py left out
        res = subprocess.run(pip + argv, check=False, capture_output=True, text=True)
        with log.open("a") as f:
            f.write(f"$ pip install {' '.join(argv)}\n{res.stdout}{res.stderr}")
        if res.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(argv)}: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
    subprocess.run([py, "-c", "import orchestrator.cli, transformers, tokenizers, safetensors, tqdm"], check=True)
    return py, f"{len(wheels)} wheels"


def versions(python: str) -> str:
    code = ("import sys, torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, "
            "Python {sys.version.split()[0]}')")
    res = subprocess.run([python, "-c", code], check=False, capture_output=True, text=True)
    return res.stdout.strip() or f"no torch in {python}"


def section(check: Check, where: str, dry: bool, took: float) -> str:
    lines = ["## GPU check (bench/gpu_check.py)", "",
             (f"{'A dry run, no GPU (tests/fakes/nvidia-smi): ' if dry else ''}{where}; "
              f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {took:.0f} s in all. Holders: {ORCH_MIB} MiB "
              f"through orch (`orch run command`), {FOREIGN_MIB} MiB outside it."), "",
             "| step | result | figures |", "|---|---|---|"]
    lines += [f"| {step} | {ok} | {figures.replace('|', '/')} |" for step, ok, figures in check.rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", help="no GPU: the nvidia-smi stand-in, the job on the CPU")
    ap.add_argument("--python", help="the python to install the wheels under (default: this one; --dry: skip)")
    ap.add_argument("--record", metavar="FILE", help="put a section a device run brought back into RESULTS.md")
    ap.add_argument("--hold", type=int, metavar="MIB", help=argparse.SUPPRESS)
    ap.add_argument("--fake-state", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hold:
        hold(args.hold, args.fake_state)
        return 0
    sys.path.insert(0, str(HERE.parent))
    from results import write_section

    if args.record:
        write_section(Path(args.record).read_text())
        return 0

    started = time.monotonic()
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-check-out-"))
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    log = out / "gpu_check.log"
    env = {**os.environ, "ORCH_HOME": str(work / "ws")}
    (work / "ws").mkdir()
    fake_state = None
    if args.dry:
        fake_state = str(work / "gpu-state.json")
        Path(fake_state).write_text(json.dumps({"gpus": [{"index": 0, "uuid": "GPU-00000000-1111-2222-3333-444444444444",
                                                          "memory_total": 81559, "utilization": 0}],
                                                "processes": []}))
        env.update(PATH=f"{FAKE_SMI}{os.pathsep}{env['PATH']}", ORCH_FAKE_GPU_STATE=fake_state)
        os.environ.update(PATH=env["PATH"], ORCH_FAKE_GPU_STATE=fake_state)  # this script's own nvidia-smi calls
    check = Check(sys.executable, work / "ws", env, log, args.dry, fake_state)

    base = args.python or (None if args.dry else sys.executable)
    if base:
        t0 = time.monotonic()
        try:
            py, how = install(base, work / "venv", log)
            check.row("install orch from bench/wheels", True, f"{time.monotonic() - t0:.1f} s: {how}; {versions(py)}")
            if not args.dry:
                check.python = py
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            check.row("install orch from bench/wheels", False, str(exc))
            if not args.dry:
                return finish(check, out, args.dry, started)
    try:
        check.gpus_match("orch gpus --json = nvidia-smi, idle")
        check.holders_and_replace()
    except Exception as exc:  # noqa: BLE001 -- the rest still runs: what went wrong is a figure too
        check.row("holders and --replace", False, f"{type(exc).__name__}: {exc}")
    finally:
        check.stop_leftovers()
    device = "cpu" if args.dry else "cuda"
    check.extract(device)  # the default: 32 prompts, batch 4
    shipped = (ROOT / "playbooks" / "data" / "prompts.jsonl").read_text()
    (work / "prompts.jsonl").write_text(shipped * (512 // len(shipped.splitlines())))
    more = (f"dataset={work / 'prompts.jsonl'}", "batch_size=32", "max_samples=512")
    check.extract(device, *more)
    if not args.dry:
        check.extract("cpu", *more)  # the same job on the machine's CPUs
    return finish(check, out, args.dry, started)


def finish(check: Check, out: Path, dry: bool, started: float) -> int:
    where = f"{'' if dry else card() + '; '}{versions(check.python)}; {platform.node()}"
    text = section(check, where, dry, time.monotonic() - started)
    print("\n" + text)
    (out / "gpu_check.md").write_text(text)
    if not dry:
        from results import write_section

        write_section(text)
    shutil.rmtree(check.ws.parent, ignore_errors=True)
    print(f"section and orch's output in {out}")
    return 0 if all(ok == "ok" for _, ok, _ in check.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
