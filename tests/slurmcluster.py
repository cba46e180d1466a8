"""A real one-node Slurm cluster for the tests: Debian's munged, slurmctld and slurmd, no systemd.

Everything lives under one directory of the test session: the config (found through SLURM_CONF, so
/etc/slurm is never read or written), a munge key and socket of its own, state, spool and logs, and
the fake GPUs. The daemons listen on free ports of 127.0.0.1, so the cluster shares nothing with any
other Slurm on the machine. They are stopped by pid (and the pid recorded at start) at the end.

Facts the config encodes:
- fake GPU "devices" must be character devices (`mknod c 195 N`, the NVIDIA major; unbacked, so
  open() fails with ENXIO): slurmd rejects plain files, and derives CUDA_VISIBLE_DEVICES from the
  index at the end of each name;
- `sacct` needs slurmdbd; without it, `squeue -t all` still lists finished jobs for MinJobAge seconds
  and the job-completion file (jobcomp/filetxt) is the record after that;
- `cred_expire` is also how long a requeued job waits before it may start again;
- several nodes (`nodes` > 1) are several slurmd on this machine (`-N nodeK`, Debian's slurmd is built with
  --enable-multiple-slurmd): each its own port, spool, pid and log file (`%n`), all at 127.0.0.1; their
  names (node0, node1, ...) are not host names, so a job sees them only as Slurm's names.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}


def missing() -> str | None:
    """Why no cluster can start here, or None."""
    exes = {"munge": DAEMONS["munged"], "slurmctld": DAEMONS["slurmctld"], "slurmd": DAEMONS["slurmd"],
            "slurm-client": shutil.which("sbatch") or "/usr/bin/sbatch"}
    absent = [package for package, exe in exes.items() if not os.path.exists(exe)]
    if absent:
        return f"Debian packages absent: {' '.join(absent)} (.ci/run installs them)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: Path, gpus: int = 8, cpus: int | None = None, name: str = "orchtest", nodes: int = 1):
        self.root, self.gpus, self.name, self.nodes = root, gpus, name, nodes
        # one node keeps the name it always had; several are node0, node1, ... (Slurm's hostlist node[0-1])
        self.node_names = ["localhost"] if nodes == 1 else [f"node{i}" for i in range(nodes)]
        node_list = "localhost" if nodes == 1 else f"node[0-{nodes - 1}]"
        self.node_list = node_list
        self.cpus = cpus or os.cpu_count() or 2
        self.conf = root / "etc" / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, orch) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    # config ---------------------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for d in ("etc", "munge", "state", "spool", "log", "fakegpu"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o600)
        gres_type = gres_node = ""
        if self.gpus:
            for i in range(self.gpus):
                dev = r / "fakegpu" / f"nvidia{i}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))  # S_IFCHR
            gres_type, gres_node = "GresTypes=gpu", f"Gres=gpu:{self.gpus}"
            (r / "etc" / "gres.conf").write_text(
                f"AutoDetect=off\nNodeName={self.node_list} Name=gpu File={r}/fakegpu/nvidia[0-{self.gpus - 1}]\n")
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20) * 9 // 10
        slurmd = "" if self.nodes == 1 else ".%n"  # several slurmd: a file (and spool) of each node's own
        node_lines = "\n".join(
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem_mb} {gres_node} State=UNKNOWN"
            if self.nodes == 1 else
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs={self.cpus} "
            f"RealMemory={mem_mb // self.nodes} {gres_node} State=UNKNOWN" for name in self.node_names)
        self.conf.write_text(f"""\
ClusterName={self.name}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=64
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
# the node as configured, not as probed: a benchmark may declare more CPUs than the machine has
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd{slurmd}.pid
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool{slurmd.replace(".", "/")}
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd{slurmd}.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
MinJobAge=300
KillWait=2
OverTimeLimit=0
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
{gres_type}
{node_lines}
PartitionName=debug Nodes={self.node_list} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
        (r / "etc" / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")

    # daemons --------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "ab") as log:  # the daemon keeps its own copy
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                                start_new_session=True)
        (self.root / f"{name}.started.pid").write_text(str(self.procs[name].pid))

    def _until(self, what: str, ok, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while not ok():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}): {self.log_tail(name)}")
            if time.time() > deadline:
                raise RuntimeError(f"{what} timed out: {self.log_tail('slurmctld')} {self.log_tail('slurmd')}")
            time.sleep(0.1)

    def client(self, *argv: str, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30,
                              check=check)

    def start(self) -> SlurmCluster:
        self._write_config()
        _live.append(self)
        self._spawn("munged", [DAEMONS["munged"], "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={self.root}/munge/munge.key", f"--pid-file={self.root}/munge/munged.pid",
                               f"--log-file={self.root}/log/munged.log", f"--seed-file={self.root}/munge/seed"])
        self._until("munged", self.munge_socket.exists)
        self._spawn("slurmctld", [DAEMONS["slurmctld"], "-D", "-i", "-f", str(self.conf)])
        self._until("slurmctld", lambda: "is UP" in self.client("scontrol", "ping").stdout)
        for name in self.node_names:
            self._spawn(self._slurmd(name), [DAEMONS["slurmd"], "-D", "-N", name, "-f", str(self.conf)])
        self._until("slurmd", lambda: len([s for s in self.client("sinfo", "-h", "-N", "-o", "%T").stdout.split()
                                           if s in ("idle", "mixed", "allocated")]) == self.nodes)
        return self

    def cancel_all(self, spare: frozenset[int] | set[int] = frozenset()) -> None:
        """Cancel every job but those `spare` names, and wait until none of them runs (slurmstepd and job
        processes outlive slurmd)."""
        def left() -> list[str]:
            out = self.client("squeue", "-h", "-t", "R,CG,S,PD", "-o", "%i").stdout.split()
            return [job for job in out if job not in {str(j) for j in spare}]

        if spare:
            jobs = left()
            if jobs:
                self.client("scancel", "--full", *jobs)
        else:
            self.client("scancel", "--full", "-u", "root")
        deadline = time.time() + 30
        while left() and time.time() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        if self in _live:
            _live.remove(self)
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.cancel_all()
        slurmds = [self._slurmd(name) for name in self.node_names]
        for name in (*slurmds, "slurmctld", "munged"):  # compute daemons, controller, then auth
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def _slurmd(self, node: str) -> str:
        """The name a node's slurmd goes by here (its process, its .out and pid files)."""
        return "slurmd" if self.nodes == 1 else f"slurmd.{node}"

    def log_tail(self, name: str, lines: int = 15) -> str:
        for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            if path.exists():
                return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""


_live: list[SlurmCluster] = []


@atexit.register
def _stop_leftovers() -> None:
    for cluster in _live.copy():  # stop() takes each out of the list
        cluster.stop()


@contextmanager
def running(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster started, and this process's Slurm commands (orch's too) pointed at it rather than
    /etc/slurm; stopped, and SLURM_CONF as it was, at the end."""
    saved = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
        os.environ.update(cluster.env)
        yield cluster
    finally:
        cluster.stop()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
