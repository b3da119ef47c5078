"""The rules planner: the next subtask from minetest_game's crafting, smelting and digging rules and the
task's subgoals. Deterministic, no model: the harness's reference planner.

Targets: the first subgoal that is not verified yet (else the final goal) becomes inventory targets: an
``inventory`` clause asks to hold n; a cumulative counter (``pickup``, ``craft_item``, ``mine_block``) asks
for the n - counter[item] still missing on top of what is held; ``place_block`` asks to place the rest, which
needs that many held. A bill of materials is then expanded from the current inventory (material
requirements planning: consumers before producers, each production rounded up to whole crafts), and the
first production whose inputs are all at hand is the next subtask, with ``count`` = the total to hold
(clamped to the schema's maximum; the next plan goes on from there). Tools are not consumed: any pickaxe
of the needed level in the inventory will do, else the cheapest is made. A smelt needs a placed furnace.

``unit_steps``: each production asks for one run's output more than is held (one log, one dirt block, one
craft; a smelt stays one batch, its fuel burnt per batch) instead of the whole total, and the next plan asks
for the next: the unit each atomic task's demonstrations end at, so a trained policy is invoked on the
skill it learnt (a policy that digs one dirt block and stops waits out a ``mine_dirt(count=3)`` budget, and
is done with each ``count=1``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

from histeve_jax.envs.experts import RECIPES
from histeve_jax.harness.planners.base import PlanningContext, PlanResult

# minetest_game: a log makes 4 planks, a plank 4 sticks; every other recipe used here makes one.
YIELD = {"default:wood": 4, "default:stick": 4}
CRAFT_SUBTASK = {"default:wood": "craft_planks", "default:stick": "craft_sticks",
                 "default:pick_wood": "craft_wooden_pickaxe", "default:pick_stone": "craft_stone_pickaxe",
                 "default:pick_steel": "craft_steel_pickaxe", "default:furnace": "craft_furnace"}
# item -> (subtask, pickaxes that dig its node, cheapest first); coal is cracky 3, iron cracky 2.
_WOOD_UP = ("default:pick_wood", "default:pick_stone", "default:pick_steel")
MINE = {"default:tree": ("mine_log", ()), "default:dirt": ("mine_dirt", ()),
        "default:cobble": ("mine_stone", _WOOD_UP), "default:coal_lump": ("mine_coal", _WOOD_UP),
        "default:iron_lump": ("mine_iron", _WOOD_UP[1:])}
# smelted item -> (subtask, ore, fuel); one coal lump burns 40 s, an ingot cooks in 3 s: 8 is a safe bound.
SMELT = {"default:steel_ingot": ("smelt_iron", "default:iron_lump", "default:coal_lump")}
INGOTS_PER_FUEL = 8
PLACED_FURNACE = "placed:default:furnace"  # a pseudo-item: a furnace node in sight
PLACE = {PLACED_FURNACE: ("place_furnace", "default:furnace")}


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one item is obtained: the subtask, items consumed per run, tools (any one), output per run."""

    subtask: str
    inputs: dict[str, int]
    tools: tuple[str, ...] = ()
    per_run: int = 1


def rule_for(item: str) -> Rule | None:
    """The rule that produces ``item`` (None for items nothing produces)."""
    if item in CRAFT_SUBTASK:
        counts: dict[str, int] = {}
        for ing in RECIPES[item].values():
            counts[ing] = counts.get(ing, 0) + 1
        return Rule(CRAFT_SUBTASK[item], counts, per_run=YIELD.get(item, 1))
    if item in MINE:
        sub, tools = MINE[item]
        return Rule(sub, {}, tools)
    if item in SMELT:
        sub, ore, fuel = SMELT[item]
        return Rule(sub, {ore: 1}, (PLACED_FURNACE,))  # fuel is added per batch in _expand
    if item in PLACE:
        sub, what = PLACE[item]
        return Rule(sub, {what: 1})
    return None


def _stock(info: Mapping[str, Any]) -> dict[str, int]:
    s = {k: int(v) for k, v in (info.get("inventory") or {}).items()}
    s[PLACED_FURNACE] = int(any(n == "default:furnace" for n, _ in info.get("nearby") or []))
    return s


def targets_of(check: Mapping[str, Any], info: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """(hold targets, place targets) of one check on ``info``; ValueError for clauses it cannot plan."""
    from histeve_jax.envs.tasks import _parse_condition

    hold, place = {}, {}
    inv = info.get("inventory") or {}
    for key, clause in check.items():
        if key not in ("inventory", "pickup", "craft_item", "mine_block", "place_block"):
            raise ValueError(f"the rules planner cannot plan for a {key!r} check")
        for item, cond in clause.items():
            op, n = _parse_condition(cond, f"{key}.{item}")
            if op not in (">=", ">", "=="):
                raise ValueError(f"the rules planner cannot plan for {key}.{item} {op} {n}")
            n += op == ">"
            have = int((info.get(key) or {}).get(item, 0))
            if have >= n:
                continue
            if key == "inventory":
                hold[item] = max(hold.get(item, 0), n)
            elif key == "place_block":
                place[item] = n - have
            else:
                hold[item] = max(hold.get(item, 0), int(inv.get(item, 0)) + n - have)
    return hold, place


def _order(items: list[str]) -> list[str]:
    """Every item reachable from ``items`` through the rules, producers before their consumers."""
    out: list[str] = []

    def visit(item: str, path: tuple[str, ...]) -> None:
        if item in out or item in path:
            return
        rule = rule_for(item)
        if rule is not None:
            extra = (SMELT[item][2],) if item in SMELT else ()
            for dep in (*rule.inputs, *rule.tools[:1], *extra):
                visit(dep, (*path, item))
        out.append(item)

    for it in items:
        visit(it, ())
    return out


def next_production(hold: Mapping[str, int], stock: Mapping[str, int]) -> tuple[str, Rule, int] | None:
    """(item, rule, total to hold) of the first production the bill of materials needs, or None."""
    gross: dict[str, int] = dict(hold)
    order = _order(list(hold))
    produce: dict[str, int] = {}
    for item in reversed(order):  # consumers first: their needs add to their inputs' gross requirement
        net = gross.get(item, 0) - stock.get(item, 0)
        rule = rule_for(item)
        if net <= 0 or rule is None:
            continue
        runs = math.ceil(net / rule.per_run)
        produce[item] = runs * rule.per_run
        for ing, k in rule.inputs.items():
            gross[ing] = gross.get(ing, 0) + runs * k
        if item in SMELT:
            fuel = SMELT[item][2]
            gross[fuel] = gross.get(fuel, 0) + math.ceil(runs / INGOTS_PER_FUEL)
        if rule.tools and not any(stock.get(t, 0) > 0 for t in rule.tools):
            gross[rule.tools[0]] = max(gross.get(rule.tools[0], 0), 1)
    for item in order:  # producers first: the first one needed has its inputs at hand
        if produce.get(item, 0) > 0:
            rule = rule_for(item)
            if rule is None:
                return None
            return item, rule, stock.get(item, 0) + produce[item]
    return None


class RulesPlanner:
    """The deterministic planner (see the module docstring)."""

    name = "rules"

    def __init__(self, unit_steps: bool = False):
        self.unit_steps = unit_steps

    def choose(self, ctx: PlanningContext) -> tuple[str, dict[str, Any]]:
        """(subtask name, parameters) for the context; ValueError when the rules find nothing to do."""
        info = ctx.info
        done = set(info.get("subgoals_done") or [])
        checks = [c for n, c in ctx.subgoals if n not in done] + [ctx.goal_check]
        for check in checks:
            try:
                hold, place = targets_of(check, info)
            except ValueError:
                continue  # a subgoal the rules cannot plan for: the final goal still drives
            if hold or place:
                break
        else:
            raise ValueError("every goal clause already holds: nothing left to plan")
        stock = _stock(info)
        for item, n in place.items():
            hold[item] = max(hold.get(item, 0), n)
        step = next_production(hold, stock)
        if step is None:
            if place:
                item, n = next(iter(place.items()))
                placed = int((info.get("place_block") or {}).get(item, 0))
                if item != "default:dirt":
                    raise ValueError(f"no rule places {item}")
                if placed == 0 and n >= 3 and "build_wall" in ctx.admissible:
                    return "build_wall", {}
                return "place_dirt", {"count": placed + 1}  # placement counters are cumulative
            raise ValueError(f"no rule produces what is missing: {hold}")
        item, rule, total = step
        if self.unit_steps and item not in SMELT:  # a smelt burns a fuel per batch: it stays one batch
            total = min(total, stock.get(item, 0) + rule.per_run)
        schema = ctx.schemas.get(rule.subtask) or ctx.admissible.get(rule.subtask)
        params: dict[str, Any] = {}
        if schema is not None and "count" in schema.parameters:
            p = schema.parameters["count"]
            params["count"] = max(p.minimum, min(p.maximum, total))
        return rule.subtask, params

    def plan(self, ctx: PlanningContext) -> PlanResult:
        """The next subtask, or a PlanResult whose error says why there is none."""
        t0 = time.monotonic()
        fail = lambda msg: PlanResult(None, 1, msg, [], time.monotonic() - t0, self.name)
        try:
            name, params = self.choose(ctx)
        except ValueError as e:
            return fail(str(e))
        if name not in ctx.admissible:
            return fail(f"the rules call for {name or 'nothing'}{params or ''}, which is not admissible now")
        subtask = ctx.admissible[name].instantiate(params)
        return PlanResult(subtask, 1, "", [subtask.label], time.monotonic() - t0, self.name)
