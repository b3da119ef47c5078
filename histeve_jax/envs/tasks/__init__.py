"""Tasks: YAML files shipped with the package (this directory), loaded and validated by name.

A task file holds::

    name: mine_log                 # must match the file name
    category: mine                 # one of CATEGORIES (MineStudio Bench / OpenHA style)
    text: chop a tree and collect a log   # may name a slot: "{slot:default:tree}" (render_instruction)
    max_steps: 600                 # step budget (20 steps per second)
    init:                          # the initial state every reset restores (all optional)
      pos: [0.0, 8.5, 0.0]         # feet position; the arena's grass nodes are at y = 8, feet stand at 8.5
      yaw: 0.0                     # degrees, base.py's conventions
      pitch: 0.0
      time_of_day: 0.5             # 0.5 = noon; time does not advance
      hp: 20
      inventory: [{item: default:pick_wood, count: 1, slot: 1}]   # slot optional (1-based)
      trees: [{pos: [0, 9, 3], height: 4}]                         # trunk base, leaves on top
      nodes: [{pos: [2, 9, 0], name: default:stone}]
      fills: [{pos1: [..], pos2: [..], name: default:stone}]
      vary: {pos: 0.25, yaw: 15, pitch: 0, gap: 0}   # the start's spread where the env randomizes it
                                 # (defaults): +- blocks on x and z (never inside a trunk), +- degrees about
                                 # yaw and pitch, and the chance that each tree starts with its eye-level log
                                 # already dug (the trunk a chop leaves)
    success: {inventory: {default:tree: ">=1"}}
    subgoals:                      # optional, in order: progress checks for long-horizon tasks
      - {name: logs, check: {inventory: {default:tree: ">=3"}}}

A check is a dict whose keys all must hold: ``inventory`` or an event counter (``mine_block``, ``craft_item``,
``pickup``, ``place_block``, ``use_item``) mapping item -> condition (an int n means ">= n"; strings ">= n",
"> n", "== n", "<= n", "< n"); ``near: {pos: [x, y, z], radius: r}`` (player within r blocks);
``any: [check, ...]`` (one of them holds).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

TASK_DIR = Path(__file__).resolve().parent
CATEGORIES = ("mine", "craft", "smelt", "build", "explore", "long_horizon")
COUNTER_KEYS = ("inventory", "mine_block", "craft_item", "pickup", "place_block", "use_item")
_OPS = {">=": operator.ge, ">": operator.gt, "==": operator.eq, "<=": operator.le, "<": operator.lt}
_COND = re.compile(r"^\s*(>=|>|==|<=|<)\s*(\d+)\s*$")
# "{slot:<item>}" in a task's text: the inventory slot that holds the item when the instruction is given.
_SLOT_OF = re.compile(r"\{slot:([a-z0-9_]+:[a-z0-9_]+)\}")


def render_instruction(text: str, info: Mapping[str, Any], where: str = "instruction") -> str:
    """``text`` with each ``{slot:<item>}`` replaced by the first inventory slot (1-based) holding the item in
    ``info["inventory_slots"]``: what the screen shows a player, named by the instruction so that a policy
    that cannot read a 4 px slot is told which one to take (the harness's planner knows the inventory).
    A text without placeholders is returned as it is. ValueError naming ``where`` and the item when no slot
    holds it (the harness only starts a subtask whose inputs are held)."""
    if "{" not in text:
        return text

    def slot(m: re.Match) -> str:
        for i, s in enumerate(info.get("inventory_slots") or (), start=1):
            if s["type"] == m.group(1):
                return str(i)
        raise ValueError(f"{where}: {text!r} names the slot of {m.group(1)}, and no inventory slot holds it")

    return _SLOT_OF.sub(slot, text)


class TaskError(ValueError):
    """A task file or check that does not follow the schema; the message names the file and key."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One task: what to say to the agent, where it starts, when it has succeeded."""

    name: str
    category: str
    text: str
    max_steps: int
    init: dict[str, Any]
    success: dict[str, Any]
    subgoals: tuple[tuple[str, dict[str, Any]], ...] = ()
    source: str = ""

    def is_success(self, info: Mapping[str, Any]) -> bool:
        """Whether the success check holds on an env info dict."""
        return evaluate_check(self.success, info)

    def instruction(self, info: Mapping[str, Any]) -> str:
        """What the agent is told from the state ``info``: ``text`` with its slots filled in
        (``render_instruction``). Read once, where an episode or invocation starts."""
        return render_instruction(self.text, info, f"task {self.name}")

    def varied(self, **vary: float) -> Task:
        """This task with some of its start's spread replaced (``init.vary`` keys: ``clutter=1.0`` always
        starts cluttered, ``clutter=0.0`` never); the task file is left as it is."""
        unknown = set(vary) - set(DEFAULT_VARY)
        if unknown:
            raise TaskError(f"task {self.name}: unknown init.vary key(s) {sorted(unknown)}")
        given = {k: _vary_value(k, v, f"task {self.name}: init") for k, v in vary.items()}
        spread = {**DEFAULT_VARY, **self.init.get("vary", {}), **given}
        return dataclasses.replace(self, init={**self.init, "vary": spread})

    def subgoals_done(self, info: Mapping[str, Any]) -> list[str]:
        """Names of the subgoals whose checks hold on `info`."""
        return [name for name, check in self.subgoals if evaluate_check(check, info)]


def _parse_condition(cond: Any, where: str) -> tuple[str, int]:
    if isinstance(cond, bool):
        raise TaskError(f"{where}: condition must be an int or a string like '>=1', got {cond!r}")
    if isinstance(cond, int):
        return ">=", cond
    if isinstance(cond, str):
        m = _COND.match(cond)
        if m:
            return m.group(1), int(m.group(2))
    raise TaskError(f"{where}: condition must be an int or a string like '>=1', got {cond!r}")


def validate_check(check: Any, where: str) -> None:
    """Raise TaskError (naming `where` and the key) unless `check` follows the check schema."""
    if not isinstance(check, Mapping) or not check:
        raise TaskError(f"{where}: a check must be a non-empty mapping, got {check!r}")
    for key, value in check.items():
        w = f"{where}.{key}"
        if key in COUNTER_KEYS:
            if not isinstance(value, Mapping) or not value:
                raise TaskError(f"{w}: must map item names to conditions, got {value!r}")
            for item, cond in value.items():
                if not isinstance(item, str) or not item:
                    raise TaskError(f"{w}: item names must be strings, got {item!r}")
                _parse_condition(cond, f"{w}.{item}")
        elif key == "near":
            if not isinstance(value, Mapping) or set(value) != {"pos", "radius"}:
                raise TaskError(f"{w}: must be {{pos: [x, y, z], radius: r}}, got {value!r}")
            _vec3(value["pos"], f"{w}.pos")
            if not isinstance(value["radius"], int | float) or value["radius"] <= 0:
                raise TaskError(f"{w}.radius: must be a positive number, got {value['radius']!r}")
        elif key == "any":
            if not isinstance(value, list) or not value:
                raise TaskError(f"{w}: must be a non-empty list of checks")
            for i, sub in enumerate(value):
                validate_check(sub, f"{w}[{i}]")
        else:
            raise TaskError(f"{w}: unknown check key; expected one of {list(COUNTER_KEYS) + ['near', 'any']}")


def evaluate_check(check: Mapping[str, Any], info: Mapping[str, Any]) -> bool:
    """Whether every clause of `check` holds on `info` (an env info dict)."""
    for key, value in check.items():
        if key in COUNTER_KEYS:
            counts = info.get(key) or {}
            for item, cond in value.items():
                op, n = _parse_condition(cond, key)
                if not _OPS[op](int(counts.get(item, 0)), n):
                    return False
        elif key == "near":
            pos = info["pos"]
            d2 = sum((float(a) - float(b)) ** 2 for a, b in zip(pos, value["pos"], strict=True))
            if d2 > float(value["radius"]) ** 2:
                return False
        elif key == "any":
            if not any(evaluate_check(sub, info) for sub in value):
                return False
        else:
            raise TaskError(f"unknown check key {key!r}")
    return True


def _vec3(v: Any, where: str) -> list[float]:
    if not isinstance(v, list | tuple) or len(v) != 3 or not all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in v
    ):
        raise TaskError(f"{where}: must be a list of 3 numbers, got {v!r}")
    return [float(x) for x in v]


def _name(v: Any, where: str) -> None:
    # item and node names go to the mod verbatim; a non-string would fail there without naming the key
    if not isinstance(v, str) or not v:
        raise TaskError(f"{where}: must be an item or node name like 'default:dirt', got {v!r}")


_INIT_KEYS = {"pos", "yaw", "pitch", "time_of_day", "hp", "inventory", "trees", "nodes", "fills", "vary"}
# The spread of a randomized start (``LuantiEnv(randomize_init=True)``) where ``init.vary`` does not say:
# +- blocks on x and z, +- degrees of yaw and of pitch, each tree's chance to lack its eye-level log, and
# the chance to start instead right beside a trunk chopped once, facing its gap (where a chop leaves the
# player: the second log of wooden_pickaxe is dug from there), and the chance that the inventory starts
# cluttered as a long-horizon episode leaves it (``clutter_inventory``: leaves on slot 1, each listed stack
# one slot on and up to two items larger; no task draws it now: README, "The GUI"), and the chance to start
# where one or two earlier digs left the player (``dug``: dirt_wall's second and third ``mine_dirt``), and the
# chance to start pressed against a trunk's face, where a policy that walked on into it stands (``against``:
# half of them chopped once and looking up into the gap, half intact with bark filling the view), and the
# chance to start far from every trunk (``far``: at least ``FAR_FROM_TREES`` blocks, anywhere in the arena,
# where the harness's teleports and a policy that wandered off leave the player: a mine_log from there walks).
DEFAULT_VARY = {"pos": 0.25, "yaw": 15.0, "pitch": 0.0, "gap": 0.0, "beside": 0.0, "clutter": 0.0, "dug": 0.0,
                "against": 0.0, "far": 0.0}
_VARY_MAX = {"pos": 10.0, "yaw": 180.0, "pitch": 89.5, "gap": 1.0, "beside": 1.0, "clutter": 1.0, "dug": 1.0,
             "against": 1.0, "far": 1.0}
FAR_FROM_TREES = 6.0  # blocks (Euclidean, trunk centre to the player) of ``init.vary.far``'s starts


def _vary_value(key: str, v: Any, where: str) -> float:
    """``init.vary``'s value for ``key`` as a float; a TaskError naming ``where`` if out of its range."""
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v <= _VARY_MAX[key]:
        raise TaskError(f"{where}.vary.{key}: must be a number in [0, {_VARY_MAX[key]}], got {v!r}")
    return float(v)
CLUTTER_ITEM, CLUTTER_MAX = "default:leaves", 6  # what a chop that dug into the crown leaves on slot 1


def clutter_inventory(inventory: list[Mapping[str, Any]], rng: Any) -> list[dict[str, Any]]:
    """``inventory`` (the task's init list) as a long-horizon episode leaves it before the craft: 1 to
    ``CLUTTER_MAX`` leaves on slot 1 (dug before the log), every listed stack on the next slot (slot 32 stays,
    the last) and 0 to 2 items larger (a chop that went on past its log). ``rng``: a numpy Generator."""
    out = [{"item": CLUTTER_ITEM, "count": int(rng.integers(1, CLUTTER_MAX + 1)), "slot": 1}]
    for it in inventory:
        slot = it.get("slot", 1)
        out.append({"item": it["item"], "count": int(it.get("count", 1)) + int(rng.integers(0, 3)),
                    "slot": slot if slot == 32 else slot + 1})
    return out


def _validate_init(init: Any, where: str) -> dict[str, Any]:
    if init is None:
        return {}
    if not isinstance(init, Mapping):
        raise TaskError(f"{where}: must be a mapping")
    unknown = set(init) - _INIT_KEYS
    if unknown:
        raise TaskError(f"{where}: unknown key(s) {sorted(unknown)}; expected {sorted(_INIT_KEYS)}")
    out = dict(init)
    if "pos" in init:
        out["pos"] = _vec3(init["pos"], f"{where}.pos")
    for k, lo, hi in (("yaw", -360, 360), ("pitch", -90, 90), ("time_of_day", 0, 1), ("hp", 1, 20)):
        if k in init:
            v = init[k]
            if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
                raise TaskError(f"{where}.{k}: must be a number in [{lo}, {hi}], got {v!r}")
    for i, it in enumerate(init.get("inventory") or []):
        w = f"{where}.inventory[{i}]"
        if not isinstance(it, Mapping) or "item" not in it or set(it) - {"item", "count", "slot"}:
            raise TaskError(f"{w}: must be {{item, count, slot}} with item required, got {it!r}")
        _name(it["item"], f"{w}.item")
        if not isinstance(it.get("count", 1), int) or it.get("count", 1) < 1:
            raise TaskError(f"{w}.count: must be a positive int")
        if "slot" in it and (not isinstance(it["slot"], int) or not 1 <= it["slot"] <= 32):
            raise TaskError(f"{w}.slot: must be an int in [1, 32]")
    for i, t in enumerate(init.get("trees") or []):
        w = f"{where}.trees[{i}]"
        if not isinstance(t, Mapping) or "pos" not in t or set(t) - {"pos", "height"}:
            raise TaskError(f"{w}: must be {{pos, height}}, got {t!r}")
        _vec3(t["pos"], f"{w}.pos")
        if not isinstance(t.get("height", 4), int) or not 1 <= t.get("height", 4) <= 10:
            raise TaskError(f"{w}.height: must be an int in [1, 10]")
    for i, n in enumerate(init.get("nodes") or []):
        w = f"{where}.nodes[{i}]"
        if not isinstance(n, Mapping) or set(n) != {"pos", "name"}:
            raise TaskError(f"{w}: must be {{pos, name}}, got {n!r}")
        _vec3(n["pos"], f"{w}.pos")
        _name(n["name"], f"{w}.name")
    for i, f in enumerate(init.get("fills") or []):
        w = f"{where}.fills[{i}]"
        if not isinstance(f, Mapping) or set(f) != {"pos1", "pos2", "name"}:
            raise TaskError(f"{w}: must be {{pos1, pos2, name}}, got {f!r}")
        _vec3(f["pos1"], f"{w}.pos1")
        _vec3(f["pos2"], f"{w}.pos2")
        _name(f["name"], f"{w}.name")
    if "vary" in init:
        vary = init["vary"]
        if not isinstance(vary, Mapping) or set(vary) - set(DEFAULT_VARY):
            raise TaskError(f"{where}.vary: must be a mapping with keys from {sorted(DEFAULT_VARY)}, "
                            f"got {vary!r}")
        out["vary"] = {**DEFAULT_VARY, **{k: _vary_value(k, v, where) for k, v in vary.items()}}
    return out


def task_from_dict(d: Any, source: str = "<dict>") -> Task:
    """Build and validate a Task from a parsed YAML mapping; errors name `source` and the key."""
    if not isinstance(d, Mapping):
        raise TaskError(f"{source}: a task must be a mapping, got {type(d).__name__}")
    required = ("name", "category", "text", "max_steps", "success")
    missing = [k for k in required if k not in d]
    if missing:
        raise TaskError(f"{source}: missing key(s) {missing}")
    unknown = set(d) - {*required, "init", "subgoals"}
    if unknown:
        raise TaskError(f"{source}: unknown key(s) {sorted(unknown)}")
    if d["category"] not in CATEGORIES:
        raise TaskError(f"{source}.category: must be one of {CATEGORIES}, got {d['category']!r}")
    if not isinstance(d["text"], str) or not d["text"].strip():
        raise TaskError(f"{source}.text: must be a non-empty string")
    rest = _SLOT_OF.sub("", d["text"])
    if "{" in rest or "}" in rest:
        raise TaskError(f"{source}.text: the only placeholder is {{slot:<mod>:<item>}}, got {d['text']!r}")
    if not isinstance(d["max_steps"], int) or d["max_steps"] < 1:
        raise TaskError(f"{source}.max_steps: must be a positive int, got {d['max_steps']!r}")
    validate_check(d["success"], f"{source}.success")
    subgoals = []
    for i, sg in enumerate(d.get("subgoals") or []):
        if not isinstance(sg, Mapping) or set(sg) != {"name", "check"}:
            raise TaskError(f"{source}.subgoals[{i}]: must be {{name, check}}, got {sg!r}")
        validate_check(sg["check"], f"{source}.subgoals[{i}].check")
        subgoals.append((str(sg["name"]), dict(sg["check"])))
    return Task(
        name=str(d["name"]), category=d["category"], text=d["text"].strip(), max_steps=d["max_steps"],
        init=_validate_init(d.get("init"), f"{source}.init"), success=dict(d["success"]),
        subgoals=tuple(subgoals), source=source,
    )


def list_tasks() -> list[str]:
    """Names of the tasks shipped with the package."""
    return sorted(p.stem for p in TASK_DIR.glob("*.yaml"))


# "<name or path>[key=value,...]": a task with some of its ``init.vary`` replaced (``Task.varied``).
_VARIANT = re.compile(r"^(?P<base>[^\[\]]+)\[(?P<vary>[^\[\]]*)\]$")


def parse_variant(spec: str) -> tuple[str, dict[str, float]]:
    """``"mine_log[against=1,pos=3]"`` -> ``("mine_log", {"against": 1.0, "pos": 3.0})``; a spec without
    brackets is itself with no change. A malformed spec is a TaskError naming it."""
    m = _VARIANT.match(spec)
    if m is None:
        if "[" in spec or "]" in spec:
            raise TaskError(f"task {spec!r}: a variant is written name[key=value,...], e.g. "
                            f"'mine_log[against=1]'")
        return spec, {}
    vary: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in m["vary"].split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if key not in DEFAULT_VARY:
            raise TaskError(f"task {spec!r}: unknown init.vary key {key!r}; expected one of "
                            f"{sorted(DEFAULT_VARY)}")
        try:
            vary[key] = float(value if eq else "")
        except ValueError:
            raise TaskError(f"task {spec!r}: {item!r} is not key=number") from None
    if not vary:
        raise TaskError(f"task {spec!r}: empty variant (write the name alone, or name[key=value,...])")
    return m["base"].strip(), vary


def load_task(name_or_path: str | Path) -> Task:
    """Load a shipped task by name (``"mine_log"``) or any task YAML by path, either followed by a variant
    of its start's spread, ``"mine_log[against=1]"`` (``Task.varied``; the name stays the base task's)."""
    if isinstance(name_or_path, str):
        base, vary = parse_variant(name_or_path)
        if vary:
            task = load_task(base)
            try:
                varied = task.varied(**vary)
            except TaskError as e:
                raise TaskError(f"task {name_or_path!r}: {e}") from e
            given = ",".join(f"{k}={v:g}" for k, v in vary.items())
            return dataclasses.replace(varied, source=f"{task.source}[{given}]")
    p = Path(name_or_path)
    if p.suffix not in (".yaml", ".yml"):
        p = TASK_DIR / f"{name_or_path}.yaml"
        if not p.exists():
            raise TaskError(f"no task named {name_or_path!r}; shipped tasks: {list_tasks()}")
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise TaskError(f"{p}: not valid YAML: {e}") from e
    task = task_from_dict(d, str(p))
    if p.parent == TASK_DIR and task.name != p.stem:
        raise TaskError(f"{p}.name: {task.name!r} does not match the file name {p.stem!r}")
    return task
