"""Scripted experts: they read the privileged info but act only through env-format actions.

Each expert is a small state machine: ``act(info) -> (action, subtask)``, where ``subtask`` names the phase
the step belongs to (the recorder stores it, so subtask boundaries are where the name changes). Camera motion
is limited to ``MAX_TURN`` degrees per step in both regimes, so every expert action lies in VPT's camera bins.
In a GUI every cursor move is moreover one of the VPT codebook's bin centres (``cursor_move``): the policy
acts through those bins, and the expert's continuous moves, quantised, would land the cursor up to ~9 px
off the path the expert took (inventory slots are 26 px apart), so its demonstrations would not be
repeatable in the policy's own action space; on bin centres they are, token for token.

GUI geometry (``SLOT_XY``, ``CRAFT_XY``, ``CRAFT_OUTPUT_XY``, ``FURNACE_*``) is minetest_game's sfinv
crafting page and furnace formspec measured on the 640x360 render with gui_scaling 1 (the config
LuantiProcess writes). The long-horizon ``steel_pickaxe`` expert chains the atomic ones; its subtask names
are ``<stage>/<phase>`` with the stage named after the task's subgoal.

Modules: ``core`` (geometry, recipes, the ``Expert`` base), ``world`` (mine, place, explore), ``gui`` (craft,
smelt); this one chains them (the steel pickaxe) and maps task names to experts (``expert_for``).
"""

from __future__ import annotations

from histeve_jax.envs.experts.core import (
    AIM_TOL,
    CRAFT_OUTPUT_XY,
    CRAFT_XY,
    EYE_HEIGHT,
    MAX_TURN,
    PERTURB,
    REACH,
    RECIPES,
    SLOT_XY,
    Expert,
    cursor_move,
    is_perturbed,
)
from histeve_jax.envs.experts.gui import CraftExpert, SmeltExpert
from histeve_jax.envs.experts.world import ExploreExpert, MineExpert, PlaceExpert
from histeve_jax.envs.tasks import Task

__all__ = [
    "AIM_TOL", "CRAFT_OUTPUT_XY", "CRAFT_XY", "EXPERT_TASKS", "EYE_HEIGHT", "FURNACE_SPOT", "MAX_TURN",
    "PERTURB", "REACH", "RECIPES", "SLOT_XY", "ChainExpert", "CraftExpert", "Expert", "ExploreExpert",
    "MineExpert", "PlaceExpert", "SmeltExpert", "cursor_move", "expert_for", "is_perturbed",
    "steel_pickaxe_expert",
]


class ChainExpert(Expert):
    """Runs atomic experts one after another; the subtask is ``<stage>/<phase>`` (stage = the subgoal)."""

    def __init__(self, task: Task, stages: list[tuple[str, Expert]]):
        super().__init__(task)
        self.stages = stages

    def set_perturbation(self, chance: float, seed: int) -> None:
        super().set_perturbation(chance, seed)
        for i, (_, ex) in enumerate(self.stages):
            ex.set_perturbation(chance, seed * 1000 + i)

    def plan(self):
        for name, ex in self.stages:
            gen = ex.plan()
            while True:
                # the stage expert sees the chain's info and its dead-reckoned look
                ex.info, ex.est_yaw, ex.est_pitch = self.info, self.est_yaw, self.est_pitch
                ex._last_action = self._last_action
                try:
                    action, phase = next(gen)
                except StopIteration:
                    break
                yield action, f"{name}/{phase}"


FURNACE_SPOT = (0, -2)  # where the steel-pickaxe expert places its furnace (x, z), on the arena floor


def steel_pickaxe_expert(task: Task) -> ChainExpert:
    """The long-horizon chain: logs, planks, sticks, wooden pickaxe, cobble, stone pickaxe, ore, furnace,
    smelting, steel pickaxe (minetest_game recipes; one plank makes four sticks)."""
    fx, fz = FURNACE_SPOT
    stages = [
        ("logs", MineExpert(task, ("default:tree",), "default:tree", goal=2)),
        ("planks", CraftExpert(task, "default:wood", 8)),
        ("sticks", CraftExpert(task, "default:stick", 8)),
        ("wooden_pickaxe", CraftExpert(task, "default:pick_wood", 1)),
        ("cobblestone", MineExpert(task, ("default:stone",), "default:cobble", goal=11,
                                   tool="default:pick_wood")),
        ("stone_pickaxe", CraftExpert(task, "default:pick_stone", 1)),
        ("iron_and_coal", MineExpert(task, ("default:stone_with_iron",), "default:iron_lump", goal=3,
                                     tool="default:pick_stone")),
        ("iron_and_coal", MineExpert(task, ("default:stone_with_coal",), "default:coal_lump", goal=1,
                                     tool="default:pick_stone")),
        ("furnace", CraftExpert(task, "default:furnace", 1)),
        ("place_furnace", PlaceExpert(task, "default:furnace", [FURNACE_SPOT])),
        ("steel_ingots", SmeltExpert(task, (fx, 9, fz), "default:iron_lump", "default:coal_lump",
                                     "default:steel_ingot", goal=3)),
        ("steel_pickaxe", CraftExpert(task, "default:pick_steel", 1)),
    ]
    return ChainExpert(task, stages)


def expert_for(task: Task) -> Expert:
    """The scripted expert for a shipped atomic task (KeyError for tasks without one)."""
    makers = {
        # approach 2: mine_log starts 3 +- 0.35 blocks from its tree, where the default (walk when over 3.1)
        # walked in some episodes and not in others that look alike; now every one walks up first
        "mine_log": lambda t: MineExpert(t, ("default:tree",), "default:tree", approach=2.0),
        "mine_dirt": lambda t: MineExpert(t, ("default:dirt_with_grass", "default:dirt"), "default:dirt",
                                          face="top", more=True),
        "mine_stone": lambda t: MineExpert(t, ("default:stone",), "default:cobble", tool_slot=1),
        "craft_planks": lambda t: CraftExpert(t, "default:wood", 4),
        "craft_sticks": lambda t: CraftExpert(t, "default:stick", 4),
        "craft_wooden_pickaxe": lambda t: CraftExpert(t, "default:pick_wood", 1),
        "smelt_iron": lambda t: SmeltExpert(t, (0, 9, 2), "default:iron_lump", "default:coal_lump",
                                            "default:steel_ingot"),
        "place_dirt": lambda t: PlaceExpert(t, "default:dirt", [(0, 2)]),
        "build_wall": lambda t: PlaceExpert(t, "default:dirt", [(-1, 2), (0, 2), (1, 2)]),
        "find_gold": lambda t: ExploreExpert(t, "default:goldblock", 2.0),
        "steel_pickaxe": steel_pickaxe_expert,
    }
    if task.name not in makers:
        raise KeyError(f"no scripted expert for task {task.name!r}; experts cover {sorted(makers)}")
    return makers[task.name](task)


EXPERT_TASKS = ("mine_log", "mine_dirt", "mine_stone", "craft_planks", "craft_sticks", "craft_wooden_pickaxe",
                "smelt_iron", "place_dirt", "build_wall", "find_gold")
