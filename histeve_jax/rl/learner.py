"""The learner of stage 3: the shared train loop (``train.loop.train``) with the RL ``Stage``.

``rl_stage(spec, rl)`` is the policy stage with ``rl.loss.rl_loss`` as its loss and ``RLBatches`` as its
batch source: the group stream (``rl.stream``, GRPO rows and DPO pairs of the actors' groups) and the world
replay rows (stage-1/2 shards through ``data.pipeline.make_batches``) side by side in each batch, and the
frozen reference's log-probs added to the batch before the step (as Tunix does), so the step stays a pure
function of (state, batch). The reference is the start run's params restored into the policy's own
shardings, with no optimizer state; it runs under jit with those shardings on the loop's mesh.

Weights reach the actors through the loop's own orbax checkpoints (``checkpoint_every`` steps): an actor
loads a newer step between episodes (``rl.weights``). The iterator's state (stream position, replay grain
state, counters) is saved with every checkpoint, so a killed learner resumes exactly.

On N hosts (one jax multi-controller job) every host runs the same iterator: all take the groups in the one
order process 0 decides (``rl.order``), each featurizes only its rows of each global batch (the loop's batch
sharding, ``parallel.multihost.process_rows``), and the reference's forward takes the global batch. The
loop saves each host's iterator state beside the checkpoint (``train.data.save_host_iterator_state``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from histeve_jax.data import pipeline
from histeve_jax.parallel import axes, multihost
from histeve_jax.parallel import mesh as mesh_lib
from histeve_jax.rl.loss import reference_log_probs, rl_loss
from histeve_jax.rl.spec import RLSpec
from histeve_jax.rl.stream import FeaturizePlan, GroupDataset
from histeve_jax.train import optimizer as optimizer_lib
from histeve_jax.train import setup
from histeve_jax.train import state as state_lib
from histeve_jax.train import step as step_lib
from histeve_jax.train.specs import RunSpec

RL_KEYS = ("behaviour_logp", "advantage", "rl_row", "pair", "chosen", "replay_row", "ref_logp")
_REF_KEYS = ("input_ids", "attention_mask", "targets", "loss_mask", "regime", "pixel_values")


class Reference:
    """The frozen reference policy: params only (no optimizer state), sharded like the policy's, and its
    jitted log-probs of the global batch, each host giving and getting back its own rows."""

    def __init__(self, spec: RunSpec, stage: setup.Stage, rl: RLSpec, mesh: Any, rules: Any):
        tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
        abstract, shardings = state_lib.abstract_train_state(stage.init_model, tx, mesh, rules)
        self.params = setup.restore_params(rl.reference, abstract, what="config.rl.reference")
        self.graphdef, self.rest = abstract.graphdef, jax.tree.map(lambda x: x, abstract.rest)
        self.shardings = shardings.params
        self.batch_sharding = step_lib.batch_sharding(mesh, rules)
        self.global_size = rl.batch_size
        self.rows = multihost.process_rows(self.batch_sharding, rl.batch_size)

        def logp(params: Any, batch: dict[str, Any]) -> jax.Array:
            with axes.activate(mesh, rules):
                return reference_log_probs(nnx.merge(self.graphdef, params, self.rest), batch, rl.temperature)

        self._fn = jax.jit(logp, in_shardings=(shardings.params, self.batch_sharding),
                           out_shardings=NamedSharding(mesh, PartitionSpec()))

    def __call__(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """This host's rows [rows, ...] of the global batch -> their [rows, K] float32 reference log-probs
        of the gathered targets (the forward runs on the global batch, on every host at once)."""
        local = {k: batch[k] for k in _REF_KEYS}
        out = self._fn(self.params, multihost.global_batch(local, self.batch_sharding, self.global_size))
        return np.asarray(out.addressable_data(0))[self.rows]  # replicated: a whole copy on every device


def _replay_extra(n: int, L: int) -> dict[str, np.ndarray]:
    return {"behaviour_logp": np.zeros((n, L), np.float32), "advantage": np.zeros(n, np.float32)}


class RLBatches:
    """This host's rows ``rows`` of the mixed global batches [GRPO rows | DPO pair rows | replay rows] plus
    ``ref_logp``; the loop's iterator (``get_state``/``set_state``/``metrics``). ``stream`` yields this
    host's GRPO and pair rows (``FeaturizePlan(rows=rows)``); ``replay`` the whole replay part, the same on
    every host, of which each keeps its rows. ``reference=None`` fills ``ref_logp`` with zeros (tests)."""

    def __init__(self, stream: Any, replay: pipeline.Batches | None, reference: Reference | None, rl: RLSpec,
                 rows: slice | None = None):
        self.stream, self.replay, self.reference, self.rl = stream, replay, reference, rl
        self.rows = slice(0, rl.batch_size) if rows is None else rows
        self.bad_rows = 0
        self.last_lag = 0

    def __iter__(self) -> RLBatches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        x = next(self.stream)
        self.bad_rows += int(x["n_bad"])
        self.last_lag = int(x["lag"])
        rl, pair = x["rl"], x["pair"]
        n_rl, n_pair = len(x["rl_real"]), len(x["pair_id"])
        parts = [rl, pair]
        flags = {"rl_row": [x["rl_real"], np.zeros(n_pair, bool)],
                 "pair": [np.full(n_rl, -1, np.int32), x["pair_id"]],
                 "chosen": [np.zeros(n_rl, bool), x["chosen"]],
                 "replay_row": [np.zeros(n_rl, bool), np.zeros(n_pair, bool)]}
        if self.replay is not None:
            mine = multihost.section_rows(self.rows, (self.rl.rl_rows, self.rl.pair_rows,
                                                      self.rl.replay_rows))[2]
            rep = next(self.replay)  # every host advances it: one replay state, whatever its rows
            n = len(rep["input_ids"][mine])
            rep = {**{k: rep[k][mine] for k in rl if k in rep}, **_replay_extra(n, rep["input_ids"].shape[1])}
            parts.append(rep)
            flags["rl_row"].append(np.zeros(n, bool))
            flags["pair"].append(np.full(n, -1, np.int32))
            flags["chosen"].append(np.zeros(n, bool))
            flags["replay_row"].append(np.ones(n, bool))
        batch = {k: np.concatenate([p[k] for p in parts]) for k in rl}
        batch.update({k: np.concatenate(v) for k, v in flags.items()})
        if len(batch["input_ids"]) != self.rows.stop - self.rows.start:
            raise ValueError(f"{len(batch['input_ids'])} rows made for this host's {self.rows}")
        if self.reference is not None:
            batch["ref_logp"] = self.reference(batch)
        else:
            batch["ref_logp"] = np.zeros((len(batch["input_ids"]), 1), np.float32)
        return batch

    def _stream_iter(self) -> Any:
        it = self.stream
        while not hasattr(it, "counts"):  # grain's map iterator over the GroupStream
            it = it._parent
        return it

    def metrics(self) -> dict[str, float]:
        s = self._stream_iter()
        c = collections.Counter(s.counts)
        out = {"rl/groups": float(c["groups"]), "rl/stale_groups": float(c["stale_groups"]),
               "rl/stale_plans": float(c["stale_plans"]), "rl/bad_shards": float(c["bad_shards"]),
               "rl/bad_rows": float(self.bad_rows), "rl/policy_lag": float(self.last_lag),
               "rl/max_policy_lag": float(s.max_lag)}
        if self.replay is not None:
            out.update({"replay/" + k.split("/", 1)[1]: v for k, v in self.replay.metrics().items()})
        return out

    def get_state(self) -> dict[str, Any]:
        return {"stream": self.stream.get_state(), "bad_rows": self.bad_rows,
                "replay": None if self.replay is None else self.replay.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.stream.set_state(state["stream"])
        self.bad_rows = int(state["bad_rows"])
        if self.replay is not None:
            self.replay.set_state(state["replay"])


def make_rl_batches(spec: RunSpec, stage: setup.Stage, rl: RLSpec, *, mesh: Any = None,
                    rules: Any = None, with_reference: bool = True) -> RLBatches:
    """This host's batch iterator: its rows of each global batch under the loop's batch sharding."""
    feats = stage.features
    mesh = mesh if mesh is not None else mesh_lib.mesh_from_config(spec.mesh)
    rules = rules if rules is not None else axes.RULES
    rows = multihost.process_rows(step_lib.batch_sharding(mesh, rules), rl.batch_size)
    stream = GroupDataset(rl.rollout_dir, rl_rows=rl.rl_rows, pair_units=rl.pair_units, history=feats.history,
                          stride=feats.stride, loss=rl.loss, max_policy_lag=rl.max_policy_lag, seed=rl.seed,
                          poll_s=rl.poll_s, timeout_s=rl.timeout_s,
                          in_regime=feats.history_in_regime).map(FeaturizePlan(feats, rows))
    replay = None
    if rl.replay_rows:
        opts = pipeline.LoaderOptions(batch_size=rl.replay_rows, seed=spec.data.seed, shuffle=True,
                                      worker_count=0, read_threads=2, shard_index=0, shard_count=1)
        replay = pipeline.make_batches(list(rl.replay_dirs), feats, opts)
    reference = Reference(spec, stage, rl, mesh, rules) if with_reference else None
    return RLBatches(iter(stream), replay, reference, rl, rows)


def rl_stage(spec: RunSpec, rl: RLSpec, cfg: Any = None) -> setup.Stage:
    """The policy stage with the RL loss and batches (``spec.data.batch_size`` must be ``rl.batch_size``;
    ``cfg``: the policy config, default ``setup.policy_config(spec)``)."""
    if spec.data.batch_size != rl.batch_size:
        raise ValueError(f"config.data.batch_size={spec.data.batch_size} must be the RL batch layout's "
                         f"{rl.batch_size} (rl_rows {rl.rl_rows} + pair rows {rl.pair_rows} + replay rows "
                         f"{rl.replay_rows})")
    base = setup.policy_stage(spec, cfg)
    loss = functools.partial(rl_loss, config=rl.loss, temperature=rl.temperature,
                             n_pairs=max(rl.pair_units, 1))
    stage = dataclasses.replace(base, name="rl", loss_fn=loss, device_keys=setup.POLICY_KEYS + RL_KEYS)

    def batches(dirs: list[str], data: Any, train: bool) -> RLBatches:
        del dirs, data
        if not train:
            raise ValueError("the RL stage has no held-out split: set eval_every=0")
        return make_rl_batches(spec, stage, rl)

    return dataclasses.replace(stage, batches=batches)
