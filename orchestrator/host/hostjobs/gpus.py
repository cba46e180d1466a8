"""The GPUs as nvidia-smi reports them, and the facts of the host a run's receipt records."""

import hashlib
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess

from .common import JOB_MARK
from .files import run_argv
from .procs import _stat_fields, start_time

GPU_FIELDS = ("index", "uuid", "memory.used", "memory.total", "utilization.gpu")
APP_FIELDS = ("pid", "gpu_uuid", "used_memory")


def _csv(argv, fields, timeout):
    """Rows of an nvidia-smi query (csv, noheader, nounits) as dicts of their cells; raises with its words."""
    out = subprocess.run(argv + ["--format=csv,noheader,nounits"], capture_output=True, timeout=timeout, check=False)
    text = (out.stdout + out.stderr).decode(errors="replace")
    if out.returncode != 0:
        raise GpuError(" ".join(text.split())[:300] or f"exit code {out.returncode}")
    rows = []
    for line in out.stdout.decode(errors="replace").splitlines():
        cells = [c.strip() for c in line.split(", ")]
        if line.strip() and len(cells) == len(fields):
            rows.append(dict(zip(fields, cells)))
    return rows


class GpuError(Exception):
    pass


def process_info(pid):
    """What the host says of a process holding a GPU: its group, user, command line, start time, its group
    leader's start time and the run mark in its environment (readable only for one's own processes)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    pgid = int(fields[2])
    try:
        user = pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        user = None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        command = ""
    mark = None
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(JOB_MARK.encode() + b"="):
                    mark = item.split(b"=", 1)[1].decode(errors="replace")
                    break
    except OSError:
        pass
    return {"pgid": pgid, "user": user, "command": command, "start": fields[19],
            "group_start": start_time(pgid), "mark": mark}


def gpus(timeout, facts=False):
    """The GPUs, their compute processes and what each process is, in one look; None without nvidia-smi.
    With `facts`, the same query asks for a receipt's GPU facts too (a driver that lacks one: without them)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    fields = GPU_FIELDS + tuple(f for f in GPU_FACTS if f not in GPU_FIELDS) if facts else GPU_FIELDS
    extra = {}
    try:
        gpu_rows = _csv([smi, "--query-gpu=" + ",".join(fields)], fields, timeout)
    except GpuError as exc:
        if fields == GPU_FIELDS:
            raise
        extra["facts_error"] = str(exc)[:300]
        gpu_rows = _csv([smi, "--query-gpu=" + ",".join(GPU_FIELDS)], GPU_FIELDS, timeout)
    apps = _csv([smi, "--query-compute-apps=" + ",".join(APP_FIELDS)], APP_FIELDS, timeout)
    procs = {}
    for app in apps:
        pid = app["pid"]
        if pid.isdigit() and pid not in procs:
            procs[pid] = process_info(int(pid))
    return {"gpus": gpu_rows, "apps": apps, "procs": procs, **extra}



# -- what a run's numbers were made on (its receipt), looked at in the launch request ----------------------
GPU_FACTS = ("index", "uuid", "name", "driver_version", "clocks.applications.graphics", "clocks.applications.memory",
             "clocks.max.sm", "ecc.mode.current", "ecc.errors.uncorrected.volatile.total",
             "clocks_throttle_reasons.active", "persistence_mode")
# run by the engine's python: the versions of the engine's distributions, from their metadata (no import)
VERSIONS = ("import importlib.metadata as m, json, sys\n"
            "def v(n):\n    try:\n        return m.version(n)\n    except Exception:\n        return None\n"
            "print(json.dumps({'python': sys.version.split()[0], 'packages': {n: v(n) for n in sys.argv[1:]}}))")
FACT_FILE_MAX = 64 << 20  # a model's config files are small: anything larger is named, not hashed


def file_sha256(path):
    """The sha256 of a plain file (None: absent, not a plain file, or too large to be a config)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > FACT_FILE_MAX:
            return None
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    except OSError:
        return None


def cpu_facts():
    model = None
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            for row in f:
                if row.startswith("model name"):
                    model = row.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"model": model, "count": os.cpu_count()}


def host_facts(request, timeout=30):
    """What a run's numbers are made on: the engine's versions (from its python), the sha256 of the model's
    config files, the GPUs (model, driver, clocks, ECC and throttle state) or, without nvidia-smi, the CPU;
    each part that cannot be read says why instead."""
    found = {"hostname": socket.gethostname(), "cpu": cpu_facts()}
    python, packages = request.get("python"), request.get("packages") or []
    if python:
        out = run_argv([python, "-c", VERSIONS, *packages], timeout, 1 << 16)
        try:
            found["engine"] = json.loads(out["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            found["engine"] = {"error": " ".join((out["stderr"] or "no output").split())[-300:]}
    found["files"] = {path: file_sha256(path) for path in request.get("files") or []}
    smi = shutil.which("nvidia-smi") if request.get("gpus", True) else None  # False: the GPU check saw them
    if smi is not None:
        try:
            found["gpus"] = _csv([smi, "--query-gpu=" + ",".join(GPU_FACTS)], GPU_FACTS, timeout)
            found["gpu_apps"] = _csv([smi, "--query-compute-apps=" + ",".join(APP_FIELDS)], APP_FIELDS, timeout)
        except (GpuError, OSError, subprocess.SubprocessError) as exc:
            found["gpu_error"] = str(exc)[:300]
    return found
