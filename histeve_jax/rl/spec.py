"""Stage 3's options as one typed spec, read once from the ``rl`` group of ``experiments/configs/rl.py``.

Learner side: the batch layout (GRPO rows, DPO pair units, world replay rows), the sampling temperature the
log-probs are computed at, the staleness bound, where the shards and the reference are. Actor side: the
branch group size K (``loss.group_size``), how many groups per wave, the step budget, the backpressure.
The loss hyperparameters are ``losses.rl.RLLossConfig`` and the score weights ``scoring.ScoreConfig``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from histeve_jax.losses.rl import RLLossConfig
from histeve_jax.rl.scoring import ScoreConfig


def config_fields(cls: type, c: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A config group as a plain dict of ``cls``'s fields; an unknown key is a ValueError naming ``where``."""
    d = dict(c.to_dict() if hasattr(c, "to_dict") else c)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(names)}")
    return d


@dataclasses.dataclass(frozen=True)
class RLSpec:
    """Where stage 3 reads and writes, its batch layout, and how actors and learner stay in step."""

    rollout_dir: str  # group shards (a path every host sees)
    reference: str  # the workdir whose latest params are the frozen reference (and the start)
    replay_dirs: tuple[str, ...] = ()  # stage-1/2 shards mixed in as world replay ("": none)
    rl_rows: int = 16  # GRPO rows per batch
    pair_units: int = 1  # DPO pairs per batch (each 2 * loss.dpo_window rows)
    replay_rows: int = 4  # world replay rows per batch
    temperature: float = 1.0  # the actors' sampling temperature (top_p = 1): log-probs are taken at it
    max_policy_lag: int = 160  # learner steps between the weights that acted and the update using them
    poll_s: float = 1.0
    timeout_s: float = 1800.0  # the learner waits this long for a new group before giving up
    seed: int = 0
    # actor side
    groups_per_wave: int = 1  # groups played between weight reloads (all games idle then)
    max_steps: int = 120  # per branch; 0: the task's own budget
    max_backlog_groups: int = 1  # written groups the learner has not started, before actors wait
    loss: RLLossConfig = RLLossConfig()
    score: ScoreConfig = ScoreConfig()

    def __post_init__(self):
        for name in ("rl_rows", "max_policy_lag", "groups_per_wave"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.rl.{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("pair_units", "replay_rows", "max_backlog_groups", "max_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"config.rl.{name} must be >= 0 (got {getattr(self, name)})")
        if self.replay_rows and not self.replay_dirs:
            raise ValueError("config.rl.replay_rows > 0 needs config.rl.replay_dirs (world replay shards)")

    @property
    def pair_rows(self) -> int:
        return 2 * self.loss.dpo_window * self.pair_units

    @property
    def batch_size(self) -> int:
        """Rows of one learner batch: GRPO + DPO + replay."""
        return self.rl_rows + self.pair_rows + self.replay_rows

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> RLSpec:
        """From the ``rl`` ConfigDict: its ``loss`` and ``score`` groups are the two configs' fields."""
        d = config_fields(cls, c, "config.rl")
        try:
            d["loss"] = RLLossConfig(**dict(d.get("loss", {})))
            d["score"] = ScoreConfig(**dict(d.get("score", {})))
        except TypeError as e:
            raise ValueError(f"config.rl.loss / config.rl.score: {e}") from e
        rd = d.get("replay_dirs", ())
        d["replay_dirs"] = tuple(v for v in (rd.split(",") if isinstance(rd, str) else rd) if v)
        return cls(**d)
