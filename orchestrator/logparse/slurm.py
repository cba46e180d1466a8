"""Slurm's own lines in a job's output: slurmstepd's and srun's account of how the job or a step ended (and
the same account in PBS's and LSF's words).

They name the engine `slurm` only when nothing else does (a log of nothing but a cancelled job).
"""

from __future__ import annotations

import re

from .errors import Rule, rule

DETECT = re.compile(r"^(?:slurmstepd|srun|salloc|sbatch)(?:-[\w.-]+)?: ")

RULES: list[Rule] = [
    # '*** JOB 4242 ON gpu-07 CANCELLED AT 2026-01-10T12:00:00 DUE TO TIME LIMIT ***' (also STEP 4242.0); the
    # only reason that starts with T, so a line clipped after it still says it.
    rule(r"\*\*\* (?:JOB|STEP) [\d._]+ ON \S+ CANCELLED AT \S+ DUE TO T(?:IME LIMIT|[A-Z ]*$)", "timeout", True,
         True, versions="all", source="src/slurmd/slurmstepd/req.c", any_level=True),
    # Cancelled by a user (scancel: nothing after the time), preempted, or lost with its node.
    rule(r"\*\*\* (?:JOB [\d._]+ ON \S+ CANCELLED AT \S+ \*\*\*|(?:JOB|STEP) [\d._]+ ON \S+ CANCELLED AT \S+ DUE TO (?!T))",
         "killed", True, True, versions="all", source="src/slurmd/slurmstepd/req.c", any_level=True),
    # A step stopped with no reason given: srun ends a step when one of its tasks failed (--kill-on-bad-exit,
    # a multi-node run's other ranks), whose own line says why; or a user's scancel of the step alone.
    rule(r"\*\*\* STEP [\d._]+ ON \S+ CANCELLED AT \S+ \*\*\*", "killed", True, False, versions="all",
         source="src/slurmd/slurmstepd/req.c", any_level=True),
    # A cancellation whose reason the line does not show (a pane clipped it): the job ended, why is not said.
    rule(r"\*\*\* (?:JOB|STEP) [\d._]+ ON \S+ CANCELLED\b", "other", True, versions="all",
         source="src/slurmd/slurmstepd/req.c", any_level=True),
    rule(r"^srun: error: \S+: tasks? [\d,-]+: (?:Killed|Terminated|Aborted)|^srun: Job step aborted"
         r"|^srun: forcing job termination|^srun: error: .*Job step \S+ aborted", "killed", True, False,
         versions="all", source="src/srun/", any_level=True),
    rule(r"^slurmstepd(?:-\S+)?: error: Detected \d+ oom[_-]kill events?", "killed", True, True,
         versions="all", source="src/plugins/task/cgroup/", any_level=True),
    # The first task to fail, as srun names it: what the others' ends (killed, terminated) follow from.
    rule(r"^srun: error: \S+: tasks? [\d,-]+: Exited with exit code [1-9]", "other", True, True,
         versions="all", source="src/srun/", any_level=True),
    rule(r"^srun: error: Node failure on \S+", "killed", True, True, versions="all", source="src/srun/",
         any_level=True),
    # Other batch schedulers' words for the same ends: PBS's and LSF's limits.
    rule(r"=>> PBS: job killed: (?:walltime|cput) \d+ exceeded limit|TERM_RUNLIMIT: job killed", "timeout", True,
         True, versions="all", source="PBS Pro / OpenPBS mom, LSF sbatchd", any_level=True),
    rule(r"=>> PBS: job killed: v?mem \S+ exceeded limit|TERM_MEMLIMIT: job killed", "killed", True, True,
         versions="all", source="PBS Pro / OpenPBS mom, LSF sbatchd", any_level=True),
]
