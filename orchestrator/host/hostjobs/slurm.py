"""Slurm, on its login node: submit a run's batch script, and read squeue, sacct and sinfo."""

import json
import os
import pwd
import subprocess

from .common import CONTROL, FACTS_ASKED, run_mark, write_whole
from .jobs import self_command
from .rundirs import _job_id_at, claim_run_dir

# squeue's `%r` comes last: a reason is the one field that may hold the separator.
SQUEUE_FIELDS = ("job_id", "state", "node", "name", "reason")
SACCT_FIELDS = ("JobIDRaw", "State", "NodeList", "JobName", "ExitCode")
SINFO_FORMATS = {"partitions": ["-o", "%P %D"],
                 "nodes": ["-N", "-O", "NodeList:|,Gres:|,GresUsed:|,StateLong:|,Partition:"]}


def _scheduler(argv, timeout=60, cwd=None):
    """Run one of the scheduler's commands (an argv, no shell); its output, or raises with its words."""
    out = subprocess.run(argv, capture_output=True, timeout=timeout, check=False, cwd=cwd)
    if out.returncode != 0:
        said = (out.stderr or out.stdout).decode(errors="replace").strip()
        raise RuntimeError(f"{argv[0]} failed: {said[-300:] or f'exit code {out.returncode}'}")
    return out.stdout.decode(errors="replace")

def submit(root, script, token, options, facts=None):
    """Write the job script and sbatch this program's wrapper in the run dir; the job id. Idempotent for
    the same token (a retry answers the job submitted before); a failed sbatch leaves no token behind,
    so the launch can be tried again. The wrapper checks the run dir again when the job starts: a queue
    wait is long."""
    with claim_run_dir(root, token) as run:
        known = _job_id_at(run)
        if known is not None:
            return {"job_id": known, "again": True}
        write_whole("job.sh", script, 0o600, dir_fd=run.fd)  # its environment may hold secrets: the owner's only
        if facts is not None:  # the receipt's look at the host, taken on the node when the job starts
            run.write(FACTS_ASKED, json.dumps(facts), 0o600)
        # the batch script only starts the wrapper, through the bootstrap that checks this program's bytes
        run.write("batch.sh", "#!/bin/sh\nexec " + " ".join(
            _sh_word(w) for w in self_command("wrap", "--dir", root, "--run", run_mark(token))) + "\n", 0o755)
        try:
            out = _scheduler(["sbatch", *options, "--parsable", os.path.join(CONTROL, "batch.sh")], timeout=120,
                             cwd=run.cwd)
            head = out.strip().splitlines()[-1].split(";")[0].strip() if out.strip() else ""
            if not head.isdigit():
                raise RuntimeError(f"sbatch printed no job id: {out.strip()[:200]!r}")
        except Exception:
            os.unlink("token", dir_fd=run.control)
            raise
        run.write("job_id", head + "\n", 0o644)
        return {"job_id": int(head), "again": False}


def _sh_word(word):
    """One word for /bin/sh, single-quoted: the batch script's only line."""
    return "'" + word.replace("'", "'\\''") + "'"


def squeue(job_id):
    """Every job of this user that squeue still knows (finished ones too), or the one job asked for."""
    which = ["-j", str(job_id)] if job_id is not None else ["-u", pwd.getpwuid(os.getuid()).pw_name]
    return squeue_rows(_scheduler(["squeue", "-h", "-t", "all", *which, "-o", "%i|%T|%N|%j|%r"]))


def squeue_rows(text):
    """squeue's `%i|%T|%N|%j|%r` lines as their fields; lines that do not parse are skipped."""
    rows = []
    for line in text.splitlines():
        cells = line.split("|", 4)
        if len(cells) == 5 and cells[0].strip():
            rows.append(dict(zip(SQUEUE_FIELDS, (c.strip() for c in cells))))
    return rows


def sacct_rows(text):
    """sacct's `-P` lines of SACCT_FIELDS as their fields; a header or a line cut short is skipped."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 5 and cells[0].isdigit():
            rows.append(dict(zip(("job_id", "state", "node", "name", "exit_code"), cells[:5])))
    return rows


def sacct(ids):
    """The jobs from the accounting database, else (no slurmdbd) from the job-completion file."""
    listed = ",".join(str(i) for i in ids)
    for argv in (["sacct", "-n", "-P", "-X", "-j", listed], ["sacct", "-c", "-n", "-P", "-j", listed]):
        try:
            return sacct_rows(_scheduler(argv + ["-o", ",".join(SACCT_FIELDS)]))
        except (RuntimeError, OSError, subprocess.SubprocessError):
            continue
    return []


def scancel(job_id, kill):
    _scheduler(["scancel", "--signal=KILL", "--full", str(job_id)] if kill else ["scancel", str(job_id)])


def sinfo(what):
    """The scheduler's partitions (name, node count) or nodes (name, gres, gres used, state, partition)."""
    out = _scheduler(["sinfo", "-h", *SINFO_FORMATS[what]])
    sep = "|" if what == "nodes" else None
    return [[c.strip() for c in line.split(sep)] for line in out.splitlines() if line.strip()]
