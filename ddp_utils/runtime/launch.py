"""How this process was launched, read from its environment (no side effects): the three ways
this project is started.

1. ``torchrun``: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set by the agent.
2. ``srun`` with one task per GPU and no torchrun: SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS give
   the ranks; the master is the first host of the allocation and the port is derived from the job id,
   so two jobs sharing a node do not collide.
3. ``python script.py``: one process, no process group at all.

Also which node this process runs on (:func:`node_identity`, what keeps one cache of shards per
node), the node's name and how many times the job was restarted.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

# Ports derived from a SLURM job id fall in [_PORT_BASE, _PORT_BASE + _PORT_SPAN): above the
# well-known and registered ranges most services use, below Linux's default ephemeral range.
_PORT_BASE = 15000
_PORT_SPAN = 15000


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process, read from the environment (no side effects)."""

    launcher: str  # "torchrun", "slurm" or "single"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    node: str = "0"  # which node of the job this process runs on (node_identity)


def first_slurm_host(nodelist: str) -> str:
    """First host name of a SLURM compressed host list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``.

    Same answer as the first line of ``scontrol show hostnames``, without needing scontrol.
    """
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first  # the range keeps its zero padding, e.g. "03"


def tasks_on_this_node(env: Mapping[str, str]) -> int:
    """Tasks SLURM placed on this node, from e.g. SLURM_STEP_TASKS_PER_NODE="4(x2),3"."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return int(env.get("SLURM_NTASKS_PER_NODE", "1"))
    node_id = int(env.get("SLURM_NODEID", "0"))
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            raise ValueError(f"cannot parse SLURM tasks per node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[min(node_id, len(counts) - 1)]


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Work out how this process was launched from its environment variables."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also sets LOCAL_*; plain env:// too)
        world_size = int(env["WORLD_SIZE"])
        return LaunchEnv(
            launcher="torchrun",
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=world_size,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
            node=node_identity(env),
        )
    # srun sets SLURM_STEP_NUM_TASKS for the job step; a batch script only has SLURM_NTASKS,
    # which counts tasks that do not exist yet, so a bare `python` in an sbatch script stays single.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        world_size = int(env["SLURM_STEP_NUM_TASKS"])
        if world_size > 1:
            nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
            job_id = int(env.get("SLURM_JOB_ID", "0"))
            return LaunchEnv(
                launcher="slurm",
                rank=int(env["SLURM_PROCID"]),
                local_rank=int(env.get("SLURM_LOCALID", "0")),
                world_size=world_size,
                local_world_size=tasks_on_this_node(env),
                master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
                master_port=int(env.get("MASTER_PORT") or _PORT_BASE + job_id % _PORT_SPAN),
                node=node_identity(env),
            )
    return LaunchEnv(launcher="single", rank=0, local_rank=0, world_size=1, local_world_size=1,
                     node=node_identity(env))


def node_name(env: Mapping[str, str] | None = None) -> str:
    """The node this process runs on: SLURM's name for it inside a job (two slurmd on one machine
    are two nodes of one host name), else the host name."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def node_identity(env: Mapping[str, str] | None = None) -> str:
    """Which node of the job this process runs on, the same for every process of the node and
    different on every other node, written for a file name: SLURM's node number (under srun, and
    inherited by a torchrun that srun started), else torchrun's GROUP_RANK (its agent's number),
    else the node's name. Never derived from the ranks: tasks per node may be uneven (SLURM's
    ``4(x2),3``) and ranks dealt to the nodes in turn (``--distribution=cyclic``)."""
    env = os.environ if env is None else env
    identity = env.get("SLURM_NODEID") or env.get("GROUP_RANK") or node_name(env)
    return re.sub(r"[^\w.-]", "_", identity)


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times this job was restarted: by torchrun (--max-restarts) or by a SLURM requeue."""
    env = os.environ if env is None else env
    return int(env.get("TORCHELASTIC_RESTART_COUNT") or 0) + int(env.get("SLURM_RESTART_COUNT") or 0)
