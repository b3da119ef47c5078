"""The pod topology rehearsed on this machine (``python -m experiments.rl --config=...:rehearsal``): the
learner as 2 JAX processes, the actors on a 3-node Ray cluster started with ``ray start`` (the policy server
replicas on the node holding the "accelerator" resource, the games on an actor node), the real game, one
shared directory. The 2-process learner's weights are the 1-process learner's on the same groups; killed on
both hosts and restarted it ends with the uninterrupted run's weights; the actor node killed mid-wave loses
only that wave's groups; a killed server replica comes back with the newest weights."""

import json
import os
import subprocess
import sys

import pytest
from conftest import require_module

pytestmark = [pytest.mark.game, pytest.mark.slow]  # ~10 min on 2 cores: 4 learner runs, 2 games, 3 nodes
# Opt-in: it takes 10-18 minutes of this 2-core machine, past the whole suite's 20-minute budget, and in the
# suite (beside the other worker's game and multi-process tests) it once failed as its actors started.
if os.environ.get("HISTEVE_REHEARSAL") != "1":
    pytest.skip("the pod rehearsal runs with HISTEVE_REHEARSAL=1 (10-18 min on 2 cores)",
                allow_module_level=True)

require_module("ray", "pip install ray")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rehearsal_runs_the_pod_topology_and_survives_its_faults(tmp_path):
    workdir = str(tmp_path / "rehearsal")
    cmd = [sys.executable, "-m", "experiments.rl", "--config=experiments/configs/rl.py:rehearsal",
           f"--config.workdir={workdir}", "--config.rehearsal.groups=2"]
    r = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True, timeout=2400,
                       env=dict(os.environ, PYTHONPATH=_REPO))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    last = r.stdout.strip().splitlines()[-1]
    kv = dict(x.split("=") for x in last.split())
    assert list(kv) == ["learner_processes", "weight_max_diff", "resume_exact", "actor_node_killed_survived",
                        "server_killed_survived"], last
    with open(os.path.join(workdir, "rehearsal.json")) as f:
        report = json.load(f)
    assert kv["learner_processes"] == "2"
    # the same groups in the same order on 1 and on 2 processes: the same weights to float tolerance
    assert float(kv["weight_max_diff"]) <= 1e-5 * report["weight_max_abs"], report
    assert report["learner_steps"]["live"] == report["learner_steps"]["one_process"] >= 2
    assert kv["resume_exact"] == "1", report  # SIGKILLed on both hosts, restarted: bit for bit
    assert report["killed_at_step"] < report["learner_steps"]["live"]
    # the actor node lost mid-wave: its groups dropped, every shard whole, the run went on to its groups
    assert kv["actor_node_killed_survived"] == "1", report
    assert report["actors"]["dropped"] >= 1 and report["shard_problems"] == []
    # replica 0 SIGKILLed: restarted by Ray in a new process, acting with the learner's newest weights
    assert kv["server_killed_survived"] == "1", report
    f = report["faults"]
    assert f["server_pid_after"] != f["server_pid_before"] and f["version_after_restart"] >= 1
    # both replicas served the games routed to them
    assert len(report["act_calls_per_s_per_replica"]) == 2
