"""The learner's grain source over a growing set of branch-group shards, with an exact iterator state.

Actors write each complete group as one shard ``group-<id>-00000.array_record`` (written as ``.tmp`` and
renamed, see ``data.records.ShardWriter``), so a shard that is visible is a whole group. ``GroupStream`` is
a ``grain.DatasetIterator`` whose elements are the batch *plans* of the groups, one per learner step:

* shards are taken in one order that every host follows (``rl.order``: process 0 takes the smallest new
  name and publishes it), and the names taken so far are part of the state, so a restored iterator
  re-reads exactly the shards it had and continues where it stopped, whatever appeared since; when none is
  new it waits (``poll_s``) and ends (``StopIteration``) once the ``DONE`` file says the actors finished,
  or raises after ``timeout_s``;
* a group's RL samples (each step with sampled tokens) are shuffled by a seed and the shard's name, then cut
  into plans of ``rl_rows`` rows (the last one padded); each plan also carries ``pair_units`` DPO pairs of
  the group (every failure paired with a success, on the window from their first divergence), cycling;
* a plan whose group's weights lag the learner by more than ``max_policy_lag`` steps is dropped (the rest of
  that group too) and counted: the staleness bound; the largest lag trained on is reported;
* a shard that does not read or decode is skipped by every host and counted (``rl/bad_shards``).

Every host holds the same plans (windows: the records' encoded frames, not features). ``FeaturizePlan`` (a
grain map) featurizes with ``samples.RLFeaturize`` only the rows of a plan that are this host's rows of the
global batch [GRPO rows | pair rows | ...]; a row that fails is a padding row (mask 0), counted. The state
is a small JSON dict (``get_state``/``set_state``), the same on every host.
"""

from __future__ import annotations

import collections
import json
import os
import zlib
from typing import Any

import grain
import numpy as np
from absl import logging

from histeve_jax.data import pipeline
from histeve_jax.data import records as R
from histeve_jax.losses.rl import RLLossConfig, divergence_window
from histeve_jax.parallel import multihost
from histeve_jax.rl.order import GroupOrder
from histeve_jax.rl.samples import RLFeaturize

STATUS_FILE = "learner_status.json"


def read_group(path: str) -> list[list[R.StepRecord]]:
    """The episodes of one group shard, in order; raises ``RecordError`` if any record does not decode."""
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(path)
        n = reader.num_records()
        blobs = reader.read(list(range(n))) if n else []
        reader.close()
    except Exception as e:  # array_record raises RuntimeError / OSError variants on a corrupt file
        raise R.RecordError(f"{path}: does not read ({type(e).__name__}: {e})") from e
    if not blobs:
        raise R.RecordError(f"{path}: no records")
    episodes: dict[str, list[R.StepRecord]] = {}
    for b in blobs:
        rec = R.deserialize(b)
        episodes.setdefault(rec.episode_id, []).append(rec)
    return list(episodes.values())


def _window(episode: list[R.StepRecord], step: int, history: int, stride: int,
            in_regime: bool = False) -> dict[str, Any]:
    """Step ``step``'s window, as ``pipeline.WindowSource`` builds it and the actor's ``FrameHistory`` did."""
    rec = episode[step]
    reach = pipeline.history_reach(step, history, stride, in_regime, lambda b: episode[step - b].is_gui_open)
    frames = [episode[step - min(k * stride, reach)].frame for k in range(history, -1, -1)]
    d = {f: getattr(rec, f) for f in ("instruction", "subtask", "action", "is_gui_open", "metadata")}
    return {"record": d, "frames": frames}


class GroupPlans:
    """One group's plans (module docstring); a pure function of the group's records and the options."""

    def __init__(self, episodes: list[list[R.StepRecord]], name: str, *, rl_rows: int, pair_units: int,
                 history: int, stride: int, seed: int, loss: RLLossConfig, in_regime: bool = False):
        rows = [(e, s) for e, ep in enumerate(episodes) for s, r in enumerate(ep)
                if r.metadata.get("action_tokens")]
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        order = rng.permutation(len(rows))
        self.episodes, self.history, self.stride, self.in_regime = episodes, history, stride, in_regime
        self.rl = [rows[i] for i in order]
        self.rl_rows, self.pair_units, self.window = rl_rows, pair_units, loss.dpo_window
        self.n_plans = max(1, -(-len(self.rl) // rl_rows))
        self.policy_step = int(episodes[0][0].metadata.get("policy_step", 0))
        self.units = self._pairs(loss)

    def _pairs(self, loss: RLLossConfig) -> list[list[tuple[int, int, bool]]]:
        def acted(ep):
            return [np.asarray(r.metadata["action_tokens"]) for r in ep if r.metadata.get("action_tokens")]

        wins = [e for e, ep in enumerate(self.episodes) if ep[0].metadata.get("success")]
        fails = [e for e, ep in enumerate(self.episodes) if not ep[0].metadata.get("success")]
        units = []
        for i, f in enumerate(fails if wins else []):
            w = wins[i % len(wins)]
            d = divergence_window(acted(self.episodes[w]), acted(self.episodes[f]), loss)
            if d is None or d.success[0] == d.success[1] or d.failure[0] == d.failure[1]:
                continue
            units.append([(w, s, True) for s in range(*d.success)]
                         + [(f, s, False) for s in range(*d.failure)])
        return units

    def plan(self, b: int) -> dict[str, Any]:
        """Plan ``b``: RL windows (None = padding), pair windows with pair index and side."""
        rl = [self._w(e, s) for e, s in self.rl[b * self.rl_rows:(b + 1) * self.rl_rows]]
        rl += [None] * (self.rl_rows - len(rl))
        pair_w, pair_id, chosen = [], [], []
        for u in range(self.pair_units):
            rows = self.units[(b * self.pair_units + u) % len(self.units)] if self.units else []
            for e, s, side in rows:
                pair_w.append(self._w(e, s))
                pair_id.append(u)
                chosen.append(side)
            pad = 2 * self.window - len(rows)
            pair_w += [None] * pad
            pair_id += [-1] * pad
            chosen += [False] * pad
        return {"rl": rl, "pair": pair_w, "pair_id": np.asarray(pair_id, np.int32),
                "chosen": np.asarray(chosen, bool), "policy_step": self.policy_step}

    def _w(self, e: int, s: int) -> dict[str, Any]:
        return _window(self.episodes[e], s, self.history, self.stride, self.in_regime)


class GroupStream(grain.DatasetIterator):
    """Batch plans over the group shards of ``directory`` as they appear (module docstring)."""

    def __init__(self, directory: str, *, rl_rows: int, pair_units: int, history: int, stride: int,
                 loss: RLLossConfig, max_policy_lag: int, seed: int = 0, poll_s: float = 1.0,
                 timeout_s: float = 3600.0, in_regime: bool = False):
        super().__init__()
        self.directory = directory
        self.opts = dict(rl_rows=rl_rows, pair_units=pair_units, history=history, stride=stride, seed=seed,
                         loss=loss, in_regime=in_regime)
        self.max_policy_lag = max_policy_lag
        self.order = GroupOrder(directory, poll_s=poll_s, timeout_s=timeout_s)
        self.shards: list[str] = []  # basenames of the groups taken, in the order decided (rl.order)
        self.skipped: list[int] = []  # positions in shards of those that did not read
        self.index = -1  # into shards: the group being read
        self.plan_index = 0
        self.step = 0  # learner steps served (the step whose update a plan feeds is step + 1)
        self.counts: collections.Counter = collections.Counter()
        self.max_lag = 0
        self._group: GroupPlans | None = None

    # ------------------------------------------------------------------ shards

    def _read(self, name: str) -> GroupPlans | None:
        try:
            return GroupPlans(read_group(os.path.join(self.directory, name)), name, **self.opts)
        except (R.RecordError, KeyError, IndexError) as e:
            logging.warning("rl stream: group shard %s does not read: %s", name, e)
            return None

    def _next_group(self) -> None:
        """Advance to the next readable group of the agreed order, waiting for one to appear."""
        while True:
            try:
                name, group = self.order.next(self.shards, self._read)
            except StopIteration:
                self._write_status(done=True)
                raise
            self.shards.append(name)
            self.index, self.plan_index, self._group = len(self.shards) - 1, 0, group
            if group is None:
                self.skipped.append(self.index)
                self.counts["bad_shards"] += 1
                continue
            self.counts["groups"] += 1
            self._write_status()
            return

    def _write_status(self, done: bool = False) -> None:
        if not self.order.primary:  # one writer of the shared file; every host's stream is the same
            return
        path = os.path.join(self.directory, STATUS_FILE)
        try:
            with open(path + ".tmp", "w") as f:
                json.dump({"step": self.step, "groups_read": self.index + 1, "done": done,
                           "max_policy_lag": self.max_lag, **self.counts}, f)
            os.replace(path + ".tmp", path)
        except OSError:  # a status for the actors' backpressure only; the learner does not depend on it
            pass

    # ------------------------------------------------------------------ iteration

    def __next__(self) -> dict[str, Any]:
        while True:
            if self._group is None or self.plan_index >= self._group.n_plans:
                self._next_group()
            g = self._group
            lag = self.step - g.policy_step
            if lag > self.max_policy_lag:  # the rest of this group is staler still
                self.counts["stale_groups"] += 1
                self.counts["stale_plans"] += g.n_plans - self.plan_index
                self.plan_index = g.n_plans
                continue
            plan = g.plan(self.plan_index)
            self.plan_index += 1
            self.step += 1
            self.max_lag = max(self.max_lag, lag)
            plan["lag"] = lag
            return plan

    def get_state(self) -> dict[str, Any]:
        return {"shards": list(self.shards), "skipped": list(self.skipped), "index": self.index,
                "plan_index": self.plan_index, "step": self.step, "counts": dict(self.counts),
                "max_lag": self.max_lag}

    def set_state(self, state: dict[str, Any]) -> None:
        self.index, self.plan_index = int(state["index"]), int(state["plan_index"])
        self.shards = list(state["shards"])[: self.index + 1]
        self.skipped = [int(i) for i in state.get("skipped", [])]
        self.step, self.max_lag = int(state["step"]), int(state["max_lag"])
        self.counts = collections.Counter({k: int(v) for k, v in state["counts"].items()})
        self._group = None
        if self.index >= 0 and self.index not in self.skipped:
            self._group = self._read(self.shards[self.index])
            if self._group is None:  # read before the checkpoint: the continuation would not be the same
                raise R.RecordError(f"{self.directory}/{self.shards[self.index]}: the group being read at "
                                    "the checkpoint does not read now")


class GroupDataset(grain.IterDataset):
    """The ``IterDataset`` whose iterator is a ``GroupStream`` (so grain transforms chain onto it)."""

    def __init__(self, directory: str, **kw: Any):
        super().__init__()
        self.directory, self.kw = directory, kw

    def __iter__(self) -> GroupStream:
        return GroupStream(self.directory, **self.kw)


class FeaturizePlan(grain.transforms.Map):
    """A plan's windows -> stacked arrays [rows, ...] (``RLFeaturize``) of the rows ``rows`` of the global
    batch [GRPO rows | pair rows | ...] (None: all of them); failed or padding rows are zeros with mask 0,
    and ``n_bad`` counts the failures."""

    def __init__(self, spec: pipeline.FeatureSpec, rows: slice | None = None):
        self.featurize = RLFeaturize(spec)
        self.rows = rows
        h, w = spec.image_size
        n_img, p = spec.num_images, spec.patches_per_image
        L = spec.max_len
        self._pad = {"input_ids": np.zeros(L, np.int32), "attention_mask": np.zeros(L, np.int32),
                     "targets": np.zeros(L, np.int32), "loss_mask": np.zeros(L, np.float32),
                     "pixel_values": np.zeros((n_img * p, 1176), np.float32),
                     "image_grid_thw": np.tile(np.asarray([1, h // 14, w // 14], np.int32), (n_img, 1)),
                     "regime": np.asarray(0, np.int32), "behaviour_logp": np.zeros(L, np.float32),
                     "advantage": np.asarray(0.0, np.float32)}

    def _rows(self, windows: list[Any]) -> tuple[dict[str, np.ndarray], int, np.ndarray]:
        rows, bad, real = [], 0, []
        for w in windows:
            x = self.featurize.map(w) if w is not None else None
            if x is not None and pipeline.BAD in x:
                bad += 1
                x = None
            rows.append(self._pad if x is None else x)
            real.append(x is not None)
        if not rows:  # none of this host's rows in this section
            return {k: np.zeros((0, *v.shape), v.dtype) for k, v in self._pad.items()}, 0, np.zeros(0, bool)
        return {k: np.stack([r[k] for r in rows]) for k in self._pad}, bad, np.asarray(real, bool)

    def map(self, plan: dict[str, Any]) -> dict[str, Any]:
        sizes = (len(plan["rl"]), len(plan["pair"]))
        rows = slice(0, sum(sizes)) if self.rows is None else self.rows
        rl_sel, pair_sel = multihost.section_rows(rows, sizes)
        rl, bad_rl, real_rl = self._rows(plan["rl"][rl_sel])
        pair, bad_pair, real_pair = self._rows(plan["pair"][pair_sel])
        return {"rl": rl, "pair": pair, "rl_real": real_rl, "chosen": plan["chosen"][pair_sel] & real_pair,
                "pair_id": np.where(real_pair, plan["pair_id"][pair_sel], -1), "n_bad": bad_rl + bad_pair,
                "lag": plan["lag"], "policy_step": plan["policy_step"]}
