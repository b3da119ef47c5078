"""The experts' common ground: GUI geometry, recipes, action helpers and the ``Expert`` base class (its
motion, aiming and GUI primitives).
"""


from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from histeve_jax.actions.codebook import get_codebook
from histeve_jax.envs.base import EYE_HEIGHT, PIXELS_PER_DEGREE, noop_action, wrap_degrees, yaw_pitch_to
from histeve_jax.envs.tasks import Task

REACH = 3.6  # a little under the hand's 4-node range
MAX_TURN = 10.0  # degrees per step
# A slot is about 22 px inside (24-26 px apart): a click within 8 px of its centre lands in it, and the
# experts stop there. At 5 px, 18% of their clicks came after a last nudge of 4 px (0.6 degrees), about 1 px
# in a policy's 112x196 frame: a frame where the pointer "just arrived" then looks like one where it has
# not moved since a click, and a policy that learnt to click on the first clicked on in the second (README
# "The first move in the GUI"). From 8 px the last move is 11 px or more.
CURSOR_TOL = 8.0
AIM_TOL = 1.5  # degrees
# The subtask of the steps an expert takes off its path on purpose (``Expert.perturb``): played in the game
# and recorded, never imitated (``data.pipeline`` leaves them out of the targets; they stay history frames).
PERTURB = "perturb"


def is_perturbed(subtask: str) -> bool:
    """Whether a recorded subtask is a perturbation (``PERTURB``, or ``<stage>/PERTURB`` in a chain)."""
    return subtask.rpartition("/")[2] == PERTURB

# Main inventory slot (1-based) -> cursor position. Row 1 is the hotbar row of the sfinv page.
_COL_X = [228, 254, 280, 306, 333, 359, 385, 411]
_ROW_Y = [205, 232, 256, 280]
SLOT_XY = {i + 1: (_COL_X[i % 8], _ROW_Y[i // 8]) for i in range(32)}
HOTBAR = 9  # hotbar slots (the bridge mod sets nine, as in Minecraft): inventory slots 1-9
CRAFT_XY = {(r, c): (273 + 26 * c, 91 + 24 * r) for r in range(3) for c in range(3)}
CRAFT_OUTPUT_XY = (378, 115)
CLICK_CLEAR = 16  # px from every slot's centre (slots are 24-26 px apart) where a click takes nothing
STRAY_TOP = 75  # a stray pointer stays below the inventory's page tabs (a click there turns the page)


def click_changes_nothing(xy: tuple[float, float], info: dict[str, Any]) -> bool:
    """Whether an empty-handed click at ``xy`` (render px) in the inventory changes nothing: it is below the
    page tabs, and every inventory slot or crafting grid cell within ``CLICK_CLEAR`` px (either axis) of it
    is empty in ``info`` (the output slot is never taken for empty: a finished recipe shows there)."""
    if xy[1] < STRAY_TOP:
        return False
    slots, grid = info.get("inventory_slots") or [], info.get("craft_grid")

    def near(t):
        return max(abs(xy[0] - t[0]), abs(xy[1] - t[1])) < CLICK_CLEAR

    if near(CRAFT_OUTPUT_XY):
        return False
    for i, t in SLOT_XY.items():
        if near(t) and (i > len(slots) or slots[i - 1]["type"] != "air"):
            return False
    return not any(near(t) and (grid is None or grid[r * 3 + c]["type"] != "air")
                   for (r, c), t in CRAFT_XY.items())


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
    """A scripted policy for one task; `act` returns the next action and the current subtask name.

    An expert starts from any state an agent can leave: a GUI left open is closed first unless the expert
    works in the inventory (``in_inventory``), and the GUI experts take the grid, cursor and inventory as
    they find them (DAgger relabels the states a policy reached this way).
    """

    in_inventory = False  # the expert's plan begins in the inventory GUI (if it is open, it stays open)

    def __init__(self, task: Task):
        self.task = task
        # The chance, at each aim, of first looking off the target and pressing attack there (``aim_off``),
        # and in a dig of throwing the view off (``jolt``): the DART remedy for behaviour cloning's
        # compounding errors. A policy's small aiming error leaves it digging the leaves beside a log, a state
        # no demonstration starts from; with this the demonstrations hold the way back from there (the
        # perturbed steps themselves are not imitated). Set by ``set_perturbation``.
        self.perturb = 0.0
        self.rng = np.random.default_rng(0)
        self._gen: Iterator[tuple[dict[str, Any], str]] | None = None
        self.info: dict[str, Any] = {}
        self._last_action: dict[str, Any] = noop_action()  # what act returned last (click releases by it)

    def reset(self, info: dict[str, Any]) -> None:
        self.info = info
        self._gen = self._from_here()
        self._sync_look(info)

    def _from_here(self) -> Iterator[tuple[dict[str, Any], str]]:
        if self.info.get("is_gui_open") and not self.in_inventory:
            yield from self.close_inventory()
        yield from self.plan()

    def _sync_look(self, info: dict[str, Any]) -> None:
        self.est_yaw, self.est_pitch = float(info["yaw"]), float(info["pitch"])
        self._still = 0

    def act(self, info: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """Next (action, subtask) given the info the env returned for the last step."""
        self.info = info
        if self._gen is None:
            self._gen = self._from_here()
            self._sync_look(info)
        # The reported look lags the commanded one by a step or two (client -> server -> mod), so aim with
        # dead reckoning (camera degrees map exactly onto the view) and re-sync once the view is still.
        if self._still >= 3:
            self.est_yaw, self.est_pitch = float(info["yaw"]), float(info["pitch"])
        try:
            action, subtask = next(self._gen)
        except StopIteration:
            action, subtask = noop_action(), "done"
        self._last_action = action
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

    def turn_to(self, target, subtask: str, tol: float = AIM_TOL, max_steps: int = 60, attack: int = 0):
        for _ in range(max_steps):
            dyaw, dpitch = self.aim_error(target)
            if abs(dyaw) < tol and abs(dpitch) < tol:
                return
            yield _act(camera=[_clamp(dpitch), _clamp(dyaw)], attack=attack), subtask

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

    def set_perturbation(self, chance: float, seed: int) -> None:
        """Perturb (``aim_off``, ``jolt``, ``click_astray``) with probability ``chance`` at each aim, dig,
        opened inventory and move to a craft's stack or output, drawn from ``seed``."""
        if not 0.0 <= chance <= 1.0:
            raise ValueError(f"expert perturbation chance must be in [0, 1], got {chance}")
        self.perturb = float(chance)
        self.rng = np.random.default_rng([int(seed), 0x5EED])

    def aim_off(self, point: tuple[float, float, float], max_attack: int = 30):
        """With probability ``perturb``: turn to a look 8-25 degrees of yaw and -20..+15 of pitch off
        ``point`` and hold attack there for 1-``max_attack`` steps, every step subtask ``PERTURB``; returns
        whether it did (``perturbed = yield from self.aim_off(p)``). The caller then aims at ``point`` from
        wherever this left the view, holding attack as it turns back (a policy digging beside the log should
        turn onto it, not let go: a released button restarts a dig)."""
        if self.perturb <= 0.0 or self.rng.random() >= self.perturb:
            return False
        yaw, pitch = yaw_pitch_to(self.eye(), point)
        yaw = wrap_degrees(yaw + float(self.rng.choice([-1.0, 1.0]) * self.rng.uniform(8.0, 25.0)))
        pitch = float(np.clip(pitch + self.rng.uniform(-20.0, 15.0), -85.0, 85.0))
        for _ in range(20):
            dyaw, dpitch = wrap_degrees(yaw - self.est_yaw), pitch - self.est_pitch
            if abs(dyaw) < AIM_TOL and abs(dpitch) < AIM_TOL:
                break
            yield _act(camera=[_clamp(dpitch), _clamp(dyaw)]), PERTURB
        for _ in range(int(self.rng.integers(1, max_attack + 1))):
            yield _act(attack=1), PERTURB
        return True

    def jolt_at(self, within: int = 60) -> int | None:
        """The step of a dig at which to ``jolt`` (drawn with probability ``perturb``), or None."""
        if self.perturb <= 0.0 or self.rng.random() >= self.perturb:
            return None
        return int(self.rng.integers(1, within + 1))

    def jolt(self):
        """One or two steps that hold attack and throw the view 4-12 degrees of yaw and 3-10 of pitch off
        (subtask ``PERTURB``): a dig whose aim slipped, which the digging expert then brings back."""
        n = int(self.rng.integers(1, 3))
        dyaw = float(self.rng.choice([-1.0, 1.0]) * self.rng.uniform(4.0, 12.0)) / n
        dpitch = float(self.rng.choice([-1.0, 1.0]) * self.rng.uniform(3.0, 10.0)) / n
        for _ in range(n):
            yield _act(attack=1, camera=[dpitch, dyaw]), PERTURB

    # ---- GUI

    def click_astray(self, near: tuple[int, int] | None = None, max_clicks: int = 4):
        """With probability ``perturb``: hold one button, left or right, for 1-``max_clicks`` steps where an
        empty-handed click changes nothing (``click_changes_nothing``), every step subtask ``PERTURB``;
        returns whether it did. Called only where the expert's hand is empty. With ``near`` (the target the
        expert moves to next) the pointer first stops 12-45 px off it (on the farther axis), as a move that
        fell short of it or went past would leave it; without (as the inventory opens) the clicks are where
        the inventory put the pointer or, half the time, at a random spot first.

        A policy that clicks where nothing happens sees a GUI frame whose pointer has not moved since the
        last one, which says "just clicked, move on" only if a demonstration shows the move from there;
        without one it clicked on (the agent's crafts of 2026-12-06: 300-400 clicks in a row, a craft's
        whole budget, where the inventory opened it, beside the panel, and on the empty grid cell its move
        to the output stopped on)."""
        if self.perturb <= 0.0 or self.info.get("cursor") is None or self.rng.random() >= self.perturb:
            return False
        if near is not None or self.rng.random() < 0.5:
            for _ in range(100):
                if near is None:
                    xy = (int(self.rng.integers(20, 621)), int(self.rng.integers(STRAY_TOP, 341)))
                else:
                    d = self.rng.integers(0, 46, size=2) * self.rng.choice([-1, 1], size=2)
                    if max(abs(d)) < 12:
                        continue
                    xy = (int(near[0] + d[0]), int(near[1] + d[1]))
                if click_changes_nothing(xy, self.info):
                    yield from self.cursor_to(xy, PERTURB)
                    break
        if not click_changes_nothing(self.info["cursor"], self.info):  # stopped where a click takes a stack
            return True
        button = ("attack", "use")[int(self.rng.integers(2))]
        for _ in range(int(self.rng.integers(1, max_clicks + 1))):
            yield _act(**{button: 1}), PERTURB
        return True

    def open_inventory(self):
        if self.info["is_gui_open"]:  # already open (an expert taking over from an agent mid-GUI)
            return
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

    def cursor_to(self, xy: tuple[int, int], subtask: str, max_steps: int = 40, tol: float = CURSOR_TOL):
        """Move the pointer until it is within ``tol`` px of ``xy`` on both axes (or no bin gets closer)."""
        for _ in range(max_steps):
            if self.info["cursor"] is None:  # the GUI closed (or its pointer is not reported yet) under load
                yield noop_action(), subtask
                continue
            cx, cy = self.info["cursor"]
            if max(abs(xy[0] - cx), abs(xy[1] - cy)) <= tol:
                return
            move = cursor_move(xy[0] - cx, xy[1] - cy)
            if move == (0.0, 0.0):  # within ~2 px: as close as the action space gets
                return
            yield _act(camera=list(move)), subtask
        raise RuntimeError(f"cursor did not reach {xy} (at {self.info['cursor']})")

    def click(self, button: str, subtask: str, settle: int = 0):
        """Press ``button`` in the step after the move that got there (``settle`` steps later).

        minetest's formspec reads the pointer once per rendered frame, so a click must come a frame after
        the motion; the env sees to that (``LuantiEnv`` holds a GUI click until 0.1 s after the last motion,
        and a motion until 0.1 s after a release). No fixed pause here: a pause that the screen does not
        show is a timer the policy cannot see, and its demonstrations then hold a no-op and the click in the
        same observed state (greedy decoding waits forever). The button is released by the next action;
        only a second click on the same spot needs a release step of its own.
        """
        yield from self.wait(settle, subtask)
        if self._last_action.get(button):
            yield noop_action(), subtask
        yield _act(**{button: 1}), subtask

    def select(self, item: str, subtask: str):
        """Press the hotbar key of the slot holding `item`, first moving it into the hotbar if it is in the
        main inventory (a full hotbar puts a craft's output there)."""
        slot = self.slot_of(item)
        if slot is None:
            raise RuntimeError(f"no {item} in the inventory")
        if slot > HOTBAR:
            yield from self.to_hotbar(item, subtask)
            slot = self.slot_of(item)
        if self.info.get("held_slot") != slot:
            yield _act(**{f"hotbar.{slot}": 1}), subtask
            for _ in range(20):
                if self.info.get("held_slot") == slot:
                    break
                yield noop_action(), subtask

    def to_hotbar(self, item: str, subtask: str):
        """Move `item`'s stack from the main inventory into the hotbar through the inventory GUI: into the
        first empty hotbar slot, else swapped with the last hotbar slot's stack (which goes where `item`
        was)."""
        opened = not self.info["is_gui_open"]
        if opened:
            yield from self.open_inventory()
            yield from self.wait(2, subtask)
        for _attempt in range(3):
            slot = self.slot_of(item)
            if slot is None:
                raise RuntimeError(f"no {item} in the inventory")
            if slot <= HOTBAR:
                break
            slots = self.info["inventory_slots"]
            free = [i for i in range(1, HOTBAR + 1) if slots[i - 1]["type"] == "air"]
            dest = free[0] if free else HOTBAR
            yield from self.cursor_to(SLOT_XY[slot], subtask)
            yield from self.click("attack", subtask)  # the stack onto the cursor
            yield from self.cursor_to(SLOT_XY[dest], subtask)
            yield from self.click("attack", subtask)  # into the slot; a stack there goes onto the cursor
            if not free:
                yield from self.cursor_to(SLOT_XY[slot], subtask)
                yield from self.click("attack", subtask)  # the swapped stack where `item` was
            for _ in range(20):  # the server's inventory reaches the info a few steps later
                if (self.slot_of(item) or HOTBAR + 1) <= HOTBAR:
                    break
                yield noop_action(), subtask
        if opened:
            yield from self.close_inventory()
        slot = self.slot_of(item)
        if slot is None or slot > HOTBAR:
            raise RuntimeError(f"{item} did not reach the hotbar (slot {slot})")

    def slot_of(self, item: str) -> int | None:
        for i, s in enumerate(self.info["inventory_slots"], start=1):
            if s["type"] == item:
                return i
        return None

    def far_empty_slot(self, slot: int) -> int:
        """The empty inventory slot farthest on screen from ``slot`` (the last such on a tie)."""
        empty = [i for i, s in enumerate(self.info["inventory_slots"], start=1)
                 if s["type"] == "air" and i != slot and i in SLOT_XY]
        if not empty:
            raise RuntimeError("no empty inventory slot")
        (x, y) = SLOT_XY[slot]
        return max(empty, key=lambda i: ((SLOT_XY[i][0] - x) ** 2 + (SLOT_XY[i][1] - y) ** 2, i))

    def empty_slot(self) -> int:
        for i, s in enumerate(self.info["inventory_slots"], start=1):
            if s["type"] == "air":
                return i
        raise RuntimeError("no empty inventory slot")
