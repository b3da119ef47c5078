"""The game-backend interface both games share: env-format actions, their validation, the info schema.

Actions are MineStudio's ``env`` format: a 0/1 value for each of ``BUTTONS`` and ``camera = [dpitch, dyaw]``
in degrees. In play the camera turns the view (dyaw > 0 turns right, dpitch > 0 looks down); while a GUI is
open the same motion moves the cursor by ``PIXELS_PER_DEGREE`` render pixels per degree (x by dyaw, y by
dpitch). Missing keys count as 0, so ``{"forward": 1}`` is a valid action.

``info`` (every backend fills every key):
  inventory     {item: count} summed over the player's main inventory
  hotbar        9 slots [{"type": item or "air", "quantity": n}] (slot 1 first)
  inventory_slots  every main-inventory slot, same form (hotbar slots first)
  held_slot     1-based hotbar slot in hand
  is_gui_open   True while a GUI (inventory, crafting, furnace) has the input
  cursor        (x, y) in render pixels (640x360) while a GUI is open, else None
  pos           (x, y, z) in blocks (Luanti: y up, z north; Minecraft: y up, z south)
  yaw, pitch    degrees with MineStudio's signs: yaw 0 faces +z and grows turning right, in [-180, 180);
                pitch 0 is level, positive looks down, in [-90, 90]
  health        hit points (20 = full)
  mine_block, craft_item, pickup, place_block, use_item   cumulative {item: count} since reset
  task, success, steps   task name, whether its success check holds now, steps since reset
Luanti adds privileged extras: ``nearby`` [(node name, (x, y, z))] of watched node kinds, nearest first;
``craft_grid`` (the 3x3 crafting grid, row-major slots); ``tick`` (server steps); ``subgoals_done``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from histeve_jax.actions.codebook import BUTTONS, CAMERA

# VPT's CAMERA_SCALER: 360/2400 degrees per mouse pixel, so 1 degree = 6.67 pixels of mouse or cursor motion.
PIXELS_PER_DEGREE = 2400.0 / 360.0
RENDER_SIZE = (360, 640)  # (H, W) of the game's render; obs are resized from it
STEP_SECONDS = 0.05  # 20 control steps per second of game time
EVENT_KEYS = ("mine_block", "craft_item", "pickup", "place_block", "use_item")
INFO_KEYS = (
    "inventory", "hotbar", "inventory_slots", "held_slot", "is_gui_open", "cursor", "pos", "yaw", "pitch",
    "health", *EVENT_KEYS, "task", "success", "steps",
)


def noop_action() -> dict[str, Any]:
    """An action with every button released and no camera motion."""
    a: dict[str, Any] = {k: 0 for k in BUTTONS}
    a[CAMERA] = np.zeros(2, dtype=np.float32)
    return a


def validate_action(action: Mapping[str, Any]) -> dict[str, Any]:
    """Check an env-format action and return a complete copy (buttons as 0/1 ints, camera as float32[2]).

    Raises ValueError naming the offending key: unknown keys, non-binary buttons, a camera that is not two
    finite numbers.
    """
    if not isinstance(action, Mapping):
        raise ValueError(f"action must be a dict of env-format keys, got {type(action).__name__}")
    out = noop_action()
    for key, value in action.items():
        if key == CAMERA:
            cam = np.asarray(value, dtype=np.float64)
            if cam.shape not in ((2,), (1, 2)):
                raise ValueError(
                    f"action key 'camera' must have shape (2,) = [dpitch, dyaw], got {cam.shape}")
            cam = cam.reshape(2)
            if not np.all(np.isfinite(cam)):
                raise ValueError(f"action key 'camera' must be finite, got {cam.tolist()}")
            out[CAMERA] = cam.astype(np.float32)
        elif key in out:
            v = np.asarray(value)
            if v.size != 1:
                raise ValueError(f"action key {key!r} must be a scalar 0/1, got shape {v.shape}")
            f = float(v.reshape(()))
            if f not in (0.0, 1.0):
                raise ValueError(f"action key {key!r} must be 0 or 1, got {f}")
            out[key] = int(f)
        else:
            raise ValueError(f"unknown action key {key!r}; env-format keys are {list(BUTTONS) + [CAMERA]}")
    return out


def wrap_degrees(a: float) -> float:
    """Angle in [-180, 180)."""
    return (a + 180.0) % 360.0 - 180.0


EYE_HEIGHT = 1.47  # minetest_game's player eye height above the feet


def yaw_pitch_to(eye: tuple[float, float, float], target: tuple[float, float, float]) -> tuple[float, float]:
    """Yaw and pitch (this module's conventions, y up, yaw 0 = +z) that look from `eye` at `target`."""
    dx, dy, dz = (t - e for t, e in zip(target, eye, strict=True))
    yaw = math.degrees(math.atan2(dx, dz))
    pitch = -math.degrees(math.atan2(dy, math.hypot(dx, dz)))
    return wrap_degrees(yaw), pitch


def slot_list(names: list[str], counts: list[int]) -> list[dict[str, Any]]:
    """Slots in MineStudio's form: [{"type": item or "air", "quantity": n}]."""
    return [{"type": (n if n and c > 0 else "air"), "quantity": int(c) if n else 0}
            for n, c in zip(names, counts, strict=True)]


def inventory_counts(slots: list[dict[str, Any]]) -> dict[str, int]:
    """{item: total count} over slots, without empty ones."""
    out: dict[str, int] = {}
    for s in slots:
        if s["type"] != "air" and s["quantity"] > 0:
            out[s["type"]] = out.get(s["type"], 0) + s["quantity"]
    return out
