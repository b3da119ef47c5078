"""Experts that act in the world (NG): mine a node, place blocks, find a node by exploring."""

from __future__ import annotations

import math

from histeve_jax.envs.base import noop_action, wrap_degrees, yaw_pitch_to
from histeve_jax.envs.experts.core import (
    EYE_HEIGHT,
    MAX_TURN,
    REACH,
    Expert,
    _act,
    _clamp,
)
from histeve_jax.envs.tasks import Task

# A node's cost is its distance plus this many blocks per radian of turn from the current view. Nearest-first
# picked any of the ground nodes around the player by where it stood within its block (the start is
# randomised by +-0.25), turning up to 150 degrees for a node that the frame does not tell apart from the one
# ahead: a policy could not tell from the frame when to stop turning and dig. The same held for trees: from
# mine_log's starts anywhere, 15 of 112 demonstrations turned away from a trunk in view (within 40 degrees) to
# one nearer behind, which the frame does not show (2026-12-06); turning counts for trunks too since.
TURN_COST = 2.0


class MineExpert(Expert):
    """Walk to the nearest node of `names`, aim at its exposed face and dig until `goal` drops are held
    (with ``more``: `goal` more than were held at the start, as an atomic task's ``pickup`` counts them).
    Nodes are chosen by distance and turn, so the one ahead wins (``TURN_COST``)."""

    def __init__(self, task: Task, names: tuple[str, ...], drop: str, goal: int = 1, face: str = "side",
                 tool_slot: int | None = None, tool: str | None = None, approach: float = REACH - 1.0,
                 more: bool = False):
        super().__init__(task)
        self.names, self.drop, self.goal, self.face, self.tool_slot = names, drop, goal, face, tool_slot
        self.more = more
        # walk up to `approach` blocks of the node when it is more than half a block further
        self.approach = approach
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
            # the one ahead wins over a slightly nearer one behind (TURN_COST): a policy sees the one ahead
            yaw = yaw_pitch_to(self.eye(), (p[0], p[1] + 0.5, p[2]))[0]
            d += TURN_COST * math.radians(abs(wrap_degrees(yaw - self.est_yaw)))
            # prefer the node at eye level for side faces (a trunk's second log: dug looking straight ahead,
            # from wherever the player stands within reach), close ones first; below eye level last: a trunk's
            # base is dug looking down at the grass beside it, which a policy could not tell from the log (a
            # trunk missing its eye-level log is chopped above it)
            if self.face == "side":
                d += 0.6 * abs(p[1] - eye_y) + (1.5 if p[1] < eye_y - 0.5 else 0.0)
            if d < best_d:
                best, best_d = tuple(int(v) for v in p), d
        return best

    def under_a_gap(self, node: tuple[int, int, int]) -> bool:
        """A side-face node above the eye with no node of ``names`` below it (a trunk missing its eye-level
        log: the log above the gap)."""
        nx, ny, nz = node
        below = (nx, ny - 1, nz)
        return (self.face == "side" and ny - 0.5 > self.eye()[1]
                and not any(n in self.names and tuple(int(v) for v in p) == below
                            for n, p in self.info.get("nearby", [])))

    def face_point(self, node: tuple[int, int, int]) -> tuple[float, float, float]:
        nx, ny, nz = node
        if self.face == "top":
            return nx, ny + 0.5, nz
        ex, _, ez = self.eye()
        dx, dz = ex - nx, ez - nz
        if self.under_a_gap(node):
            # The log above a chopped trunk's gap sits in the crown's bottom layer: its sides are behind
            # leaves (the expert dug a leaf before its log in 66 of 112 demonstrations, teaching a policy to
            # dig leaves looking up), its bottom face is seen through the gap. Aim at the near part of it.
            d = max(math.hypot(dx, dz), 1e-6)
            return nx + 0.25 * dx / d, ny - 0.5, nz + 0.25 * dz / d
        if abs(dx) > abs(dz):
            return nx + 0.5 * math.copysign(1, dx), ny, nz
        return nx, ny, nz + 0.5 * math.copysign(1, dz)

    def plan(self):
        if self.tool_slot is not None:
            yield _act(**{f"hotbar.{self.tool_slot}": 1}), "select_tool"
            yield noop_action(), "select_tool"
        if self.tool is not None:
            yield from self.select(self.tool, "select_tool")
        goal = self.goal + (self.info["inventory"].get(self.drop, 0) if self.more else 0)
        while self.info["inventory"].get(self.drop, 0) < goal:
            node = self.target()
            if node is None:
                yield from self.wait(1, "search")
                continue
            x, _, z = self.info["pos"]
            # a gap's log above is seen through the gap from close by (1.1 blocks: its bottom face spans
            # 18-41 degrees up; from 2 blocks it is a 7-degree sliver between the crown's leaves)
            gap = self.under_a_gap(node)
            approach, slack = (min(self.approach, 1.1), 0.2) if gap else (self.approach, 0.5)
            if math.hypot(node[0] - x, node[2] - z) > approach + slack:
                yield from self.walk_to((node[0], node[2]), approach, "approach")
            point = self.face_point(node)
            # perturbed (Expert.perturb) at side faces only: off a ground node lies the next one, as good
            side = self.face == "side"
            perturbed = (yield from self.aim_off(point)) if side else False
            yield from self.turn_to(point, "aim", attack=int(perturbed))
            mined_before = sum(self.info["mine_block"].values())
            jolt_at, steps = self.jolt_at() if side else None, 0
            while steps < 120:  # 3.5 s for a log by hand; a node the tool cannot dig never breaks
                if sum(self.info["mine_block"].values()) > mined_before:
                    break
                if steps == jolt_at:  # the aim slips (perturbation); the dig restarts once it is back
                    yield from self.jolt()
                    jolt_at, steps = None, 0
                    continue
                dyaw, dpitch = self.aim_error(point)
                yield _act(attack=1, camera=[_clamp(dpitch, 2), _clamp(dyaw, 2)]), "dig"
                steps += 1
            else:
                self.skip.add(node)  # something in front of it resisted: try another one
            yield noop_action(), "dig"


class PlaceExpert(Expert):
    """Place `goal` blocks of `item` (from the hotbar; default: one on each of `cells`) on the ground, trying
    `cells` (x, z) in turn by right-clicking their top faces; a cell where three clicks place nothing is left
    for the next one, so spare cells after the first `goal` stand in for cells that cannot take a block."""

    def __init__(self, task: Task, item: str, cells: list[tuple[int, int]], ground_y: int = 8,
                 goal: int | None = None):
        super().__init__(task)
        self.item, self.cells, self.ground_y = item, cells, ground_y
        self.goal = len(cells) if goal is None else goal
        if not 0 < self.goal <= len(cells):
            raise ValueError(f"PlaceExpert: goal {self.goal} needs 1..{len(cells)} cells")

    def plan(self):
        yield from self.select(self.item, "select_block")
        yield from self.wait(1, "select_block")
        start = self.info["place_block"].get(self.item, 0)
        for cx, cz in self.cells:
            if self.info["place_block"].get(self.item, 0) - start >= self.goal:
                break
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
