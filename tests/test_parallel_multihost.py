"""Multi-host: pod detection from the environment, and two real processes (4 CPU devices each, gloo
collectives) that each load only their rows yet train on one global batch and save one checkpoint."""

import os
import socket
import subprocess
import sys

import pytest

from histeve_jax.parallel import multihost

WORKER = "HISTEVE_MULTIHOST_WORKER"


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, False),
        ({"TPU_WORKER_HOSTNAMES": "t1v-n-0"}, False),  # a single-host TPU VM
        ({"TPU_WORKER_HOSTNAMES": "t1v-n-0,t1v-n-1,t1v-n-2,t1v-n-3"}, True),  # a v5p-32 slice
        ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080"}, True),  # multi-slice
        ({"SLURM_NTASKS": "1"}, False),
        ({"SLURM_NTASKS": "16"}, True),
    ],
)
def test_pod_is_detected_from_the_environment(env, expected):
    assert multihost.on_pod(env) is expected


def test_initialize_off_or_single_host_does_nothing(monkeypatch):
    for name in ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    assert multihost.initialize("off") is False
    assert multihost.initialize("auto") is False
    with pytest.raises(ValueError, match="auto\\|on\\|off"):
        multihost.initialize("yes")


def test_section_rows_cut_a_hosts_rows_along_the_batch_layout():
    # [2 GRPO | 4 pair | 2 replay] rows; 2 hosts of 4 rows each
    sizes = (2, 4, 2)
    assert multihost.section_rows(slice(0, 4), sizes) == [slice(0, 2), slice(0, 2), slice(0, 0)]
    assert multihost.section_rows(slice(4, 8), sizes) == [slice(2, 2), slice(2, 4), slice(0, 2)]
    assert multihost.section_rows(slice(0, 8), sizes) == [slice(0, 2), slice(0, 4), slice(0, 2)]
    # every row of the batch lands in exactly one host's part of one section
    for hosts in (1, 2, 4, 8):
        n = 8 // hosts
        parts = [multihost.section_rows(slice(h * n, (h + 1) * n), sizes) for h in range(hosts)]
        for i, size in enumerate(sizes):
            covered = [r for p in parts for r in range(size)[p[i]]]
            assert covered == list(range(size))


def _worker(process_id: int, port: int, workdir: str) -> None:
    """One host of a 2-host job: local rows -> global batch -> a sharded step and a checkpoint."""
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    assert multihost.initialize(
        "auto", coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id
    )
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from histeve_jax.parallel import axes
    from histeve_jax.parallel import mesh as mesh_lib
    from histeve_jax.train import checkpoint, optimizer
    from histeve_jax.train import state as state_lib
    from histeve_jax.train import step as step_lib

    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
    mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4})
    rules = axes.RULES
    batch_sharding = step_lib.batch_sharding(mesh, rules)
    rows = multihost.process_rows(batch_sharding, 16)
    assert rows == slice(8 * process_id, 8 * process_id + 8)
    full = np.random.RandomState(0).randn(16, 8).astype(np.float32)
    batch = multihost.global_batch({"x": full[rows]}, batch_sharding, 16)  # this host reads only its rows
    assert batch["x"].shape == (16, 8)

    class Linear(nnx.Module):
        def __init__(self, rngs):
            w = nnx.initializers.normal(1.0)(rngs.params(), (8, 4))
            self.w = nnx.Param(w, out_sharding=(axes.EMBED, axes.MLP), eager_sharding=False)

    def loss_fn(model, b, rng):
        return ((b["x"] @ model.w[...]) ** 2).mean(), {}

    tx, _ = optimizer.make_optimizer({"learning_rate": 0.1, "warmup_steps": 0, "total_steps": 10})
    state, shardings = state_lib.create_train_state(lambda: Linear(nnx.Rngs(0)), tx, mesh, rules)
    step = step_lib.jit_train_step(step_lib.make_train_step(loss_fn, tx), shardings, mesh, rules)
    w0 = np.asarray(
        jax.jit(lambda s: s.params["w"][...], out_shardings=NamedSharding(mesh, P()))(state).addressable_data(
            0
        )
    )
    state, metrics = step(state, batch, jax.random.key(0))
    # The loss is over the global batch: both hosts' rows, as one host computing on `full` gets.
    np.testing.assert_allclose(float(metrics["loss"]), float(((full @ w0) ** 2).mean()), rtol=1e-5)
    with checkpoint.Checkpointer(workdir) as ck:  # every host writes its shards
        ck.save(1, state, data_iter_state={"host": process_id})
        target, _ = state_lib.abstract_train_state(lambda: Linear(nnx.Rngs(0)), tx, mesh, rules)
        restored, it, _ = ck.restore(target)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
            np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data))
    assert it == {"host": 0}  # JSON items are written by the primary host
    # The train loop leaves SIGTERM to jax.distributed's preemption notifier on several hosts.
    import signal

    from histeve_jax.train.loop import Preemption

    before = signal.getsignal(signal.SIGTERM)
    assert not Preemption().flag and signal.getsignal(signal.SIGTERM) == before
    jax.distributed.shutdown()
    print(f"worker {process_id} ok")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_hosts_train_on_one_global_batch_and_share_a_checkpoint(tmp_path):
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port), str(tmp_path / "ckpt")],
            env={**env, WORKER: "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out))
    for i, (rc, out) in enumerate(outs):
        assert rc == 0 and f"worker {i} ok" in out, f"worker {i} failed (rc={rc}):\n{out[-4000:]}"


if __name__ == "__main__" and os.environ.get(WORKER) == "1":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
