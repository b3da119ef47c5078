"""Runs on disk as the train loop and ``experiments.detector`` leave them, their weights drawn rather than
trained (no train step to compile): a policy run, and a detector run beside a policy."""

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.configs import detector as detector_configs
from histeve_jax.detector import prune
from histeve_jax.detector.coupled import CoupledDetector
from histeve_jax.detector.model import Detector
from histeve_jax.train import optimizer as optimizer_lib
from histeve_jax.train.checkpoint import Checkpointer
from histeve_jax.train.specs import RunSpec
from histeve_jax.train.state import state_from_model


def save_run(spec, model, step):
    """A run's workdir as the train loop leaves it: its config.json and one checkpoint of the train state."""
    os.makedirs(spec.workdir, exist_ok=True)
    with open(os.path.join(spec.workdir, "config.json"), "w") as f:
        f.write(spec.config_json())
    tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
    state = state_from_model(model, tx).replace(step=jnp.asarray(step, jnp.int32))
    with Checkpointer(os.path.join(spec.workdir, "checkpoints"), async_save=False) as ck:
        ck.save(step, state, config=spec.config, force=True)


def filled(make, seed):
    """The module ``make`` builds, its parameters drawn here (no eager random init: seconds per module on
    CPU): norm scales 1 + noise, so every mapped tensor changes the output, matrices N(0, 0.05^2), biases,
    the head's and the cross-attention's zero-init output projection included, noise."""
    module = nnx.eval_shape(make)
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        a = rng.standard_normal(var.shape)
        a = 1 + 0.3 * a if path[-1] == "scale" else 0.05 * a
        var.set_value(jnp.asarray(a, var.dtype))
    return module


def detector_run(root, name, policy, det_config, seed, threshold=0.375, step=3, **report):
    """A detector run (``experiments.detector``'s layout: <root>/<name>/pruned_x2 and run_x2 with its report)
    beside ``policy``; returns (its run dir, the JAX coupled detector it holds)."""
    detector = filled(lambda: Detector(det_config, rngs=nnx.Rngs(0)), seed)
    prune.save_detector(detector, str(root / name / "pruned_x2"))
    train = detector_configs.get_config("tiny").train
    spec = RunSpec.from_config(train, str(root / name / "run_x2"))
    coupled = CoupledDetector(policy, detector)
    save_run(spec, coupled, step)
    # The report's pruned_dir as a relative --workdir leaves it: found as the run's sibling.
    with open(os.path.join(spec.workdir, "detector_report.json"), "w") as f:
        json.dump({"pruned_dir": f"elsewhere/{name}/pruned_x2", "threshold": threshold, **report}, f)
    return spec.workdir, coupled
