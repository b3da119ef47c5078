"""One train step of the tiny policy (action loss, AdamW) gives the same loss and parameters on every mesh.

The meshes need 8 devices: this file re-runs itself in a subprocess with 8 simulated CPU devices
(``--xla_force_host_platform_device_count`` must be set before jax starts, so not in this process).
"""

import os
import subprocess
import sys

N_DEVICES = 8
IN_CHILD = os.environ.get("HISTEVE_TEST_CPU_DEVICES") == str(N_DEVICES)


def run_in_subprocess_with_cpu_devices(path: str, n: int) -> None:
    env = dict(os.environ, HISTEVE_TEST_CPU_DEVICES=str(n), JAX_PLATFORMS="cpu")
    # Cheaper LLVM passes: the compile, not the run, is what these tests spend their time on.
    fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n} {fast}".strip()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{n}-device run failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"


if not IN_CHILD:

    def test_train_step_on_8_simulated_cpu_devices():
        run_in_subprocess_with_cpu_devices(__file__, N_DEVICES)

else:
    import jax
    import numpy as np
    import pytest
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from histeve_jax import policy as policy_lib
    from histeve_jax.parallel import axes, sharding
    from histeve_jax.parallel import mesh as mesh_lib
    from histeve_jax.train import optimizer
    from histeve_jax.train import state as state_lib
    from histeve_jax.train import step as step_lib

    CONFIG = policy_lib.tiny_config(history_frames=1, image_size=(56, 56))
    # Adam's first update is lr * g / (|g| + eps): with the usual eps=1e-8 it is ~lr * sign(g), so the
    # reduction-order noise (~1e-9) of a near-zero gradient flips whole lr-sized steps. A large eps makes the
    # update a smooth function of the gradient (slope lr/eps = 1), so parameters compare as tightly as
    # gradients do and a wrong gradient shows.
    OPT = {"learning_rate": 1e-3, "eps": 1e-3, "warmup_steps": 0, "total_steps": 10, "weight_decay": 0.1}
    MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
    ATOL = 1e-5  # parameters after the step, every mesh against one device

    def policy_batch(config: policy_lib.PolicyConfig, B: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
        """Two frames, a short instruction, then an action reply; targets are the next tokens."""
        rs = np.random.RandomState(seed)
        base = config.base
        n_img_tok = config.patches_per_image // base.vision.spatial_merge_size**2
        frame = [base.vision_start_token_id] + [base.image_token_id] * n_img_tok + [base.vision_end_token_id]
        prompt = frame * config.num_frames + list(rs.randint(0, 290, 4))
        n_reply = 9
        ids = np.zeros((B, len(prompt) + n_reply), np.int32)
        ids[:, : len(prompt)] = prompt
        ids[:, len(prompt) :] = rs.choice(config.vocab.ids, (B, n_reply))
        targets = np.concatenate([ids[:, 1:], np.zeros((B, 1), np.int32)], axis=1)
        loss_mask = np.zeros(ids.shape, np.float32)
        loss_mask[:, len(prompt) - 1 : -1] = 1.0
        n_patch = config.num_frames * config.patches_per_image
        return {
            "input_ids": ids,
            "attention_mask": np.ones(ids.shape, np.int32),
            "targets": targets,
            "loss_mask": loss_mask,
            "regime": rs.randint(0, 2, (B,)).astype(np.int32),
            "pixel_values": rs.randn(B, n_patch, base.vision.patch_dim).astype(np.float32),
        }

    def make_mesh(shape):
        devices = jax.devices()[: int(np.prod(shape))]
        return mesh_lib.make_mesh(dict(zip(mesh_lib.AXES, shape, strict=True)), devices=devices)

    def livelier(policy: policy_lib.Policy, seed: int = 1) -> policy_lib.Policy:
        """Matrices x5 (std 0.1), noise on norm scales and biases (in place). At the init's std 0.02 the
        attention is nearly uniform, q and k get gradients of ~1e-9 and the vision MLPs ~1e-5: updates no
        comparison at float32 can tell from a wrong gradient."""
        rng = np.random.default_rng(seed)
        params = nnx.state(policy, nnx.Param)
        matrices = dict(nnx.to_flat_state(optimizer.decay_mask(params)))
        for path, var in nnx.to_flat_state(params):
            x = np.asarray(var.get_value())
            noise = 0.1 * rng.standard_normal(x.shape).astype(x.dtype)
            var.set_value(jax.numpy.asarray(x * 5 if matrices[path].get_value() else x + noise))
        nnx.update(policy, params)
        return policy

    @pytest.fixture(scope="module")
    def setup():
        tx, schedule = optimizer.make_optimizer(OPT)
        with nnx.use_eager_sharding(False):
            host_state = state_lib.state_from_model(livelier(policy_lib.Policy(CONFIG, rngs=nnx.Rngs(0))), tx)
        batch = policy_batch(CONFIG)
        train_step = step_lib.make_train_step(policy_lib.action_loss, tx, schedule=schedule)
        rules = axes.RULES
        return host_state, batch, train_step, rules

    def step_on(shape, setup):
        host_state, batch, train_step, rules = setup
        mesh = make_mesh(shape)
        shardings = sharding.tree_shardings(host_state, mesh, rules)
        state = jax.device_put(host_state, shardings)
        step = step_lib.jit_train_step(train_step, shardings, mesh, rules, donate=False)
        new_state, metrics = step(state, batch, jax.random.key(0))
        return new_state, jax.device_get(metrics), shardings

    @pytest.fixture(scope="module")
    def reference(setup):
        return step_on((1, 1, 1), setup)

    def test_every_parameter_gets_a_gradient_update_the_comparison_can_see(setup, reference):
        """AdamW's step is p - lr * (adam(g) + wd * p) (decay on matrices only): weight decay alone moves a
        parameter whose gradient is wrong or zero, so the guard takes it out and asks the gradient's part
        of every parameter's update to exceed 10x the comparison's atol."""
        host_state, *_ = setup
        new_state, metrics, _ = reference
        assert np.isfinite(metrics["loss"]) and metrics["loss"] > 0
        lr, wd = OPT["learning_rate"], OPT["weight_decay"]  # no warm-up: step 0 is at the peak rate
        decayed = dict(nnx.to_flat_state(optimizer.decay_mask(host_state.params)))
        new = dict(nnx.to_flat_state(new_state.params))
        small = {}
        for path, var in nnx.to_flat_state(host_state.params):
            p0, p1 = np.asarray(var.get_value()), np.asarray(new[path].get_value())
            by_grad = p0 - p1 - (lr * wd * p0 if decayed[path].get_value() else 0.0)
            if np.abs(by_grad).max() <= 10 * ATOL:
                small["/".join(map(str, path))] = float(np.abs(by_grad).max())
        assert not small, f"parameters whose gradient barely moves them: {small}"

    @pytest.mark.parametrize("shape", MESHES, ids=lambda s: "data{}_fsdp{}_tensor{}".format(*s))
    def test_step_matches_one_device(shape, setup, reference):
        ref_state, ref_metrics, _ = reference
        new_state, metrics, shardings = step_on(shape, setup)
        for k in ("loss", "action_ce", "grad_norm", "param_norm"):
            np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, err_msg=k)
        assert int(new_state.step) == 1
        flat_ref = dict(nnx.to_flat_state(ref_state.params))
        for path, var in nnx.to_flat_state(new_state.params):
            got, want = np.asarray(var.get_value()), np.asarray(flat_ref[path].get_value())
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg="/".join(map(str, path)))
        # The state really is split as the rules say (not silently replicated).
        gate = new_state.params["model"]["language_model"]["layers"]["mlp"]["gate"].get_value()  # [L, E, F]
        _, fsdp, tensor = shape
        want = [None, "fsdp" if fsdp > 1 else None, "tensor" if tensor > 1 else None]
        while want and want[-1] is None:
            want.pop()
        assert gate.sharding.spec == P(*want)
