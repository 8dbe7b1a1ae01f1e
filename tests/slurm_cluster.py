"""A throw-away SLURM cluster of two nodes on this one machine, for the tests (Debian's
slurmctld, two slurmd and munge).

Each node is a slurmd of its own (`slurmd -N NAME`, its own port): the machine's host name and
`localhost`, names that resolve, so a job script can take its head node from the node list.
Single-node jobs land on either. Nothing is installed here (``.ci/run`` installs the packages);
the daemons run from a generated slurm.conf under a temporary folder, on ports of their own, and
are stopped by their PIDs. Where SLURM is not installed the tests that need it are skipped, except
in CI (``CI=true``), where that is a failure.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers import free_port

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "scancel", "squeue")

# Short timers for a throw-away cluster. A requeued job starts again cred_expire seconds after it
# ended. A killed slurmd was declared down 29 s after the kill (SlurmdTimeout 10), 24 s with
# SlurmdTimeout 3, 11 s with MessageTimeout 3 as well: the controller waits that long on each ping
# that gets no answer.
CONF = """\
ClusterName=ci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
MailProg=/bin/true
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd-%n.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
MinJobAge=5
KillWait=30
SlurmdTimeout=3
MessageTimeout=3
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
# The node named like the machine comes first: listed after `localhost`, slurmd stops with
# "Duplicated NodeHostName". Both declare the machine's CPUs.
NODE = "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory=1000 State=UNKNOWN"


@dataclass
class SlurmCluster:
    base: Path
    env: dict[str, str]
    nodes: list[str]

    def run(self, *args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=timeout, **kwargs)

    pids: list[int] = field(default_factory=list)  # every daemon started, for stop_cluster

    def start_node(self, name: str) -> int:
        """Start the slurmd of node ``name`` (again); its PID."""
        pid_file = self.base / f"run/slurmd-{name}.pid"
        pid_file.unlink(missing_ok=True)
        subprocess.run(["slurmd", "-N", name], env={**os.environ, **self.env}, check=True, timeout=30)
        self.pids.append(_read_pid(pid_file))
        return self.pids[-1]

    def job_processes(self, job_id: str) -> dict[int, dict[str, str]]:
        """{PID: its environment} of every process that runs for job ``job_id`` (SLURM_JOB_ID)."""
        environs = {pid: _environ(pid) for pid in _pids()}
        return {pid: env for pid, env in environs.items() if env.get("SLURM_JOB_ID") == job_id}

    def lose_node(self, name: str, job_id: str) -> list[int]:
        """Node ``name`` dies: SIGKILL to its slurmd and to the job steps it runs for ``job_id``
        (their slurmstepd and everything below it); the PIDs killed."""
        tasks = [pid for pid, env in self.job_processes(job_id).items() if env.get("SLURMD_NODENAME") == name]
        stepds = {_daemon_above(pid) for pid in tasks}
        victims = [int((self.base / f"run/slurmd-{name}.pid").read_text())]
        victims += [pid for stepd in stepds for pid in (stepd, *descendants(stepd))]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return victims

    def idle_nodes(self) -> int:
        states = self.run("sinfo", "-h", "-N", "-o", "%t").stdout.split()
        return sum(state in ("idle", "mix", "alloc") for state in states)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:  # gone, or not ours to read
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _daemon_above(pid: int) -> int:
    """The ancestor of ``pid`` whose parent is init: the slurmstepd that started it."""
    while _parent(pid) != 1:
        pid = _parent(pid)
    return pid


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first, then theirs)."""
    children = [p for p in _pids() if _safe_parent(p) == pid]
    return [q for child in children for q in (child, *descendants(child))]


def _safe_parent(pid: int) -> int | None:
    try:
        return _parent(pid)
    except OSError:
        return None


def missing_tools() -> list[str]:
    return [tool for tool in DAEMONS if shutil.which(tool) is None]


def _ensure_munged() -> int | None:
    """Start munged unless one runs already; the PID of the one started here, if any."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return None  # someone else's (it serves the default socket): leave it alone
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    # munged refuses to run as root ("Keyfile is insecure"): run it as its own user.
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, timeout=30)
    return _read_pid(Path("/run/munge/munged.pid"))


def _read_pid(path: Path, timeout: float = 15) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and path.read_text().strip():
            return int(path.read_text().strip())
        time.sleep(0.1)
    raise RuntimeError(f"{path} did not appear")


def start_cluster(base: Path) -> tuple[SlurmCluster, list[int]]:
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 2
    names = [host, "localhost"]
    for sub in ("state", "run", "log", *(f"spool/{name}" for name in names)):
        (base / sub).mkdir(parents=True, exist_ok=True)
    nodes = "\n".join(NODE.format(name=name, host=host, port=free_port(), cpus=cpus) for name in names)
    conf = base / "slurm.conf"
    conf.write_text(CONF.format(host=host, base=base, ctld_port=free_port(), nodes=nodes))
    env = {"SLURM_CONF": str(conf)}
    munged = _ensure_munged()
    full_env = {**os.environ, **env}
    pids = [munged] if munged else []  # stopped last, after the SLURM daemons
    subprocess.run(["slurmctld"], env=full_env, check=True, timeout=30)
    pids.append(_read_pid(base / "run/slurmctld.pid"))
    cluster = SlurmCluster(base, env, names, pids)  # start_node adds to pids: a restarted node is stopped too
    for name in names:
        cluster.start_node(name)
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until both nodes can take jobs
        if cluster.idle_nodes() == len(names):
            return cluster, pids
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-2000:] for p in (base / "log").glob("*.log"))
    stop_cluster(pids)
    raise RuntimeError(f"the SLURM nodes never became idle ({cluster.run('sinfo').stdout}); logs:\n{logs}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_cluster(pids: list[int]) -> None:
    """SIGTERM to every daemon at once (a throw-away cluster has no state worth a clean shutdown),
    SIGKILL to any still there after 3 s."""
    for pid in reversed(pids):  # slurmd, slurmctld, then munged if it was started here
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 3
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
