"""Experts that act in a GUI: craft in the inventory's grid, smelt in a furnace."""

from __future__ import annotations

import math

from histeve_jax.envs.base import noop_action
from histeve_jax.envs.experts.core import (
    CRAFT_OUTPUT_XY,
    CRAFT_XY,
    FURNACE_DST_XY,
    FURNACE_FUEL_XY,
    FURNACE_SLOT_XY,
    FURNACE_SRC_XY,
    REACH,
    RECIPES,
    SLOT_XY,
    Expert,
)
from histeve_jax.envs.tasks import Task


class CraftExpert(Expert):
    """Open the inventory, lay out a recipe in the 3x3 grid by clicking, take the output, close."""

    in_inventory = True

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
        # No fixed pauses (the env returns a GUI action's frame once it shows): a pause is time the policy's
        # history frame counts, and a policy that does not pause then sees history it was never shown.
        opened = not self.info["is_gui_open"]
        yield from self.open_inventory()
        if opened:  # perturbation: clicks on nothing first, where the inventory put the pointer or astray
            yield from self.click_astray()
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
                count = self.info["inventory_slots"][slot - 1]["quantity"]
                yield from self.click_astray(near=SLOT_XY[slot])  # perturbation: the hand is empty here
                yield from self.cursor_to(SLOT_XY[slot], f"pick_{item}")
                yield from self.click("attack", f"pick_{item}")  # the whole stack onto the cursor
                for cell in cells:
                    yield from self.cursor_to(CRAFT_XY[cell], f"place_{item}")
                    yield from self.click("use", f"place_{item}")  # one item into the grid
                if count > len(cells):  # the rest to the empty slot farthest from its own. Back on its
                    # own slot, "just clicked the stack's slot" looks the same before the grid as after it
                    # (the held stack is drawn where the slot's stack was) and the two want different moves
                    # next (craft_sticks 4/20); on the neighbouring slot the policy still took it for the
                    # click before the grid (2/20: the frames differ by one slot's width). A right click
                    # that takes half a stack leaves nothing to return in some recipes, but then the same
                    # "arrived on the first slot" frame wants a left click in one task and a right click in
                    # another: that cost the pickaxe run every craft (1, 0, 0 of 20). With none left, a click
                    # on an empty slot with an empty hand would change nothing on screen: a policy could not
                    # see it had made it.
                    yield from self.cursor_to(SLOT_XY[self.far_empty_slot(slot)], f"return_{item}")
                    yield from self.click("attack", f"return_{item}")
            # The server computes the output preview from the grid; clicking before it arrives takes nothing.
            for _ in range(20):
                if (not self.grid_missing() and not self.grid_wrong()) or self.info.get("craft_grid") is None:
                    break
                yield noop_action(), "wait_recipe"
            if (self.grid_missing() or self.grid_wrong()) and self.info.get("craft_grid") is not None:
                continue
            yield from self.click_astray(near=CRAFT_OUTPUT_XY)  # the hand is empty: all placed or returned
            yield from self.cursor_to(CRAFT_OUTPUT_XY, "take_output")
            yield from self.click("attack", "take_output")
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
