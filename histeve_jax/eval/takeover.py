"""DAgger's episodes: the policy plays, then the task's scripted expert takes over from wherever it left.

Behaviour cloning sees only the states the expert visits; the policy's own mistakes (a cursor a slot off, a
stack picked up twice, the inventory closed early) lead to states no demonstration shows, and one wrong
step compounds. DAgger (Ross et al., 2011) labels the states the policy reaches with the expert's actions.
Our experts are scripts with phases and waits, so rather than asking a fresh expert for one action per
visited state (a fresh script would wait forever before each click), the expert takes over at a switch
step drawn per episode and plays to the end: its part is a demonstration that starts in a state of the
policy's making, and only that part is kept (``expert_part``) for training.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import numpy as np

from histeve_jax.envs.experts import expert_for
from histeve_jax.envs.tasks import Task
from histeve_jax.eval.rollout import Agent, AgentFactory, Decision, EpisodeResult

POLICY_SUBTASK = "policy"  # the subtask of the steps the policy acted (the expert's are its phases)


class TakeoverAgent:
    """The policy for ``switch`` steps, then the task's expert (reset on the state it finds) to the end."""

    name = "takeover"

    def __init__(self, policy: Agent, switch: int):
        self.policy, self.switch = policy, int(switch)
        self._task: Task | None = None
        self._expert = None
        self._t = 0

    def reset(self, task: Task, obs: dict, info: dict, seed: int) -> None:
        self.policy.reset(task, obs, info, seed)
        self._task, self._expert, self._t = task, None, 0

    def act(self, obs: dict, info: dict) -> Decision:
        if self._expert is None and self._t < self.switch:
            self._t += 1
            decision = self.policy.act(obs, info)
            return dataclasses.replace(decision, subtask=POLICY_SUBTASK)
        if self._expert is None:
            self._expert = expert_for(self._task)
            self._expert.reset(info)
        action, subtask = self._expert.act(info)
        return Decision(action=action, subtask=subtask)


@dataclasses.dataclass
class TakeoverFactory:
    """``make_agent(task_name, seed)`` for the fleet: the switch step is drawn from (seed, episode seed),
    uniform in ``[min_switch, max_switch]``."""

    policy: AgentFactory
    min_switch: int
    max_switch: int
    seed: int = 0

    def __call__(self, task_name: str, seed: int) -> TakeoverAgent:
        rng = np.random.default_rng([self.seed, seed])
        switch = int(rng.integers(self.min_switch, self.max_switch + 1))
        return TakeoverAgent(self.policy(task_name, seed), switch)


def expert_part(result: EpisodeResult) -> list:
    """The records of ``result`` from the expert's first step on, as a demonstration of their own (kind
    "demo", a new episode id, steps from 0, ``metadata["takeover_at"]``: the policy's steps before it); []
    when the expert never acted (the policy finished, or the episode ended)."""
    records = result.records
    first = next((i for i, r in enumerate(records[:-1]) if r.subtask != POLICY_SUBTASK), None)
    if first is None:
        return []
    episode_id = f"{result.task}-{result.seed}-takeover-{uuid.uuid4().hex[:8]}"
    return [dataclasses.replace(r, episode_id=episode_id, step=i, kind="demo",
                                metadata={**r.metadata, "takeover_at": first})
            for i, r in enumerate(records[first:])]


def switch_of(result: EpisodeResult) -> int:
    """How many steps the policy acted before the expert took over (all of them if it never did)."""
    return sum(r.subtask == POLICY_SUBTASK for r in result.records)


def summary_row(results: list[EpisodeResult], kept: int) -> dict[str, Any]:
    """Per task: episodes played, successes (the policy's alone or the expert's after it took over),
    episodes kept, the mean switch step, and why the expert gave up where it did."""
    done = [r for r in results if not r.interrupted]
    return {"episodes": len(done), "successes": sum(r.success for r in done), "kept": kept,
            "mean_switch": float(np.mean([switch_of(r) for r in done])) if done else 0.0,
            "interrupted": len(results) - len(done), "errors": [r.error for r in done if r.error]}
