"""Weight sync from the learner to the actors through the learner's orbax checkpoints (Marin's default).

The learner publishes by saving (``train.loop``'s ``checkpoint_every``; orbax commits a step atomically, so
a reader never sees half a step). ``RLPolicyServer`` is the fleet's batching ``PolicyServer`` that, when
asked between episodes (``reload``), loads the newest published step of the learner's workdir into its
policy in place (``nnx.update``: the compiled sampler reads the new values, nothing recompiles). Before the
learner's first save it serves the start run (the reference), whose weights are the learner's step 0. It
also reloads when it starts, so a server restarted after a crash (``rl.serving``) acts with the newest
weights, not the start run's.
"""

from __future__ import annotations

import os
from typing import Any

from flax import nnx

from histeve_jax.eval.policy_agent import PolicyServer


def latest_step(workdir: str) -> int | None:
    """The newest complete checkpoint step of a run's workdir (None: none yet), read without a
    ``CheckpointManager``: a manager opened here would clean up the learner's in-flight (tmp) saves."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckpt_dir) or not os.path.exists(os.path.join(workdir, "config.json")):
        return None
    # orbax writes a step as <step>.orbax-checkpoint-tmp-* and renames it when complete
    steps = [int(n) for n in os.listdir(ckpt_dir) if n.isdigit()
             and os.path.isdir(os.path.join(ckpt_dir, n, "state"))]
    return max(steps) if steps else None


def load_params(workdir: str, step: int, policy: Any) -> Any:
    """The params of ``workdir``'s checkpoint ``step`` in ``policy``'s tree (read-only: no manager)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from histeve_jax.eval.policy_agent import _run_config
    from histeve_jax.parallel import axes
    from histeve_jax.train import optimizer as optimizer_lib
    from histeve_jax.train import setup
    from histeve_jax.train import state as state_lib
    from histeve_jax.train.checkpoint import from_nested_dict, to_nested_dict
    from histeve_jax.train.specs import RunSpec

    spec = RunSpec.from_config(_run_config(workdir), workdir)
    tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    abstract, _ = state_lib.abstract_train_state(setup.policy_stage(spec).init_model, tx, mesh, axes.RULES)
    path = os.path.join(workdir, "checkpoints", str(step), "state")
    restored = ocp.StandardCheckpointer().restore(path, to_nested_dict(abstract))
    return from_nested_dict(restored, abstract).params


class RLPolicyServer(PolicyServer):
    """A ``PolicyServer`` of the start run whose weights follow the learner (run it as a Ray actor)."""

    def __init__(self, start_workdir: str, learner_workdir: str, **kw: Any):
        super().__init__(start_workdir, **kw)
        self.learner_workdir = learner_workdir
        self.policy_step = 0  # the learner step of the weights acting now (start run = step 0)
        self.reload_errors = 0
        self.reload()

    def reload(self) -> int:
        """Load the learner's newest step if it is newer than the acting one; returns the acting step."""
        step = latest_step(self.learner_workdir)
        if step is None or step <= self.policy_step:
            return self.policy_step
        try:
            params = load_params(self.learner_workdir, step, self.loaded.policy)
        except (FileNotFoundError, ValueError, OSError, KeyError):  # deleted by max_to_keep while read
            self.reload_errors += 1
            return self.policy_step
        nnx.update(self.loaded.policy, params)
        self.policy_step = int(step)
        return self.policy_step

    def version(self) -> int:
        """The learner step of the acting weights."""
        return self.policy_step

    def pid(self) -> int:
        """This server's process id (a restarted server has a new one)."""
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this server runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()
