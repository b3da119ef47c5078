"""The pod topology rehearsed on one machine: the learner as N JAX processes, the actors on a Ray cluster of
real nodes, one shared directory, and the failures a pod sees (``experiments.rl ...:rehearsal``).

- Learner: ``learner_processes`` processes of ``driver.run_learner`` (jax.distributed on localhost, gloo
  collectives, ``devices_per_process`` CPU devices each), as ``launch/tpu.sh start`` runs it on a slice.
- Actors: ``local_cluster.LocalRayCluster`` (``ray start`` commands): a head with no CPUs (the GCS and this
  driver), an inference node holding the ``config.server.resource`` the policy server replicas ask for,
  and an actor node whose CPUs run the games (Luanti under Xvfb). ``driver.run_actors`` plays branch
  groups on it until ``rehearsal.groups`` are written.
- Faults, injected mid-run: the actor node is SIGKILLed during a wave and a replacement node joins (its
  games restart there; the wave's groups are dropped, never half-written); a policy server replica is
  SIGKILLed once the learner has published weights (Ray restarts it; it must come back with the newest).
- Then, on the same shard directory: the 1-process learner (same groups, same order) against the 2-process
  one's weights, and a 2-process learner SIGKILLed on both hosts after ``kill_after_step`` and restarted,
  against the uninterrupted run's weights (bit for bit).

The rehearsal builds its own start run (the tiny policy at its random initialisation, and synthetic
demonstrations as its replay data): it rehearses the topology, not the learning.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from histeve_jax.rl.local_cluster import LocalRayCluster, free_port, ray_env
from histeve_jax.rl.spec import RLSpec

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class RehearsalSpec:
    """``config.rehearsal``: the processes, the nodes, the budget and when the faults strike."""

    learner_processes: int = 2
    devices_per_process: int = 4
    groups: int = 3  # written groups the actors stop after
    actor_cpus: float = 1.0  # the actor node's CPUs (half a CPU per game)
    kill_after_step: int = 4  # the learner's checkpoint step after which both processes are SIGKILLed
    timeout_s: float = 900.0  # per learner run, and the actors' deadline

    @classmethod
    def from_config(cls, c: Any) -> RehearsalSpec:
        d = dict(c.to_dict() if hasattr(c, "to_dict") else c)
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) - names:
            raise ValueError(f"config.rehearsal: unknown field(s) {sorted(set(d) - names)}; "
                             f"known: {sorted(names)}")
        spec = cls(**d)
        if spec.learner_processes < 1 or spec.devices_per_process < 1 or spec.groups < 1:
            raise ValueError("config.rehearsal: learner_processes, devices_per_process and groups must be "
                             ">= 1")
        return spec


def init_start_run(workdir: str) -> str:
    """A tiny imitation run's workdir at its random initialisation (config.json, checkpoint step 1) with
    synthetic demonstrations under data/train: the learner's start, its reference and its replay data."""
    from experiments.configs import imitation
    from histeve_jax.data import synthetic
    from histeve_jax.parallel import axes
    from histeve_jax.parallel import mesh as mesh_lib
    from histeve_jax.train import optimizer as optimizer_lib
    from histeve_jax.train import setup
    from histeve_jax.train import state as state_lib
    from histeve_jax.train.checkpoint import Checkpointer
    from histeve_jax.train.specs import RunSpec

    demos = os.path.join(workdir, "data", "train")
    synthetic.write_demo_dataset(demos, episodes=4, length=8, seed=0)
    c = imitation.get_config("tiny")
    c.data.train_dirs = demos
    c.eval.enabled = False
    spec = RunSpec.from_config(c, workdir)
    tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
    mesh = mesh_lib.mesh_from_config(spec.mesh)
    state, _ = state_lib.create_train_state(setup.policy_stage(spec).init_model, tx, mesh, axes.RULES)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(spec.config_json())
    with Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False) as ck:
        ck.save(1, state, config=spec.config)
    return workdir


# -- the learner as N processes -----------------------------------------------------------------------------

@dataclasses.dataclass
class LearnerJob:
    """N learner processes of one run (its workdir), their logs and the coordinator's port."""

    workdir: str
    procs: list[subprocess.Popen]
    logs: list[str]

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def kill(self) -> None:
        """SIGKILL every process still running."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=60)

    def wait(self, timeout_s: float) -> None:
        """Until every process exits; raises with the logs' tails if one fails or the time runs out."""
        deadline = time.monotonic() + timeout_s
        try:
            for p in self.procs:
                p.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"learner {self.workdir}: not done within {timeout_s:.0f} s\n"
                               f"{self.tails()}") from None
        if any(p.returncode != 0 for p in self.procs):
            raise RuntimeError(f"learner {self.workdir}: exit codes {[p.returncode for p in self.procs]}\n"
                               f"{self.tails()}")

    def tails(self) -> str:
        out = []
        for log in self.logs:
            with open(log) as f:
                out.append(f"== {log}\n{''.join(f.readlines()[-40:])}")
        return "\n".join(out)

    def history(self) -> dict[int, dict[str, float]]:
        """Process 0's logged metrics by step (written when it returns)."""
        with open(os.path.join(self.workdir, "learner_history.json")) as f:
            return {int(k): v for k, v in json.load(f).items()}


def start_learner(train_config: Any, rl: RLSpec, workdir: str, processes: int, devices: int,
                  cache_dir: str) -> LearnerJob:
    """``processes`` learner processes (``python -m histeve_jax.rl.rehearsal learner <spec>``), each with
    ``devices`` CPU devices, joined by jax.distributed on localhost with gloo collectives."""
    os.makedirs(workdir, exist_ok=True)
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_REPO, JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
               JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    procs, logs = [], []
    for i in range(processes):
        cfg = json.loads(train_config.to_json_best_effort())
        cfg["workdir"] = workdir
        cfg["distributed"] = ({"mode": "on", "coordinator_address": f"localhost:{port}",
                               "num_processes": processes, "process_id": i} if processes > 1 else "off")
        spec_path = os.path.join(workdir, f"learner_spec_{i}.json")
        with open(spec_path, "w") as f:
            json.dump({"train": cfg, "rl": dataclasses.asdict(rl)}, f)
        logs.append(os.path.join(workdir, f"learner_{i}.log"))
        with open(logs[-1], "a") as f:  # to a file: a full pipe nobody reads would block the process
            procs.append(subprocess.Popen([sys.executable, "-m", "histeve_jax.rl.rehearsal", "learner",
                                           spec_path], env=env, cwd=_REPO, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
    return LearnerJob(workdir, procs, logs)


def _learner_main(spec_path: str) -> None:
    """One learner process: ``driver.run_learner`` on the spec's train config; process 0 writes the
    logged metrics to ``<workdir>/learner_history.json``."""
    import jax

    from histeve_jax.rl.driver import run_learner

    with open(spec_path) as f:
        d = json.load(f)
    history = run_learner(json.dumps(d["train"]), RLSpec.from_config(d["rl"]))
    if jax.process_index() == 0:
        with open(os.path.join(d["train"]["workdir"], "learner_history.json"), "w") as f:
            json.dump({str(k): v for k, v in history.items()}, f)
    if jax.process_count() > 1:
        jax.distributed.shutdown()


def final_params(workdir: str) -> list[np.ndarray]:
    """The leaves of a learner run's newest checkpoint's params, read in this process."""
    import jax

    from histeve_jax.rl.weights import latest_step, load_params

    step = latest_step(workdir)
    if step is None:
        raise RuntimeError(f"{workdir}: the learner saved no checkpoint")
    return [np.asarray(x) for x in jax.tree.leaves(load_params(workdir, step, None))]


# -- faults on the actors' side ---------------------------------------------------------------------------

class Faults(threading.Thread):
    """During the actors' run: SIGKILL the actor node mid-wave (once a group is written) and have a
    replacement join; then SIGKILL policy server replica 0 once the learner has published weights, and
    record what came back. Started by ``driver.run_actors``' ``on_start``."""

    def __init__(self, cluster: LocalRayCluster, learner_dir: str, actor_cpus: float, deadline: float):
        super().__init__(name="rehearsal-faults", daemon=True)
        self.cluster, self.learner_dir = cluster, learner_dir
        self.actor_cpus, self.deadline = actor_cpus, deadline
        self.runner: Any = None
        self.pool: Any = None
        self.report: dict[str, Any] = {"node_killed": False, "server_killed": False}
        self.done = threading.Event()

    def on_start(self, runner: Any, pool: Any) -> None:
        self.runner, self.pool = runner, pool
        self.start()

    def _mid_wave(self, min_calls: int) -> bool:
        """A wave is being played and its games have asked the servers ``min_calls`` times."""
        r = self.runner
        if r.index <= len(r.outcomes):
            self._calls_at_wave = None
            return False
        calls = sum(len(t) for t in self.pool.request_times())
        if self._calls_at_wave is None:
            self._calls_at_wave = calls
        return calls - self._calls_at_wave >= min_calls

    def _until(self, condition: Any) -> bool:
        self._calls_at_wave = None
        while time.monotonic() < self.deadline and not self.done.is_set():
            if condition():
                return True
            time.sleep(0.05)
        return False

    def run(self) -> None:
        from histeve_jax.rl.weights import latest_step

        try:
            if self._until(lambda: self.runner.written() >= 1 and self._mid_wave(4)):
                in_flight = self.runner.index - len(self.runner.outcomes)
                self.cluster.kill_node("actors")
                self.report.update(node_killed=True, groups_in_flight=in_flight,
                                   groups_before_kill=len(self.runner.outcomes))
                self.cluster.add_node("actors_2", num_cpus=self.actor_cpus)
            if self._until(lambda: (latest_step(self.learner_dir) or 0) >= 1 and self._mid_wave(2)):
                pid = self.pool.pids()[0]
                newest = latest_step(self.learner_dir)
                os.kill(pid, signal.SIGKILL)  # replica 0's process on the inference node
                t0 = time.monotonic()
                version = self.pool.versions()[0]  # waits through Ray's restart of the replica
                self.report.update(server_killed=True, server_pid_before=pid,
                                   server_pid_after=self.pool.pids()[0], newest_step_at_kill=newest,
                                   version_after_restart=version, restart_s=time.monotonic() - t0,
                                   newest_step_after_restart=latest_step(self.learner_dir))
        except Exception as e:  # reported, and the checks below then fail
            self.report["error"] = f"{type(e).__name__}: {e}"


def _shards_whole(rollout_dir: str, group_size: int) -> tuple[int, list[str]]:
    """(group shards, problems): every shard must hold ``group_size`` complete episodes; no ``.tmp``."""
    from histeve_jax.data.records import shard_paths
    from histeve_jax.rl.stream import read_group

    problems = [f for f in os.listdir(rollout_dir) if f.endswith(".tmp")]
    paths = shard_paths(rollout_dir, "group")
    for p in paths:
        eps = read_group(p)
        if len(eps) != group_size or not all(ep[-1].done and [r.step for r in ep] == list(range(len(ep)))
                                             for ep in eps):
            problems.append(os.path.basename(p))
    return len(paths), problems


# -- the whole rehearsal ----------------------------------------------------------------------------------

def _samples_per_s(history: dict[int, dict[str, float]], batch: int) -> float:
    """Learner samples/s over its logged steps after the first (whose rate includes the compile)."""
    rates = [m["steps_per_sec"] for s, m in sorted(history.items())[1:] if "steps_per_sec" in m]
    return float(np.median(rates)) * batch if rates else 0.0


def run_rehearsal(c: Any) -> dict[str, Any]:
    """The rehearsal of ``c`` (``experiments/configs/rl.py:rehearsal``); returns its figures and checks."""
    from histeve_jax.rl.driver import resolve, run_actors
    from histeve_jax.rl.weights import latest_step

    if "rehearsal" not in c:
        raise ValueError("config.rehearsal: missing (run experiments/configs/rl.py:rehearsal)")
    r = RehearsalSpec.from_config(c.rehearsal)
    root = os.path.abspath(c.workdir)
    for sub in ("start", "rollouts", "runs", "cluster"):  # a rehearsal starts from nothing
        shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
    c = copy.deepcopy(c)
    t_start = time.monotonic()
    c.start_run = init_start_run(os.path.join(root, "start"))
    c.rl.rollout_dir = os.path.join(root, "rollouts")
    c.workdir = os.path.join(root, "runs", "live")
    rl, task, live_dir, cfg = resolve(c)
    cache = os.path.join(root, "jax_cache")
    n = r.learner_processes
    out: dict[str, Any] = {"task": task, "learner_processes": n, "batch": rl.batch_size}

    # 1. live: N learner processes and the actors on a 3-node Ray cluster, with faults
    with LocalRayCluster(os.path.join(root, "cluster")) as cluster:
        cluster.start_head(num_cpus=0)
        server = c.server.resource
        cluster.add_node("inference", num_cpus=0,
                         resources={server: float(c.server.replicas)} if server else {})
        cluster.add_node("actors", num_cpus=r.actor_cpus)
        c.ray_address = cluster.address
        os.environ.update(ray_env())  # this driver joins a cluster without token authentication
        live = start_learner(cfg, rl, live_dir, n, r.devices_per_process, cache)
        deadline = time.monotonic() + r.timeout_s
        faults = Faults(cluster, live_dir, r.actor_cpus, deadline)
        try:
            # until the groups are written AND both faults have struck (the server's waits for the
            # learner's first weights; backpressure keeps the actors from running far ahead meanwhile)
            until = lambda runner: runner.written() >= r.groups and not faults.is_alive()
            actors = run_actors(c, rl, task, live_dir, cfg.data.image_size, deadline, until=until,
                                on_start=faults.on_start)
            live.wait(r.timeout_s)  # it drains the groups written, saves its last step and exits
        finally:
            faults.done.set()
            if faults.ident is not None:  # started: an error before the actors began must not be masked
                faults.join(timeout=120)
            live.kill()
    out["actors"] = actors
    out["faults"] = faults.report
    shards, problems = _shards_whole(rl.rollout_dir, rl.loss.group_size)
    out["shards"], out["shard_problems"] = shards, problems
    f = faults.report
    out["actor_node_killed_survived"] = int(
        f["node_killed"] and actors["dropped"] >= 1 and actors["written"] >= r.groups and not problems
        and shards == actors["written"])
    out["server_killed_survived"] = int(
        f["server_killed"] and f["server_pid_after"] != f["server_pid_before"]
        and f["newest_step_at_kill"] <= f["version_after_restart"] <= f["newest_step_after_restart"]
        and f["version_after_restart"] >= 1 and actors["written"] >= r.groups)
    out["act_calls_per_s_per_replica"] = actors["act_calls_per_s"]
    out["live_s"] = time.monotonic() - t_start

    # 2. the 1-process learner on the same shards, in the same order
    t0 = time.monotonic()
    one_dir = os.path.join(root, "runs", "one_process", "learner")
    one = start_learner(cfg, rl, one_dir, 1, r.devices_per_process * n, cache)
    try:
        one.wait(r.timeout_s)
    finally:
        one.kill()
    w_live, w_one = final_params(live_dir), final_params(one_dir)
    out["weight_max_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(w_live, w_one, strict=True))
    out["weight_max_abs"] = max(float(np.abs(a).max()) for a in w_one)
    h_live, h_one = live.history(), one.history()
    common = sorted(set(h_live) & set(h_one))
    out["learner_steps"] = {"live": latest_step(live_dir), "one_process": latest_step(one_dir)}
    out["loss_max_diff"] = max((abs(h_live[s]["loss"] - h_one[s]["loss"]) for s in common), default=-1.0)
    out["learner_samples_per_s_1"] = _samples_per_s(h_one, rl.batch_size)
    out["one_process_s"] = time.monotonic() - t0

    # 3. N processes SIGKILLed after a checkpoint, restarted: the uninterrupted run's weights exactly
    t0 = time.monotonic()
    killed_dir = os.path.join(root, "runs", "killed", "learner")
    job = start_learner(cfg, rl, killed_dir, n, r.devices_per_process, cache)
    try:
        while job.alive() and (latest_step(killed_dir) or 0) < r.kill_after_step:
            if time.monotonic() - t0 > r.timeout_s:
                raise RuntimeError(f"learner {killed_dir}: no step {r.kill_after_step} within "
                                   f"{r.timeout_s:.0f} s\n{job.tails()}")
            time.sleep(0.05)
        killed_alive = job.alive()
    finally:
        job.kill()  # SIGKILL on both hosts: no handler runs, nothing is saved
    out["killed_at_step"] = latest_step(killed_dir)
    resumed = start_learner(cfg, rl, killed_dir, n, r.devices_per_process, cache)
    try:
        resumed.wait(r.timeout_s)
    finally:
        resumed.kill()
    w_resumed = final_params(killed_dir)
    out["resume_exact"] = int(killed_alive and latest_step(killed_dir) == latest_step(live_dir)
                              and all(np.array_equal(a, b) for a, b in zip(w_resumed, w_live, strict=True)))
    out["learner_samples_per_s_2"] = _samples_per_s(resumed.history(), rl.batch_size)
    out["kill_resume_s"] = time.monotonic() - t0
    out["total_s"] = time.monotonic() - t_start
    with open(os.path.join(root, "rehearsal.json"), "w") as fh:
        json.dump(out, fh, indent=2, default=str)
    return out


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "learner":
    _learner_main(sys.argv[2])
