"""The reset arena: the command list that rebuilds the same flat patch of world and task state every reset.

The world outside is the flat mapgen at a fixed seed; inside ``|x|, |z| <= ARENA_RADIUS`` every reset
rewrites every node (stone, dirt, grass top at ``GROUND_Y``, air above), then places the task's trees, fills
and nodes, so digging in one episode never leaks into the next.
"""

from __future__ import annotations

from typing import Any

from histeve_jax.envs.tasks import Task

ARENA_RADIUS = 12
GROUND_Y = 8  # top of the grass; a standing player's feet are at GROUND_Y + 0.5
AIR_TOP = 30
DEFAULT_POS = (0.0, GROUND_Y + 0.5, 0.0)
# The trunk's log at a standing player's eye level (eyes 1.47 above feet at GROUND_Y + 0.5: y = 9.97), counted
# from the trunk's base (GROUND_Y + 1): the one a chop takes first.
EYE_LOG = 1
WATCHED_NODES = (
    "default:tree", "default:stone", "default:dirt_with_grass", "default:stone_with_iron",
    "default:stone_with_coal", "default:furnace", "default:goldblock",
)


def _fill(p1, p2, name: str) -> dict[str, Any]:
    return {"op": "fill", "pos1": [int(v) for v in p1], "pos2": [int(v) for v in p2], "name": name}


def tree_ops(base: list[float], height: int) -> list[dict[str, Any]]:
    """A trunk of `height` default:tree from `base` up, with a 5x5x2 + 3x3 canopy of default:leaves."""
    x, y, z = (int(v) for v in base)
    top = y + height - 1
    ops = [
        _fill((x - 2, top - 1, z - 2), (x + 2, top, z + 2), "default:leaves"),
        _fill((x - 1, top + 1, z - 1), (x + 1, top + 1, z + 1), "default:leaves"),
        _fill((x, y, z), (x, top, z), "default:tree"),
    ]
    return ops


def reset_ops(task: Task) -> list[dict[str, Any]]:
    """The mod commands that put the world and the player into `task`'s initial state."""
    r, g = ARENA_RADIUS, GROUND_Y
    init = task.init
    ops: list[dict[str, Any]] = [
        {"op": "emerge", "pos1": [-r - 16, 0, -r - 16], "pos2": [r + 16, AIR_TOP, r + 16]},
        # Park the player above the arena while it is rebuilt so no node is rebuilt inside them.
        {"op": "set_pos", "pos": [0.0, AIR_TOP - 2.0, 0.0]},
        _fill((-r, g - 6, -r), (r, g - 4, r), "default:stone"),
        _fill((-r, g - 3, -r), (r, g - 1, r), "default:dirt"),
        _fill((-r, g, -r), (r, g, r), "default:dirt_with_grass"),
        _fill((-r, g + 1, -r), (r, AIR_TOP, r), "air"),
    ]
    for f in init.get("fills") or []:
        ops.append(_fill(f["pos1"], f["pos2"], f["name"]))
    for t in init.get("trees") or []:
        ops.extend(tree_ops(t["pos"], t.get("height", 4)))
    for n in init.get("nodes") or []:
        ops.append({"op": "set_node", "pos": [int(v) for v in n["pos"]], "name": n["name"]})
    ops += [
        {"op": "clear_objects", "center": [0, g, 0], "radius": 3 * r},
        {"op": "clear_inventory"},
        {"op": "set_gui_page"},  # the inventory opens on the crafting grid, whatever page it was left on
    ]
    for it in init.get("inventory") or []:
        if "slot" in it:
            ops.append({"op": "set_slot", "slot": it["slot"], "item": it["item"],
                        "count": it.get("count", 1)})
    for it in init.get("inventory") or []:
        if "slot" not in it:
            ops.append({"op": "give", "item": it["item"], "count": it.get("count", 1)})
    ops += [
        {"op": "set_pos", "pos": list(init.get("pos", DEFAULT_POS))},
        {"op": "set_look", "yaw": float(init.get("yaw", 0.0)), "pitch": float(init.get("pitch", 0.0))},
        {"op": "time", "value": float(init.get("time_of_day", 0.5))},
        {"op": "set_hp", "value": int(init.get("hp", 20))},
        {"op": "set_breath", "value": 11},
        # only the arena's nodes: the world outside is not reset, so a node dug there stays dug
        {"op": "watch", "names": list(WATCHED_NODES), "radius": r + 4, "min_y": g, "bound": r},
        {"op": "reset_events"},
    ]
    return ops
