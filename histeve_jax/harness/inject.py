"""Injected failures for the harness's tests and runner: an env wrapper that, once a condition first holds,
takes items from the player's inventory or teleports the player, through the Luanti mod's commands.

An ``Injection`` fires at most once per episode, ``delay`` steps after its ``when`` condition (a harness
condition, ``schemas.evaluate_condition``) first holds, so it lands mid-invocation. The step it fires on
returns the info from before the command; the next step shows its effect. ``fired`` lists what fired
(step, name) for the episode's record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym

from histeve_jax.harness.schemas import evaluate_condition


@dataclasses.dataclass(frozen=True)
class Injection:
    """Take ``take`` (item -> count; more than held takes all) and/or teleport to ``teleport``."""

    name: str
    when: dict[str, Any]
    take: dict[str, int] = dataclasses.field(default_factory=dict)
    teleport: tuple[float, float, float] | None = None
    delay: int = 0


def take_ops(info: Mapping[str, Any], take: Mapping[str, int]) -> list[dict[str, Any]]:
    """Mod commands that remove ``take`` from the inventory slots (last slots first)."""
    ops = []
    left = dict(take)
    slots = list(enumerate(info["inventory_slots"], start=1))
    for slot, s in reversed(slots):
        n = left.get(s["type"], 0)
        if n <= 0:
            continue
        k = min(n, int(s["quantity"]))
        left[s["type"]] = n - k
        rest = int(s["quantity"]) - k
        # An ItemStack(" 0") is the empty stack: set_slot clears the slot that way.
        ops.append({"op": "set_slot", "slot": slot, "item": s["type"] if rest else "", "count": rest})
    return ops


class FailureInjector(gym.Wrapper):
    """Fires ``injections`` into a Luanti env (see the module docstring)."""

    def __init__(self, env: gym.Env, injections: Sequence[Injection]):
        super().__init__(env)
        self.injections = list(injections)
        self.fired: list[dict[str, Any]] = []
        self._armed: dict[str, int] = {}
        self._steps = 0

    def set_injections(self, injections: Sequence[Injection]) -> None:
        """Replace the injections (for the next episode)."""
        self.injections = list(injections)

    def reset(self, **kw: Any):
        self.fired, self._armed, self._steps = [], {}, 0
        return self.env.reset(**kw)

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._steps += 1
        done = {f["name"] for f in self.fired}
        for inj in self.injections:
            if inj.name in done:
                continue
            if inj.name not in self._armed and evaluate_condition(inj.when, info):
                self._armed[inj.name] = self._steps + inj.delay
            if inj.name in self._armed and self._steps >= self._armed[inj.name]:
                ops = take_ops(info, inj.take) if inj.take else []
                if inj.take and not ops:  # nothing to take yet (the items are still on their way): wait
                    continue
                if inj.teleport is not None:
                    ops.append({"op": "set_pos", "pos": [float(v) for v in inj.teleport]})
                if ops:
                    self.env.unwrapped.command(ops)
                self.fired.append({"step": self._steps, "name": inj.name, "ops": ops})
        return obs, reward, terminated, truncated, info


# Open arena cells (x, z) away from the shipped long-horizon tasks' trees and stone fills.
OPEN_SPOTS = ((-8.0, -8.0), (8.0, 9.0), (-9.0, 2.0), (2.0, -9.0), (-5.0, -9.0))
_COUNTERS = ("inventory", "pickup", "craft_item", "mine_block")
# Items the arenas have enough sources for: taking them leaves the goal reachable (iron ore is scarce).
RENEWABLE = ("default:tree", "default:wood", "default:stick", "default:cobble", "default:pick_wood",
             "default:pick_stone", "default:furnace", "default:dirt")


def standard_injections(task: Any, seed: int) -> list[Injection]:
    """The runner's failures for a long-horizon task: once an early subgoal holds, teleport to an open
    cell; once a subgoal with a renewable product holds (not the last: that is the goal), take all of that
    product. Which subgoals, cells and delays: from ``seed``."""
    import numpy as np

    rng = np.random.default_rng([seed, 14])
    goals = [(n, c) for n, c in task.subgoals[:-1] if any(k in c for k in _COUNTERS)]
    if not goals:
        return []
    x, z = OPEN_SPOTS[int(rng.integers(len(OPEN_SPOTS)))]
    first = int(rng.integers(0, max(1, (len(goals) + 1) // 2)))
    out = [Injection("teleport", when=goals[first][1], teleport=(x, 8.5, z), delay=int(rng.integers(3, 30)))]
    renewable = [(n, c) for n, c in goals
                 if all(item in RENEWABLE for k in _COUNTERS for item in c.get(k, {}))]
    if renewable:
        name, check = renewable[int(rng.integers(len(renewable)))]
        take = {item: 99 for k in _COUNTERS for item in check.get(k, {})}
        out.append(Injection(f"take_{name}", when=check, take=take, delay=int(rng.integers(3, 15))))
    return out
