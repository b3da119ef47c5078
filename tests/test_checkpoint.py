"""Checkpoints: exact round trip of train state, data-iterator state and config; restore onto another mesh.

The cross-mesh case needs 8 devices, so it re-runs this file in a subprocess with 8 simulated CPU devices.
"""

import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from histeve_jax.parallel import axes
from histeve_jax.train import checkpoint, optimizer
from histeve_jax.train import state as state_lib

N_DEVICES = 8
IN_CHILD = os.environ.get("HISTEVE_TEST_CPU_DEVICES") == str(N_DEVICES)


class Small(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(1.0)
        self.w = nnx.Param(
            init(rngs.params(), (8, 16)), out_sharding=(axes.EMBED, axes.MLP), eager_sharding=False
        )
        self.scale = nnx.Param(
            np.ones((2, 8), np.float32), out_sharding=(axes.REGIME, axes.NORM), eager_sharding=False
        )


def perturbed(state):
    """A state whose every leaf differs from its fresh value (step, params, Adam's count and moments), so a
    restore that handed back any fresh or target value instead of the saved one cannot pass."""
    bump = lambda x: x + jax.numpy.asarray(3, x.dtype)
    return state.replace(step=state.step + 7, params=jax.tree.map(bump, state.params),
                         opt_state=jax.tree.map(bump, state.opt_state))


def assert_every_leaf_differs(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert not np.any(np.asarray(x) == np.asarray(y)), "a saved leaf equals its fresh value"


def assert_same_leaves(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def run_in_subprocess_with_cpu_devices(path: str, n: int) -> None:
    env = dict(os.environ, HISTEVE_TEST_CPU_DEVICES=str(n), JAX_PLATFORMS="cpu")
    fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n} {fast}".strip()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "mesh", path]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{n}-device run failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"


if not IN_CHILD:

    def test_restore_onto_another_mesh_on_8_simulated_cpu_devices():
        run_in_subprocess_with_cpu_devices(__file__, N_DEVICES)

    @pytest.fixture
    def small_state():
        tx, _ = optimizer.make_optimizer({"warmup_steps": 0, "total_steps": 10})
        st = state_lib.state_from_model(Small(nnx.Rngs(0)), tx)
        return perturbed(st), lambda: state_lib.state_from_model(Small(nnx.Rngs(1)), tx)

    def test_state_iterator_and_config_round_trip_exactly(tmp_path, small_state):
        st, fresh = small_state
        assert_every_leaf_differs(st, fresh())
        cfg = ml_collections.ConfigDict({"optimizer": {"learning_rate": 1e-5}, "mesh": {"ici": {"fsdp": -1}}})
        with checkpoint.Checkpointer(tmp_path / "ckpt") as ck:
            assert ck.save(7, st, data_iter_state={"next_index": 12, "epoch": 1}, config=cfg)
            like = jax.eval_shape(fresh)
            restored, it, saved_cfg = ck.restore(like)
        assert_same_leaves(restored, st)
        assert int(restored.step) == int(st.step)
        assert it == {"next_index": 12, "epoch": 1}
        assert saved_cfg == cfg.to_dict()

    def test_grain_iterator_resumes_where_it_stopped(tmp_path, small_state):
        import grain

        st, fresh = small_state
        ds = grain.MapDataset.range(20).shuffle(seed=3).to_iter_dataset()
        it = iter(ds)
        [next(it) for _ in range(5)]
        with checkpoint.Checkpointer(tmp_path / "ckpt") as ck:
            ck.save(5, st, data_iter_state=it.get_state())
            expected = [next(it) for _ in range(5)]
            _, saved, _ = ck.restore(jax.eval_shape(fresh))
        resumed = iter(ds)
        resumed.set_state(saved)
        assert [next(resumed) for _ in range(5)] == expected

    def test_bytes_iterator_state_survives(tmp_path, small_state):
        st, fresh = small_state
        with checkpoint.Checkpointer(tmp_path / "ckpt", async_save=False) as ck:
            ck.save(1, st, data_iter_state=b'{"last_seen_indices": {"0": 4}}')
            _, saved, cfg = ck.restore(jax.eval_shape(fresh))
        assert saved == b'{"last_seen_indices": {"0": 4}}'
        assert cfg is None

    def test_keeps_the_last_n_steps_and_restores_the_latest(tmp_path, small_state):
        st, fresh = small_state
        with checkpoint.Checkpointer(tmp_path / "ckpt", max_to_keep=2) as ck:
            for step in (10, 20, 30):
                ck.save(step, st.replace(step=st.step * 0 + step))
            ck.wait()
            assert ck.all_steps() == [20, 30]
            assert ck.latest_step() == 30
            restored, _, _ = ck.restore(jax.eval_shape(fresh))
            assert int(restored.step) == 30
            with pytest.raises(FileNotFoundError, match="step 10"):
                ck.restore(jax.eval_shape(fresh), step=10)

    def test_empty_directory_has_nothing_to_restore(tmp_path, small_state):
        _, fresh = small_state
        with checkpoint.Checkpointer(tmp_path / "empty") as ck:
            assert ck.latest_step() is None
            with pytest.raises(FileNotFoundError, match="no complete step"):
                ck.restore(jax.eval_shape(fresh))

else:
    from histeve_jax import policy as policy_lib
    from histeve_jax.parallel import mesh as mesh_lib

    def test_save_on_fsdp_mesh_restore_on_mixed_mesh(tmp_path):
        tx, _ = optimizer.make_optimizer({"warmup_steps": 0, "total_steps": 10, "mu_dtype": "bfloat16"})
        config = policy_lib.tiny_config()
        model_fn = lambda: policy_lib.Policy(config, rngs=nnx.Rngs(0))
        rules = axes.RULES
        mesh_a = mesh_lib.make_mesh({"fsdp": 8})
        mesh_b = mesh_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
        with nnx.use_eager_sharding(False):
            fresh = state_lib.state_from_model(model_fn(), tx)  # the restore target's own values
            host = perturbed(fresh)
        assert_every_leaf_differs(host, fresh)
        _, shardings_a = state_lib.abstract_train_state(model_fn, tx, mesh_a, rules)
        saved = jax.device_put(host, shardings_a)
        with checkpoint.Checkpointer(tmp_path / "ckpt") as ck:
            ck.save(3, saved, data_iter_state={"pos": 3})
            target, shardings_b = state_lib.abstract_train_state(model_fn, tx, mesh_b, rules)
            restored, it, _ = ck.restore(target)
        assert it == {"pos": 3}
        assert_same_leaves(restored, host)
        # Every array lands in the new mesh's sharding, e.g. the MLP kernels split over fsdp and tensor.
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings_b), strict=True):
            assert got.sharding == want
        gate = restored.params["model"]["language_model"]["layers"]["mlp"]["gate"].get_value()
        assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
        assert gate.sharding.mesh.shape == mesh_b.shape
        mu = restored.opt_state[1][0].mu["model"]["lm_head"].get_value()
        assert mu.dtype == jax.numpy.bfloat16
