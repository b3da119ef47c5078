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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from histeve_jax.actions.codebook import get_codebook
from histeve_jax.envs.base import PIXELS_PER_DEGREE, noop_action, wrap_degrees, yaw_pitch_to
from histeve_jax.envs.tasks import Task

EYE_HEIGHT = 1.47  # minetest_game's player eye height above the feet
REACH = 3.6  # a little under the hand's 4-node range
MAX_TURN = 10.0  # degrees per step
AIM_TOL = 1.5  # degrees

# Main inventory slot (1-based) -> cursor position. Row 1 is the hotbar row of the sfinv page.
_COL_X = [228, 254, 280, 306, 333, 359, 385, 411]
_ROW_Y = [205, 232, 256, 280]
SLOT_XY = {i + 1: (_COL_X[i % 8], _ROW_Y[i // 8]) for i in range(32)}
CRAFT_XY = {(r, c): (273 + 26 * c, 91 + 24 * r) for r in range(3) for c in range(3)}
CRAFT_OUTPUT_XY = (378, 115)
# The furnace formspec (default.get_furnace_*_formspec) on the same render: its own main-inventory rows.
FURNACE_SLOT_XY = {i + 1: (_COL_X[i % 8], [188, 219, 243, 267][i // 8]) for i in range(32)}
FURNACE_SRC_XY, FURNACE_FUEL_XY, FURNACE_DST_XY = (300, 98), (300, 146), (352, 109)

# Shaped recipes of minetest_game used by the craft tasks: output -> {(row, col): item}.
RECIPES: dict[str, dict[tuple[int, int], str]] = {
    "default:wood": {(0, 0): "default:tree"},
    "default:stick": {(0, 0): "default:wood"},  # one plank -> 4 sticks in minetest_game
    "default:pick_wood": {(0, 0): "default:wood", (0, 1): "default:wood", (0, 2): "default:wood",
                          (1, 1): "default:stick", (2, 1): "default:stick"},
    "default:pick_stone": {(0, 0): "default:cobble", (0, 1): "default:cobble", (0, 2): "default:cobble",
                           (1, 1): "default:stick", (2, 1): "default:stick"},
    "default:pick_steel": {(0, 0): "default:steel_ingot", (0, 1): "default:steel_ingot",
                           (0, 2): "default:steel_ingot", (1, 1): "default:stick", (2, 1): "default:stick"},
    "default:furnace": {(r, c): "default:cobble" for r in range(3) for c in range(3) if (r, c) != (1, 1)},
}


def _act(**kw: Any) -> dict[str, Any]:
    a = noop_action()
    for k, v in kw.items():
        a[k] = np.asarray(v, np.float32) if k == "camera" else v
    return a


def cursor_move(dx_px: float, dy_px: float, codebook: str = "vpt") -> tuple[float, float]:
    """The camera action (dpitch, dyaw) in degrees towards a cursor target (dx, dy) pixels away: per axis the
    codebook's bin centre nearest to the distance (in degrees, not in the mu-law domain the codebook rounds
    in, which would overshoot small distances back and forth); (0, 0) when no bin gets closer."""
    cb = get_codebook(codebook)
    centres = cb.undiscretize(np.arange(cb.n_bins))
    deg = np.array([dy_px, dx_px]) / PIXELS_PER_DEGREE
    snapped = centres[np.abs(deg[:, None] - centres[None, :]).argmin(1)]
    return float(snapped[0]), float(snapped[1])


def _clamp(v: float, m: float = MAX_TURN) -> float:
    return max(-m, min(m, v))


class Expert:
    """A scripted policy for one task; `act` returns the next action and the current subtask name."""

    def __init__(self, task: Task):
        self.task = task
        self._gen: Iterator[tuple[dict[str, Any], str]] | None = None
        self.info: dict[str, Any] = {}

    def reset(self, info: dict[str, Any]) -> None:
        self.info = info
        self._gen = self.plan()
        self._sync_look(info)

    def _sync_look(self, info: dict[str, Any]) -> None:
        self.est_yaw, self.est_pitch = float(info["yaw"]), float(info["pitch"])
        self._still = 0

    def act(self, info: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """Next (action, subtask) given the info the env returned for the last step."""
        self.info = info
        if self._gen is None:
            self._gen = self.plan()
            self._sync_look(info)
        # The reported look lags the commanded one by a step or two (client -> server -> mod), so aim with
        # dead reckoning (camera degrees map exactly onto the view) and re-sync once the view is still.
        if self._still >= 3:
            self.est_yaw, self.est_pitch = float(info["yaw"]), float(info["pitch"])
        try:
            action, subtask = next(self._gen)
        except StopIteration:
            action, subtask = noop_action(), "done"
        cam = np.asarray(action["camera"], np.float64)
        if info["is_gui_open"] or not cam.any():
            self._still += 1
        else:
            self._still = 0
            self.est_pitch = float(np.clip(self.est_pitch + cam[0], -89.5, 89.5))
            self.est_yaw = wrap_degrees(self.est_yaw + cam[1])
        return action, subtask

    def plan(self) -> Iterator[tuple[dict[str, Any], str]]:
        raise NotImplementedError

    # ---- shared motions, written as generators that yield (action, subtask)

    def eye(self) -> tuple[float, float, float]:
        x, y, z = self.info["pos"]
        return x, y + EYE_HEIGHT, z

    def aim_error(self, target: tuple[float, float, float]) -> tuple[float, float]:
        yaw, pitch = yaw_pitch_to(self.eye(), target)
        return wrap_degrees(yaw - self.est_yaw), pitch - self.est_pitch

    def turn_to(self, target, subtask: str, tol: float = AIM_TOL, max_steps: int = 60):
        for _ in range(max_steps):
            dyaw, dpitch = self.aim_error(target)
            if abs(dyaw) < tol and abs(dpitch) < tol:
                return
            yield _act(camera=[_clamp(dpitch), _clamp(dyaw)]), subtask

    def walk_to(self, target_xz: tuple[float, float], dist: float, subtask: str, max_steps: int = 400):
        """Turn toward and walk until within `dist` blocks (horizontally) of `target_xz`; jump when stuck."""
        last = None
        stuck = 0
        for _ in range(max_steps):
            x, _, z = self.info["pos"]
            d = math.hypot(target_xz[0] - x, target_xz[1] - z)
            if d <= dist:
                return
            yaw = math.degrees(math.atan2(target_xz[0] - x, target_xz[1] - z))
            dyaw = wrap_degrees(yaw - self.est_yaw)
            dpitch = -self.est_pitch  # walk looking level
            moved = last is None or math.hypot(x - last[0], z - last[1]) > 0.02
            stuck = 0 if moved else stuck + 1
            last = (x, z)
            yield _act(camera=[_clamp(dpitch), _clamp(dyaw)], forward=int(abs(dyaw) < 30),
                       jump=int(stuck > 3)), subtask

    def wait(self, n: int, subtask: str):
        for _ in range(n):
            yield noop_action(), subtask

    # ---- GUI

    def open_inventory(self):
        # A press that reaches the client in the same frame as the previous close can be swallowed by the
        # closing formspec, so press again if no GUI shows up within a second.
        for _press in range(3):
            yield _act(inventory=1), "open_inventory"
            for _ in range(20):
                if self.info["is_gui_open"]:
                    return
                yield noop_action(), "open_inventory"
        raise RuntimeError("the inventory did not open")

    def close_inventory(self):
        for _press in range(3):
            yield _act(inventory=1), "close_inventory"
            for _ in range(20):
                if not self.info["is_gui_open"]:
                    yield from self.wait(3, "close_inventory")  # let the client settle before the next key
                    return
                yield noop_action(), "close_inventory"

    def cursor_to(self, xy: tuple[int, int], subtask: str, max_steps: int = 40):
        for _ in range(max_steps):
            if self.info["cursor"] is None:  # the GUI closed (or its pointer is not reported yet) under load
                yield noop_action(), subtask
                continue
            cx, cy = self.info["cursor"]
            move = cursor_move(xy[0] - cx, xy[1] - cy)
            if move == (0.0, 0.0):  # within ~2 px: as close as the action space gets
                return
            yield _act(camera=list(move)), subtask
        raise RuntimeError(f"cursor did not reach {xy} (at {self.info['cursor']})")

    def click(self, button: str, subtask: str, settle: int = 3):
        # minetest's formspec reads the pointer once per rendered frame, so a click sent before the client has
        # drawn a frame at the new pointer position lands on the old one; pause on the slot first.
        yield from self.wait(settle, subtask)
        yield _act(**{button: 1}), subtask
        yield noop_action(), subtask

    def select(self, item: str, subtask: str):
        """Press the hotbar key of the slot holding `item` (it must be in the hotbar)."""
        slot = self.slot_of(item)
        if slot is None or slot > 9:
            raise RuntimeError(f"{item} is not in the hotbar (slot {slot})")
        if self.info.get("held_slot") != slot:
            yield _act(**{f"hotbar.{slot}": 1}), subtask
            for _ in range(20):
                if self.info.get("held_slot") == slot:
                    break
                yield noop_action(), subtask

    def slot_of(self, item: str) -> int | None:
        for i, s in enumerate(self.info["inventory_slots"], start=1):
            if s["type"] == item:
                return i
        return None

    def empty_slot(self) -> int:
        for i, s in enumerate(self.info["inventory_slots"], start=1):
            if s["type"] == "air":
                return i
        raise RuntimeError("no empty inventory slot")


class MineExpert(Expert):
    """Walk to the nearest node of `names`, aim at its exposed face and dig until `goal` drops are held."""

    def __init__(self, task: Task, names: tuple[str, ...], drop: str, goal: int = 1, face: str = "side",
                 tool_slot: int | None = None, tool: str | None = None):
        super().__init__(task)
        self.names, self.drop, self.goal, self.face, self.tool_slot = names, drop, goal, face, tool_slot
        self.tool = tool
        self.skip: set[tuple[int, int, int]] = set()  # targets whose digging did not finish (blocked)

    def target(self) -> tuple[int, int, int] | None:
        x, y, z = self.info["pos"]
        eye_y = y + EYE_HEIGHT
        best, best_d = None, 1e9
        for name, p in self.info.get("nearby", []):
            if name not in self.names or tuple(int(v) for v in p) in self.skip:
                continue
            d = math.hypot(p[0] - x, p[2] - z)
            if self.face == "top" and d < 1.5:  # the node under the player's feet
                continue
            # prefer nodes at eye level for side faces, close ones first
            d += 0.6 * abs(p[1] - eye_y + 0.5) if self.face == "side" else 0.0
            if d < best_d:
                best, best_d = tuple(int(v) for v in p), d
        return best

    def face_point(self, node: tuple[int, int, int]) -> tuple[float, float, float]:
        nx, ny, nz = node
        if self.face == "top":
            return nx, ny + 0.5, nz
        ex, _, ez = self.eye()
        dx, dz = ex - nx, ez - nz
        if abs(dx) > abs(dz):
            return nx + 0.5 * math.copysign(1, dx), ny, nz
        return nx, ny, nz + 0.5 * math.copysign(1, dz)

    def plan(self):
        if self.tool_slot is not None:
            yield _act(**{f"hotbar.{self.tool_slot}": 1}), "select_tool"
            yield noop_action(), "select_tool"
        if self.tool is not None:
            yield from self.select(self.tool, "select_tool")
        while self.info["inventory"].get(self.drop, 0) < self.goal:
            node = self.target()
            if node is None:
                yield from self.wait(1, "search")
                continue
            x, _, z = self.info["pos"]
            if math.hypot(node[0] - x, node[2] - z) > REACH - 0.5:
                yield from self.walk_to((node[0], node[2]), REACH - 1.0, "approach")
            point = self.face_point(node)
            yield from self.turn_to(point, "aim")
            mined_before = sum(self.info["mine_block"].values())
            for _ in range(120):  # 3.5 s for a log by hand; a node the tool cannot dig never breaks
                if sum(self.info["mine_block"].values()) > mined_before:
                    break
                dyaw, dpitch = self.aim_error(point)
                yield _act(attack=1, camera=[_clamp(dpitch, 2), _clamp(dyaw, 2)]), "dig"
            else:
                self.skip.add(node)  # something in front of it resisted: try another one
            yield noop_action(), "dig"


class CraftExpert(Expert):
    """Open the inventory, lay out a recipe in the 3x3 grid by clicking, take the output, close."""

    def __init__(self, task: Task, output: str, goal: int):
        super().__init__(task)
        self.output, self.goal = output, goal
        self.recipe = RECIPES[output]

    def grid_missing(self) -> dict[str, list[tuple[int, int]]]:
        """Recipe cells the crafting grid (privileged info) does not hold yet, grouped by item."""
        grid = self.info.get("craft_grid")
        missing: dict[str, list[tuple[int, int]]] = {}
        for cell, item in sorted(self.recipe.items()):
            if grid is None or grid[cell[0] * 3 + cell[1]]["type"] != item:
                missing.setdefault(item, []).append(cell)
        return missing

    def grid_wrong(self) -> list[tuple[int, int]]:
        """Grid cells holding something the recipe does not put there (a click that landed elsewhere)."""
        grid = self.info.get("craft_grid")
        if grid is None:
            return []
        return [(i // 3, i % 3) for i, g in enumerate(grid)
                if g["type"] != "air" and self.recipe.get((i // 3, i % 3)) != g["type"]]

    def have_goal(self) -> bool:
        return self.info["inventory"].get(self.output, 0) >= self.goal

    def plan(self):
        yield from self.open_inventory()
        yield from self.wait(2, "open_inventory")
        for _attempt in range(4):
            if self.have_goal():
                break
            for cell in self.grid_wrong():
                yield from self.cursor_to(CRAFT_XY[cell], "clear_grid")
                yield from self.click("attack", "clear_grid")
                yield from self.cursor_to(SLOT_XY[self.empty_slot()], "clear_grid")
                yield from self.click("attack", "clear_grid")
                yield from self.wait(3, "clear_grid")
            for item, cells in self.grid_missing().items():
                slot = self.slot_of(item)
                for _ in range(40):  # the server's inventory can lag the GUI by several steps under load
                    if slot is not None or self.have_goal():
                        break
                    yield noop_action(), "wait_inventory"
                    slot = self.slot_of(item)
                if slot is None:
                    raise RuntimeError(f"no {item} in the inventory for {self.output}")
                yield from self.cursor_to(SLOT_XY[slot], f"pick_{item}")
                yield from self.click("attack", f"pick_{item}")  # the whole stack onto the cursor
                for cell in cells:
                    yield from self.cursor_to(CRAFT_XY[cell], f"place_{item}")
                    yield from self.click("use", f"place_{item}")  # one item into the grid
                yield from self.cursor_to(SLOT_XY[slot], f"return_{item}")
                yield from self.click("attack", f"return_{item}")  # the rest back where it came from
            # The server computes the output preview from the grid; clicking before it arrives takes nothing.
            for _ in range(20):
                if (not self.grid_missing() and not self.grid_wrong()) or self.info.get("craft_grid") is None:
                    break
                yield noop_action(), "wait_recipe"
            yield from self.wait(2, "wait_recipe")
            if (self.grid_missing() or self.grid_wrong()) and self.info.get("craft_grid") is not None:
                continue
            yield from self.cursor_to(CRAFT_OUTPUT_XY, "take_output")
            yield from self.click("attack", "take_output")
            yield from self.wait(1, "take_output")
            before = self.info["inventory"].get(self.output, 0)
            for _store in range(3):  # a missed click leaves the output on the cursor: click again
                slot = self.slot_of(self.output)
                dest = slot if slot is not None else self.empty_slot()
                yield from self.cursor_to(SLOT_XY[dest], "store_output")
                yield from self.click("attack", "store_output")
                for _ in range(20):  # the server's inventory reaches the info a few steps later
                    if self.info["inventory"].get(self.output, 0) > before:
                        break
                    yield noop_action(), "store_output"
                if self.info["inventory"].get(self.output, 0) > before:
                    break
        yield from self.close_inventory()


class SmeltExpert(Expert):
    """Right-click the furnace, put ore in its source slot and fuel in its fuel slot, take the result."""

    def __init__(self, task: Task, furnace: tuple[int, int, int], ore: str, fuel: str, product: str,
                 goal: int = 1):
        super().__init__(task)
        self.furnace, self.ore, self.fuel, self.product, self.goal = furnace, ore, fuel, product, goal

    def move_stack(self, item: str, to_xy: tuple[int, int], subtask: str):
        slot = self.slot_of(item)
        if slot is None:
            raise RuntimeError(f"no {item} in the inventory to smelt with")
        yield from self.cursor_to(FURNACE_SLOT_XY[slot], subtask)
        yield from self.click("attack", subtask)
        yield from self.cursor_to(to_xy, subtask)
        yield from self.click("attack", subtask)

    def plan(self):
        fx, fy, fz = self.furnace
        x, _, z = self.info["pos"]
        if math.hypot(fx - x, fz - z) > REACH - 0.5:
            yield from self.walk_to((fx, fz), REACH - 1.5, "approach")
        ex, _, ez = self.eye()
        face = (fx, fy, fz - 0.5 * math.copysign(1, fz - ez)) if abs(fz - ez) >= abs(fx - ex) else (
            fx - 0.5 * math.copysign(1, fx - ex), fy, fz)
        yield from self.turn_to(face, "aim")
        for _ in range(3):
            yield from self.click("use", "open_furnace", settle=0)
            for _ in range(40):
                if self.info["is_gui_open"]:
                    break
                yield noop_action(), "open_furnace"
            if self.info["is_gui_open"]:
                break
        if not self.info["is_gui_open"]:
            raise RuntimeError("the furnace did not open")
        yield from self.wait(2, "open_furnace")
        yield from self.move_stack(self.ore, FURNACE_SRC_XY, "load_ore")
        yield from self.move_stack(self.fuel, FURNACE_FUEL_XY, "load_fuel")
        for _try in range(8 + 4 * self.goal):  # cooking takes seconds; taking too early picks up less
            yield from self.wait(30, "wait_smelting")
            before = self.info["inventory"].get(self.product, 0)
            yield from self.cursor_to(FURNACE_DST_XY, "take_product")
            yield from self.click("attack", "take_product")
            yield from self.cursor_to(FURNACE_SLOT_XY[self.empty_slot()], "store_product")
            yield from self.click("attack", "store_product")
            for _ in range(20):
                if self.info["inventory"].get(self.product, 0) > before:
                    break
                yield noop_action(), "store_product"
            if self.info["inventory"].get(self.product, 0) >= self.goal:
                break
        yield from self.close_inventory()


class PlaceExpert(Expert):
    """Place `item` (from the hotbar) on the ground at each of `cells` (x, z) by right-clicking top faces."""

    def __init__(self, task: Task, item: str, cells: list[tuple[int, int]], ground_y: int = 8):
        super().__init__(task)
        self.item, self.cells, self.ground_y = item, cells, ground_y

    def plan(self):
        yield from self.select(self.item, "select_block")
        yield from self.wait(1, "select_block")
        for cx, cz in self.cells:
            point = (cx, self.ground_y + 0.5, cz)
            x, _, z = self.info["pos"]
            if math.hypot(cx - x, cz - z) > REACH - 1.0:
                yield from self.walk_to((cx, cz), 2.0, "approach")
            placed = self.info["place_block"].get(self.item, 0)
            for _ in range(3):
                yield from self.turn_to(point, "aim")
                yield from self.click("use", "place")
                yield from self.wait(3, "place")
                if self.info["place_block"].get(self.item, 0) > placed:
                    break


class ExploreExpert(Expert):
    """Find the nearest `name` node in the privileged nearby list and walk up to it."""

    def __init__(self, task: Task, name: str, radius: float):
        super().__init__(task)
        self.name, self.radius = name, radius

    def plan(self):
        while True:
            found = [p for n, p in self.info.get("nearby", []) if n == self.name]
            if found:
                break
            yield _act(camera=[0.0, MAX_TURN]), "search"
        p = found[0]
        yield from self.walk_to((p[0], p[2]), self.radius * 0.6, "walk_to_target")
        yield from self.wait(2, "arrived")


class ChainExpert(Expert):
    """Runs atomic experts one after another; the subtask is ``<stage>/<phase>`` (stage = the subgoal)."""

    def __init__(self, task: Task, stages: list[tuple[str, Expert]]):
        super().__init__(task)
        self.stages = stages

    def plan(self):
        for name, ex in self.stages:
            gen = ex.plan()
            while True:
                # the stage expert sees the chain's info and its dead-reckoned look
                ex.info, ex.est_yaw, ex.est_pitch = self.info, self.est_yaw, self.est_pitch
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
        "mine_log": lambda t: MineExpert(t, ("default:tree",), "default:tree"),
        "mine_dirt": lambda t: MineExpert(t, ("default:dirt_with_grass", "default:dirt"), "default:dirt",
                                          face="top"),
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
