"""Branch groups on the game fleet: K rollouts from the same s0, scored, written whole or not at all.

A branch group is K episodes of one task reset with one seed: the env rebuilds the same world, pose,
inventory and arena from ``(seed, task)`` (``LuantiEnv.reset``; see ``tests/test_rl_groups.py`` for how
exactly two such resets agree), so the branches differ only by what the behaviour policy samples. The K
episodes are dispatched to the ``Fleet``'s game actors like any others, every game asking its
``RLPolicyServer`` replica (``rl.serving.ServerPool``); between waves of groups (all games idle) the replicas
load the learner's newest step.

A group whose every branch finished is scored (``scoring``); if its scores do not spread it is skipped and
counted, else written as ONE shard (``ShardWriter``: ``.tmp``, renamed when closed) that the learner's
stream picks up. A group with an interrupted branch (its game crashed, its actor was killed: the RL fleet
does not retry, ``max_attempts=1``) is dropped and counted; nothing of it is ever written. Backpressure:
a wave waits while more than ``max_backlog_groups`` written groups are not yet started by the learner.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from histeve_jax.data.records import ShardWriter
from histeve_jax.envs.tasks import load_task
from histeve_jax.eval.fleet import EpisodeSpec
from histeve_jax.rl import scoring
from histeve_jax.rl.order import GROUP_PREFIX
from histeve_jax.rl.samples import group_records
from histeve_jax.rl.spec import RLSpec
from histeve_jax.rl.stream import STATUS_FILE


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One branch group: K branches of ``task`` from the s0 of ``seed``."""

    group_id: str
    task: str
    seed: int
    size: int
    max_steps: int | None = None

    def branches(self) -> list[EpisodeSpec]:
        return [EpisodeSpec(self.task, self.seed, self.max_steps) for _ in range(self.size)]


@dataclasses.dataclass
class GroupOutcome:
    """What became of one group: "written", "skipped" (no spread) or "dropped" (a branch interrupted)."""

    group: GroupSpec
    status: str
    scores: list[float]
    successes: int
    policy_step: int
    path: str = ""
    steps: int = 0


def run_groups(fleet: Any, groups: Sequence[GroupSpec], make_agent: Any, rl: RLSpec, *, policy_step: int,
               writer_dir: str | None = None) -> list[GroupOutcome]:
    """Play ``groups`` on ``fleet`` (branches of all groups interleaved over the games); write each
    informative complete group under ``writer_dir`` (None: write nothing). One outcome per group."""
    by_seed = {g.seed: g for g in groups}
    if len(by_seed) != len(groups):
        raise ValueError("run_groups: groups of one wave need distinct seeds (a result names its seed)")
    results: dict[int, list[Any]] = collections.defaultdict(list)
    specs = [b for g in groups for b in g.branches()]
    for res in fleet.run(specs, make_agent):
        results[res.seed].append(res)
    out = []
    for g in groups:
        rs = results[g.seed]
        if len(rs) != g.size or any(r.interrupted for r in rs):
            out.append(GroupOutcome(g, "dropped", [], sum(r.success for r in rs), policy_step))
            continue
        task = load_task(g.task)
        budget = g.max_steps or task.max_steps
        scores = [scoring.trajectory_score(r, task, budget, rl.score) for r in rs]
        verdict = scoring.group_verdict([s.total for s in scores], rl.loss)
        outcome = GroupOutcome(g, "skipped", [s.total for s in scores], sum(r.success for r in rs),
                               policy_step, steps=sum(r.steps for r in rs))
        if verdict.informative:
            outcome.status = "written"
            if writer_dir is not None:
                episodes = group_records(rs, g.group_id, scores, verdict.advantages, policy_step)
                with ShardWriter(writer_dir, prefix=f"{GROUP_PREFIX}-{g.group_id}",
                                 records_per_shard=1 << 30) as w:  # one shard: the group is one unit
                    for ep in episodes:
                        w.write_episode(ep)
                outcome.path = w.paths[0]
        out.append(outcome)
    return out


def learner_groups_read(rollout_dir: str) -> int:
    """Groups the learner's stream has started (its status file; 0 before it reports)."""
    try:
        with open(os.path.join(rollout_dir, STATUS_FILE)) as f:
            return int(json.load(f)["groups_read"])
    except (OSError, ValueError, KeyError):
        return 0


class GroupRunner:
    """Waves of branch groups of one task until a deadline, weights reloaded between waves; ``servers`` is
    what the games act through (``ServerPool``: its ``reload()`` returns the step acting)."""

    def __init__(self, fleet: Any, servers: Any, make_agent: Any, rl: RLSpec, task: str, *,
                 seed: int = 100_000, actor_id: str = ""):
        self.fleet, self.servers, self.make_agent, self.rl, self.task = fleet, servers, make_agent, rl, task
        self.next_seed = seed
        self.actor_id = actor_id or uuid.uuid4().hex[:6]
        self.outcomes: list[GroupOutcome] = []
        self.index = 0
        self.waited_s = 0.0

    def _wait_for_learner(self, deadline: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            written = sum(o.status == "written" for o in self.outcomes)
            if written - learner_groups_read(self.rl.rollout_dir) <= self.rl.max_backlog_groups:
                break
            time.sleep(self.rl.poll_s)
        self.waited_s += time.monotonic() - t0

    def wave(self) -> list[GroupOutcome]:
        """One wave: reload the newest weights, play ``groups_per_wave`` groups, write them."""
        step = self.servers.reload()
        groups = []
        for _ in range(self.rl.groups_per_wave):
            gid = f"{self.index:06d}-{self.actor_id}"
            groups.append(GroupSpec(gid, self.task, self.next_seed, self.rl.loss.group_size,
                                    self.rl.max_steps or None))
            self.index += 1
            self.next_seed += 1
        out = run_groups(self.fleet, groups, self.make_agent, self.rl, policy_step=step,
                         writer_dir=self.rl.rollout_dir)
        self.outcomes.extend(out)
        return out

    def run(self, deadline: float, max_groups: int | None = None,
            until: Callable[[GroupRunner], bool] | None = None) -> dict[str, Any]:
        """Waves until ``deadline`` (time.monotonic), ``max_groups`` groups played or ``until(self)`` holds;
        returns ``summary()``."""
        def more() -> bool:
            return ((max_groups is None or len(self.outcomes) < max_groups)
                    and (until is None or not until(self)))

        while time.monotonic() < deadline and more():
            self._wait_for_learner(deadline)
            if time.monotonic() >= deadline:
                break
            self.wave()
        return self.summary()

    def written(self) -> int:
        """Groups written so far."""
        return sum(o.status == "written" for o in self.outcomes)

    def summary(self) -> dict[str, Any]:
        """Counts: groups played, written, skipped (no spread), dropped (interrupted), successes."""
        c = collections.Counter(o.status for o in self.outcomes)
        branches = sum(len(o.scores) for o in self.outcomes)
        return {"groups": len(self.outcomes), "written": c["written"], "skipped": c["skipped"],
                "dropped": c["dropped"], "branches": branches,
                "successes": sum(o.successes for o in self.outcomes),
                "env_steps": sum(o.steps for o in self.outcomes), "waited_s": self.waited_s,
                "policy_steps": sorted({o.policy_step for o in self.outcomes})}
