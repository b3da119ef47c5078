"""A Ray cluster of several nodes on this machine, started with the real ``ray start`` commands: the actors'
cluster as launch/ray_cluster.sh starts it on VMs, with every node a process session of its own here.

Each node is ``ray start --block`` in a new session (its raylet, agents and worker processes share that
session), so a node is lost the way a VM is, by SIGKILL to its whole session (``kill_node``), and
``close`` ends exactly the sessions this object started: never ``ray stop``, which stops every Ray on the
machine. The head keeps its files under its own ``--temp-dir``, so its address is not written to
/tmp/ray/ray_current_cluster, where another user's ``ray.init()`` would find it and join it. Token
authentication is off (``RAY_AUTH_MODE=disabled``): the cluster listens on 127.0.0.1 only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ray_env() -> dict[str, str]:
    """The environment of this cluster's ``ray`` commands and of a driver that joins it."""
    return dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")


@dataclasses.dataclass
class RayNode:
    """One ``ray start --block`` process session."""

    name: str
    proc: subprocess.Popen
    log: str
    resources: dict[str, float]

    def alive(self) -> bool:
        return self.proc.poll() is None


class LocalRayCluster:
    """``start_head`` then ``add_node``s; ``kill_node`` loses one as a VM is lost; ``close`` ends them all."""

    def __init__(self, root: str, *, object_store_bytes: int = 150 * 1024**2):
        self.root = root
        os.makedirs(root, exist_ok=True)
        # Ray's session files, under /tmp: its socket paths (temp dir + ~70 bytes) must fit in 107 bytes,
        # which a test's tmp_path does not leave room for; removed by close()
        self.temp_dir = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
        self.object_store_bytes = object_store_bytes
        self.nodes: dict[str, RayNode] = {}
        self.address = ""
        # worker port ranges: a block of 2000 drawn per cluster, 100 per node (default 10002-19999 is shared)
        self._worker_ports = 30000 + 2000 * random.Random(os.getpid()).randrange(10)
        os.makedirs(self.temp_dir, exist_ok=True)

    def _ports(self) -> list[str]:
        """Every port a node opens, chosen free, and a range of 100 for its workers (one per worker
        process) apart from the other nodes': several nodes on one machine must not share one."""
        names = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                 "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")
        low = self._worker_ports + 100 * len(self.nodes)
        return [f"--{n}={free_port()}" for n in names] + [f"--min-worker-port={low}",
                                                          f"--max-worker-port={low + 99}"]

    def _start(self, name: str, args: list[str], resources: dict[str, float], num_cpus: float) -> RayNode:
        if name in self.nodes and self.nodes[name].alive():
            raise ValueError(f"LocalRayCluster: node {name!r} is already running")
        log = os.path.join(self.root, f"ray_{name}.log")
        cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block",
               f"--node-ip-address={HOST}", f"--num-cpus={num_cpus:g}", "--num-gpus=0",
               f"--resources={json.dumps(resources)}", f"--object-store-memory={self.object_store_bytes}",
               "--disable-usage-stats", *self._ports(), *args]
        with open(log, "a") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=ray_env(), start_new_session=True)
        node = self.nodes[name] = RayNode(name, proc, log, dict(resources))
        return node

    def start_head(self, *, num_cpus: float = 0, resources: dict[str, float] | None = None,
                   timeout_s: float = 120.0) -> str:
        """The head (GCS); returns its address, once it answers."""
        port = free_port()
        self._start("head", ["--head", f"--port={port}", "--include-dashboard=false",
                             f"--ray-client-server-port={free_port()}", f"--temp-dir={self.temp_dir}"],
                    resources or {}, num_cpus)
        self.address = f"{HOST}:{port}"
        self._wait(lambda n: n >= 1, timeout_s, "head")
        return self.address

    def add_node(self, name: str, *, num_cpus: float = 0, resources: dict[str, float] | None = None,
                 timeout_s: float = 120.0) -> RayNode:
        """A node that joins the head with ``resources``; returns once the cluster counts it alive."""
        if not self.address:
            raise RuntimeError("LocalRayCluster: start_head first")
        before = self.alive_nodes()
        node = self._start(name, [f"--address={self.address}"], resources or {}, num_cpus)
        self._wait(lambda n: n > before, timeout_s, name)
        return node

    def alive_nodes(self) -> int:
        """How many nodes the head counts alive (0 while it does not answer)."""
        from ray._raylet import GcsClient

        os.environ["RAY_AUTH_MODE"] = "disabled"
        try:
            infos = GcsClient(address=self.address).get_all_node_info(timeout=10)
        except Exception:  # the head not up yet, or gone
            return 0
        return sum(info.state == 0 for info in infos.values())  # GcsNodeInfo.ALIVE

    def _wait(self, ready: Any, timeout_s: float, name: str) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s and self.nodes[name].alive():
            if ready(self.alive_nodes()):
                return
            time.sleep(1.0)
        logs = "\n".join(f"== {n.log}\n{_tail(n.log)}" for n in self.nodes.values())
        raise RuntimeError(f"LocalRayCluster: node {name} did not join within {timeout_s:.0f} s\n{logs}")

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of the node's session (raylet, agents, workers): a lost VM."""
        node = self.nodes[name]
        _kill_session(node.proc.pid, signal.SIGKILL)
        node.proc.wait(timeout=30)

    def close(self) -> None:
        """End every node this object started: SIGTERM to each session (workers first), then SIGKILL."""
        for node in sorted(self.nodes.values(), key=lambda n: n.name == "head"):
            _kill_session(node.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for node in self.nodes.values():
            _kill_session(node.proc.pid, signal.SIGKILL)
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_session(sid: int, sig: int) -> None:
    """Send ``sig`` to every process of session ``sid`` (a Ray node's daemons may have left its process
    group, never its session)."""
    for pid in _session_pids(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after ")": state, ppid, pgrp, session
            pids.append(int(entry))
    return pids


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""
