"""The RL learner on 2 hosts: 2 JAX processes on localhost (jax.distributed, gloo collectives, 4 CPU devices
each) follow process 0's group order, each featurizes only its rows of the global batch, and they compute the
1-host learner's losses and weights on the same group shards; killed on both hosts and resumed, they end with
exactly the uninterrupted 2-host run's weights."""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from histeve_jax.data import synthetic
from histeve_jax.rl.order import DONE_FILE
from tests import rl_helpers

WORKER = "HISTEVE_RL_MULTIHOST_WORKER"
STEPS, EVERY, KILL = 4, 2, 3
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start_run(root: str) -> None:
    """A tiny imitation run's workdir (config.json, a checkpoint of its initial state): the learner's start
    and its frozen reference, as ``tests/test_rl_learner.py`` builds it."""
    from experiments.configs import imitation
    from histeve_jax.parallel import axes
    from histeve_jax.parallel import mesh as mesh_lib
    from histeve_jax.train import optimizer as optimizer_lib
    from histeve_jax.train import setup
    from histeve_jax.train import state as state_lib
    from histeve_jax.train.checkpoint import Checkpointer
    from histeve_jax.train.specs import RunSpec

    c = imitation.get_config("tiny")
    c.data.train_dirs = os.path.join(root, "demos")
    c.eval.enabled = False
    spec = RunSpec.from_config(c, os.path.join(root, "start"))
    tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
    mesh = mesh_lib.mesh_from_config(spec.mesh)
    state, _ = state_lib.create_train_state(setup.policy_stage(spec).init_model, tx, mesh, axes.RULES)
    os.makedirs(spec.workdir)
    with open(os.path.join(spec.workdir, "config.json"), "w") as f:
        f.write(spec.config_json())
    with Checkpointer(os.path.join(spec.workdir, "checkpoints"), async_save=False) as ck:
        ck.save(1, state, config=spec.config)


def _specs(root: str, run: str, stop_at_step: int):
    from experiments.configs.rl import get_config as rl_config
    from histeve_jax.rl.driver import learner_config
    from histeve_jax.rl.spec import RLSpec
    from histeve_jax.train.specs import RunSpec

    fields = rl_config("tiny").rl.to_dict()
    # 2 GRPO + 4 pair (1 pair, window 2) + 2 replay = 8 rows: host 0 holds GRPO + half the pair rows, host 1
    # the other half and the replay rows
    fields.update(rollout_dir=os.path.join(root, "rollouts"), reference=os.path.join(root, "start"),
                  replay_dirs=os.path.join(root, "demos"), rl_rows=2, replay_rows=2, poll_s=0.05,
                  timeout_s=60.0)
    fields["loss"]["dpo_window"] = 2
    rl = RLSpec.from_config(fields)
    o = {**rl_config("tiny").learner.to_dict(), "num_train_steps": STEPS, "checkpoint_every": EVERY,
         "log_every": 1, "warmup_steps": 1, "stop_at_step": stop_at_step}
    spec = RunSpec.from_config(learner_config(os.path.join(root, "start"), o, rl, os.path.join(root, run)))
    return spec, rl


def _race(root: str) -> list[str]:
    """Process 0 takes the one group shard there, then a group with a smaller name appears, and only then
    does process 1 start its stream: it follows process 0's order, not its own listing (which would put
    the new group first). Returns the names this host's stream took."""
    from jax.experimental import multihost_utils

    from histeve_jax.losses.rl import RLLossConfig
    from histeve_jax.rl.stream import GroupStream

    d = os.path.join(root, "race")

    def stream():
        return GroupStream(d, rl_rows=4, pair_units=1, history=1, stride=2, loss=RLLossConfig(dpo_window=2),
                           max_policy_lag=1000, poll_s=0.02, timeout_s=60.0)

    s = None
    if jax.process_index() == 0:
        s = stream()
        next(s)
        rl_helpers.write_group(d, rl_helpers.group("mine_dirt", 7, [True, False], length=3), "000000-late")
        open(os.path.join(d, DONE_FILE), "w").close()
    multihost_utils.sync_global_devices("rl race: the late group is written")
    s = s or stream()
    with pytest.raises(StopIteration):
        while True:
            next(s)
    return s.shards


def _worker(process_id: int, processes: int, port: int, root: str, phase: str) -> None:
    """``one``: the start run, then the 1-host learner. ``two`` (2 hosts): the order race, the uninterrupted
    learner, then one killed after step KILL. ``resume`` (2 new processes): the killed one resumed."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from histeve_jax.parallel import multihost

    if processes > 1:
        assert multihost.initialize("on", coordinator_address=f"localhost:{port}", num_processes=processes,
                                    process_id=process_id)
    assert (jax.process_count(), jax.device_count()) == (processes, 8)
    from histeve_jax.rl.learner import make_rl_batches, rl_stage
    from histeve_jax.train import loop

    out = {}
    if phase == "one":
        _start_run(root)
    if phase == "two":
        out["race"] = _race(root)
    runs = {"one": [("one", -1)], "two": [("two", -1), ("killed", KILL)], "resume": [("killed", -1)]}[phase]
    for run, stop_at_step in runs:
        spec, rl = _specs(root, run, stop_at_step)
        stage = rl_stage(spec, rl)
        out[run] = {str(k): v for k, v in loop.train(spec, stage).items()}
    out["rows"] = [(r := make_rl_batches(spec, stage, rl, with_reference=False).rows).start, r.stop]
    with open(os.path.join(root, f"{phase}-{process_id}.json"), "w") as f:
        json.dump(out, f)
    if processes > 1:
        jax.distributed.shutdown()
    print(f"worker {process_id} ok")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(processes: int, root: str, phase: str) -> list[dict]:
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_REPO, **{WORKER: "1"})
    env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={8 // processes} "
                        "--xla_backend_optimization_level=0")
    env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(root, "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    logs = [os.path.join(root, f"{phase}-{i}.log") for i in range(processes)]
    procs = []
    for i, log in enumerate(logs):  # to files: a full pipe nobody reads would block that worker
        with open(log, "w") as f:
            cmd = [sys.executable, __file__, str(i), str(processes), str(port), root, phase]
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=400)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        with open(log) as f:
            out = f.read()
        assert p.returncode == 0 and f"worker {i} ok" in out, f"{phase} worker {i} failed:\n{out[-6000:]}"
    results = []
    for i in range(processes):
        with open(os.path.join(root, f"{phase}-{i}.json")) as f:
            results.append(json.load(f))
    return results


def _weights(root: str, run: str, step: int = STEPS) -> list[np.ndarray]:
    """The params of a run's checkpoint ``step``, read in this one process."""
    from histeve_jax.rl.weights import latest_step, load_params

    assert latest_step(os.path.join(root, run)) == step
    return [np.asarray(x) for x in jax.tree.leaves(load_params(os.path.join(root, run), step, None))]


@pytest.mark.slow  # 5 learner runs in 5 processes: 5.5 min measured on 2 CPU cores shared with other work
def test_two_host_learner_is_the_one_host_learner_and_resumes_exactly(tmp_path):
    root = str(tmp_path)
    synthetic.write_demo_dataset(os.path.join(root, "demos"), episodes=4, length=8, seed=0)
    rollouts = os.path.join(root, "rollouts")
    for g in range(2):  # 2 branches x 2 steps = 4 GRPO rows (2 batches) and one DPO pair per group
        eps = rl_helpers.group("mine_dirt", g, [True, False], length=2, diverge=1)
        rl_helpers.write_group(rollouts, eps, f"{g:06d}-t")
    open(os.path.join(rollouts, DONE_FILE), "w").close()
    rl_helpers.write_group(os.path.join(root, "race"),
                           rl_helpers.group("mine_dirt", 8, [True, False], length=3), "000001-early")

    t0 = time.monotonic()
    one = _launch(1, root, "one")[0]
    t1 = time.monotonic()
    two = _launch(2, root, "two")
    t2 = time.monotonic()
    resumed = _launch(2, root, "resume")
    print(f"wall: 1 host {t1 - t0:.0f} s, 2 hosts (whole + killed) {t2 - t1:.0f} s, "
          f"2 hosts resumed {time.monotonic() - t2:.0f} s")

    # process 1 took the groups in process 0's order, though its own listing would have put the late one first
    assert two[0]["race"] == two[1]["race"] == ["group-000001-early-00000.array_record",
                                                "group-000000-late-00000.array_record"]
    assert one["rows"] == [0, 8] and [h["rows"] for h in two] == [[0, 4], [4, 8]]
    # the same losses, step by step, as the 1-host learner: GRPO, DPO, replay and KL over the global batch
    h1, h2 = one["one"], two[0]["two"]
    assert sorted(h1, key=int) == sorted(h2, key=int) == [str(s) for s in range(1, STEPS + 1)]
    keys = ("loss", "grad_norm", "post/grpo", "post/dpo", "post/world", "post/kl", "dpo/n_pairs",
            "world/n_tokens", "grpo/n_tokens", "rl/groups")
    for s in h1:
        for k in keys:
            assert h2[s][k] == pytest.approx(h1[s][k], rel=1e-5, abs=1e-6), (s, k)
            assert two[1]["two"][s][k] == h2[s][k]  # both hosts log the global batch's metrics
    assert h1["1"]["post/kl"] == pytest.approx(0.0, abs=1e-6)  # each host's reference rows are its own
    assert h1["1"]["dpo/n_pairs"] == 1.0 and h1["1"]["world/n_tokens"] > 0 and h1["1"]["grpo/n_tokens"] > 0
    w1, w2 = _weights(root, "one"), _weights(root, "two")
    diff = max(float(np.abs(a - b).max()) for a, b in zip(w1, w2, strict=True))
    scale = max(float(np.abs(a).max()) for a in w1)
    print(f"max |w(1 host) - w(2 hosts)| = {diff:.3g} (max |w| = {scale:.3g})")
    assert diff <= 1e-5 * scale
    learned = zip(_weights(root, "start", 1), w1, strict=True)
    assert any(not np.array_equal(a, b) for a, b in learned)  # the weights moved: the comparison is not void

    # killed after step KILL on both hosts (last checkpoint: step 2), then resumed by 2 new processes: the
    # uninterrupted run's losses and weights exactly
    assert sorted(two[0]["killed"], key=int) == ["1", "2", "3"]
    assert sorted(resumed[0]["killed"], key=int) == ["3", "4"]
    for s in ("3", "4"):
        assert resumed[0]["killed"][s]["loss"] == resumed[1]["killed"][s]["loss"] == h2[s]["loss"]
    for a, b in zip(_weights(root, "killed"), w2, strict=True):
        np.testing.assert_array_equal(a, b)
    for p in range(2):  # each host's iterator state beside the checkpoint: the agreed order of the groups
        with open(os.path.join(root, "killed", "data_state", str(STEPS), f"process_{p}.json")) as f:
            state = json.load(f)["stream"]
        assert state["shards"] == [f"group-00000{g}-t-00000.array_record" for g in range(2)]


if __name__ == "__main__" and os.environ.get(WORKER) == "1":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
