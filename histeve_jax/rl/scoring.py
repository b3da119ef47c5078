"""The score R_i of one trajectory from the game's privileged checks, and the branch group's advantages.

R = w_success * certified completion + w_progress * maximum verified progress (the task's subgoals verified
at any step, 1.0 on success; a craft or smelt task without subgoals counts ``grid_progress`` once an item
lay in the crafting grid) - w_steps * steps used / budget - penalties (death, timeout, a GUI left open),
every weight in ``ScoreConfig``. Everything is read from the ``EpisodeResult`` and its step records (the
privileged ``info`` the env reported at each step: success, subgoals, health, the regime), never from pixels.

Group advantages are ``losses.rl.group_advantages`` (the one implementation), applied to a group's scores;
a group whose scores do not spread is uninformative: it is skipped and counted, never written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from histeve_jax.envs.tasks import Task
from histeve_jax.losses.rl import DEFAULT as DEFAULT_LOSS
from histeve_jax.losses.rl import RLLossConfig, group_advantages

GUI_CATEGORIES = ("craft", "smelt")  # tasks that end inside a GUI on success: no GUI-left-open penalty


@dataclasses.dataclass(frozen=True)
class ScoreConfig:
    """Weights of the trajectory score, with why each default.

    success = 1.0: certified completion is what the evaluation counts; every other term is smaller.
    progress = 0.5: a failure that verified more of the task's subgoals beats one that verified fewer, but
      never beats a success (progress <= 1, so a failure scores at most 0.5).
    steps = 0.1: among successes the faster is better (at most 0.1 apart: speed never outweighs success).
    grid_progress = 0.5: the one verified intermediate state of a one-step craft (its ingredient placed in
      the crafting grid, read from the game's inventory lists), half way to the output.
    death = 0.5, timeout = 0.05, gui_open = 0.1: failure penalties; a death is the worst outcome, a
      timeout only marks a failure that ran out the budget (vs one the agent ended), and a GUI left open
      after a non-GUI task (mining, building) leaves the harness's next subtask a screen it cannot play.
    """

    success: float = 1.0
    progress: float = 0.5
    steps: float = 0.1
    death: float = 0.5
    timeout: float = 0.05
    gui_open: float = 0.1
    grid_progress: float = 0.5  # progress (of 1) of a craft/smelt without subgoals once the grid held an item

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"ScoreConfig.{f.name} must be >= 0 (got {getattr(self, f.name)})")


@dataclasses.dataclass(frozen=True)
class Score:
    """One trajectory's score and the terms it is made of."""

    total: float
    success: bool
    progress: float
    steps: int
    budget: int
    died: bool
    timed_out: bool
    gui_left_open: bool

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def trajectory_score(result: Any, task: Task, budget: int, config: ScoreConfig | None = None) -> Score:
    """The score of a finished (not interrupted) ``EpisodeResult`` of ``task`` run with ``budget`` steps."""
    config = config or ScoreConfig()
    if result.interrupted:
        raise ValueError(f"{result.episode_id}: an interrupted episode has no score (its game failed)")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    recs = result.records
    health = [float(r.metadata.get("health", 20.0)) for r in recs]
    died = bool(health) and min(health) <= 0.0
    success = bool(result.success)
    timed_out = not success and not result.error and result.steps >= budget
    gui_left_open = bool(recs) and bool(recs[-1].is_gui_open) and task.category not in GUI_CATEGORIES
    progress = 1.0 if success else float(result.progress)
    if not success and not task.subgoals and task.category in GUI_CATEGORIES:
        if any(int(r.metadata.get("craft_grid", 0)) > 0 for r in recs):
            progress = max(progress, config.grid_progress)
    frac = min(result.steps, budget) / budget
    total = (config.success * success + config.progress * progress - config.steps * frac
             - config.death * died - config.timeout * timed_out - config.gui_open * gui_left_open)
    return Score(total=float(total), success=success, progress=progress, steps=int(result.steps),
                 budget=int(budget), died=died, timed_out=timed_out, gui_left_open=gui_left_open)


@dataclasses.dataclass(frozen=True)
class GroupVerdict:
    """A branch group's advantages [K] and whether it trains (its scores spread)."""

    advantages: np.ndarray
    informative: bool
    mean: float
    std: float


def group_verdict(scores: Sequence[float], loss: RLLossConfig = DEFAULT_LOSS) -> GroupVerdict:
    """``losses.rl.group_advantages`` over one group's scores (all the same group id)."""
    r = np.asarray(scores, np.float32)
    g = group_advantages(r, np.zeros(len(r), np.int32), config=loss)
    return GroupVerdict(advantages=np.asarray(g.advantages, np.float32),
                        informative=bool(g.n_uninformative == 0), mean=float(g.mean[0]), std=float(g.std[0]))
