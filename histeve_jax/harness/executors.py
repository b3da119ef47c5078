"""Executors of one subtask invocation: the scripted experts (the harness's upper bound) and a trained policy.

An executor is told the instantiated subtask at the start of each invocation (``start``) and then acts one
step at a time (``act``), returning a ``rollout.Decision``; ``subtask == "done"`` means it has nothing more
to do, a ``RuntimeError`` that it gave up. The expert for a subtask is built from its parameters
(``EXPERT_MAKERS``: the targets of ``envs.experts``' atomic experts are the parameters' counts); the policy
is told only the subtask's instruction, the atomic task's text it was trained on with the inventory slots
it names read where the invocation starts (``Subtask.instruction_at``), and sees frames in its training
window layout.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from histeve_jax.envs.experts import (
    FURNACE_SPOT,
    CraftExpert,
    Expert,
    MineExpert,
    PlaceExpert,
    SmeltExpert,
)
from histeve_jax.envs.tasks import Task, load_task
from histeve_jax.eval.rollout import Decision
from histeve_jax.harness.schemas import Subtask

PICKAXES = ("default:pick_steel", "default:pick_stone", "default:pick_wood")  # best first


def _best_pick(info: Mapping[str, Any], allowed: tuple[str, ...] = PICKAXES) -> str | None:
    inv = info.get("inventory") or {}
    return next((p for p in PICKAXES if p in allowed and inv.get(p, 0) > 0), None)


def _furnace(info: Mapping[str, Any]) -> tuple[int, int, int]:
    x, _, z = info["pos"]
    found = [p for n, p in info.get("nearby") or [] if n == "default:furnace"]
    if not found:
        raise RuntimeError("no furnace in sight to smelt in")
    return tuple(int(v) for v in min(found, key=lambda p: math.hypot(p[0] - x, p[2] - z)))


def _count(s: Subtask) -> int:
    return int(s.params.get("count", 1))


WALL_CELLS = ((-1, 2), (0, 2), (1, 2))  # the atomic build_wall expert's row
PLACE_CELLS = ((0, 2), (1, 2), (-1, 2))  # the atomic place_dirt expert's cell first
# Cells a placing expert falls back on when one of its own takes no block (three clicks placed nothing there,
# as after dirt_wall seed 1006's teleport): beyond the wall's row, still in the arena.
SPARE_CELLS = ((2, 2), (-2, 2), (0, 3), (1, 3), (-1, 3))


def _cells_in_reach(info: Mapping[str, Any]) -> list[tuple[int, int]]:
    """Ground cells two blocks from the player on each side: a furnace can go anywhere (smelt_iron finds the
    nearest), and the walk to a fixed spot is a straight line that a pit's wall stops (steel_pickaxe seed 1006
    stood in its mining pit through every place_furnace)."""
    if info.get("pos") is None:
        return []
    x, _, z = (int(round(float(v))) for v in info["pos"])
    return [(x + dx, z + dz) for dx, dz in ((0, 2), (2, 0), (0, -2), (-2, 0))]


def _still_to_place(s: Subtask, info: Mapping[str, Any]) -> int:
    """place_dirt's `count` is blocks placed in the whole episode: the ones this invocation still places."""
    placed = int((info.get("place_block") or {}).get("default:dirt", 0))
    return min(len(PLACE_CELLS) + len(SPARE_CELLS), max(1, _count(s) - placed))


ExpertMaker = Callable[[Task, Subtask, Mapping[str, Any]], Expert]
EXPERT_MAKERS: dict[str, ExpertMaker] = {
    "mine_log": lambda t, s, i: MineExpert(t, ("default:tree",), "default:tree", goal=_count(s)),
    "mine_dirt": lambda t, s, i: MineExpert(t, ("default:dirt_with_grass", "default:dirt"), "default:dirt",
                                            goal=_count(s), face="top"),
    "mine_stone": lambda t, s, i: MineExpert(t, ("default:stone",), "default:cobble", goal=_count(s),
                                             tool=_best_pick(i)),
    "mine_coal": lambda t, s, i: MineExpert(t, ("default:stone_with_coal",), "default:coal_lump",
                                            goal=_count(s), tool=_best_pick(i)),
    "mine_iron": lambda t, s, i: MineExpert(t, ("default:stone_with_iron",), "default:iron_lump",
                                            goal=_count(s), tool=_best_pick(i, PICKAXES[:2])),
    "craft_planks": lambda t, s, i: CraftExpert(t, "default:wood", _count(s)),
    "craft_sticks": lambda t, s, i: CraftExpert(t, "default:stick", _count(s)),
    "craft_wooden_pickaxe": lambda t, s, i: CraftExpert(t, "default:pick_wood", 1),
    "craft_stone_pickaxe": lambda t, s, i: CraftExpert(t, "default:pick_stone", 1),
    "craft_steel_pickaxe": lambda t, s, i: CraftExpert(t, "default:pick_steel", 1),
    "craft_furnace": lambda t, s, i: CraftExpert(t, "default:furnace", 1),
    "smelt_iron": lambda t, s, i: SmeltExpert(t, _furnace(i), "default:iron_lump", "default:coal_lump",
                                              "default:steel_ingot", goal=_count(s)),
    "place_furnace": lambda t, s, i: PlaceExpert(t, "default:furnace", [*_cells_in_reach(i), FURNACE_SPOT],
                                                 goal=1),
    "build_wall": lambda t, s, i: PlaceExpert(t, "default:dirt", [*WALL_CELLS, *SPARE_CELLS], goal=3),
    "place_dirt": lambda t, s, i: PlaceExpert(t, "default:dirt", [*PLACE_CELLS, *SPARE_CELLS],
                                              goal=_still_to_place(s, i)),
}


class ExpertExecutor:
    """The scripted expert of each subtask, built from its parameters."""

    name = "expert"

    def __init__(self) -> None:
        self._expert: Expert | None = None
        self._label = ""

    def start(self, subtask: Subtask, obs: dict, info: dict) -> None:
        if subtask.name not in EXPERT_MAKERS:
            raise KeyError(f"no expert for subtask {subtask.name!r}; experts cover {sorted(EXPERT_MAKERS)}")
        expert = EXPERT_MAKERS[subtask.name](load_task(subtask.task), subtask, info)
        expert.reset(info)
        if info.get("is_gui_open"):  # a GUI left open by an invocation that gave up: close it first
            expert._gen = itertools.chain(expert.close_inventory(), expert._gen)
        self._expert = expert
        self._label = subtask.label

    def act(self, obs: dict, info: dict) -> Decision:
        action, phase = self._expert.act(info)  # a RuntimeError here is the expert giving up
        return Decision(action=action, subtask="done" if phase == "done" else f"{self._label}/{phase}")


CLOSE_GUI = "close_gui"  # the phase of a policy invocation's first steps that close a GUI left open


def closes_gui(label: str) -> bool:
    """Whether a decision's (or record's) subtask label is a policy invocation's closing step
    (``<label>/close_gui``): the controller's completion signal and the detector's units begin after them."""
    return label.endswith(f"/{CLOSE_GUI}")


class _CloseGui(Expert):
    """Closes a GUI that an earlier invocation left open (the expert's three taps at most), then is done."""

    def plan(self):
        return iter(())


class PolicyExecutor:
    """A trained run's policy (``eval.policy_agent.load_run``) acting in process on the subtask's
    instruction; the frame history restarts with every invocation (as in training, one instruction per
    episode). An invocation that finds a GUI open (the one before it ended inside the inventory, as a craft
    does once its output is in the inventory) first closes it, as the expert executor does: every
    demonstration starts from the world view, the GUI opened by the policy's own first key."""

    def __init__(self, loaded: Any, *, greedy: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0, name: str = "policy"):
        import jax

        self.loaded, self.name = loaded, name
        self.greedy, self.temperature, self.top_p = greedy, temperature, top_p
        self.frames = loaded.layout.frame_history()
        self._key = jax.random.key(seed)
        self._calls = 0
        self.instruction = ""
        self._label = ""

    def start(self, subtask: Subtask | None, obs: dict, info: dict, instruction: str = "") -> None:
        """Begin an invocation of ``subtask`` (or of a bare ``instruction``, the final-goal baseline)."""
        self.frames.reset()
        self.instruction = subtask.instruction_at(info) if subtask is not None else instruction
        self._label = subtask.label if subtask is not None else "goal"
        self._closer: Expert | None = None
        if info.get("is_gui_open"):
            self._closer = _CloseGui(load_task(subtask.task) if subtask is not None else None)
            self._closer.reset(info)

    def act(self, obs: dict, info: dict) -> Decision:
        import jax

        from histeve_jax.eval.report import action_text

        if self._closer is not None:
            action, phase = self._closer.act(info)
            if phase != "done":
                return Decision(action=action, subtask=f"{self._label}/{CLOSE_GUI}", text=action_text(action))
            self._closer = None  # closed: the policy's history starts at the world view
        regime = int(bool(info["is_gui_open"]))
        frames = self.frames.push(np.asarray(obs["image"]), regime)
        key = jax.random.fold_in(self._key, self._calls)
        self._calls += 1
        row = self.loaded.sample([(frames, self.instruction)], [regime], key,
                                 temperature=self.temperature, greedy=self.greedy, top_p=self.top_p)[0]
        return Decision(action=row.action, subtask=self._label, tokens=row.tokens, logprobs=row.logprobs,
                        text=action_text(row.action))


class GoalOnlyAgent:
    """The baseline: the policy given only the final goal's text for the whole episode (an ``Agent``)."""

    def __init__(self, executor: PolicyExecutor):
        self.executor = executor
        self.name = f"{executor.name}_goal_only"

    def reset(self, task: Task, obs: dict, info: dict, seed: int) -> None:
        self.executor.start(None, obs, info, instruction=task.instruction(info))

    def act(self, obs: dict, info: dict) -> Decision:
        return self.executor.act(obs, info)
