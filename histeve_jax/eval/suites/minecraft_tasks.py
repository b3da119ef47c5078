"""Minecraft suite tasks: MineStudio Bench YAMLs (read from the installed ``minestudio`` package at run time)
and OpenHA-style tasks (success = any reward > 0 from the task's reward events), as ``MinecraftBenchTask``.

A task file uses MineStudio's callback keys (``minestudio.simulator.callbacks`` ``create_from_conf``)::

    text: Collect wood from trees.            # the instruction (with the commands, all MineStudio reads)
    custom_init_commands: [/give @s ...]      # or `commands`: chat commands run after reset
    init_inventory: [{slot: 0, type: wooden_axe, quantity: 1}]          # InitInventoryCallback, exact form
    summon_mobs: [{name: sheep, number: 2, range_x: [-3, 3], range_z: [-3, 3]}]   # SummonMobsCallback
    reward_cfg:                               # or `rewards` (OpenHA's key): RewardsCallback's reward_cfg
      - {event: mine_block, identity: mine logs, objects: [oak_log], reward: 1.0, max_reward_times: 1}
    max_steps: 400                            # or `maximum_steps` (OpenHA); else the suite's default

``defaults`` and ``reference_video`` (present in MineStudio Bench files) are accepted and unused. The init is
applied the way MineStudio's callbacks do it, as chat commands after reset: the inventory (``/replaceitem``,
MineStudio's slot mapping), then the commands, then the mobs (positions drawn per episode seed, see
``MinecraftBenchTask.for_seed``).

The reward rule: MineStudio's ``RewardsCallback`` pays ``reward`` on a step where the summed count of the
event's ``objects`` grew, at most ``max_reward_times`` times per ``identity``; OpenHA stops an episode at the
first step with reward > 0 and calls it a success. Our backend's event counters are cumulative since reset
(``envs/base.py``), so "some step paid a reward" is "some paying event's objects have a count > 0 now" (the
counters never decrease), a check on one ``info`` dict.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from histeve_jax.envs.base import EVENT_KEYS
from histeve_jax.envs.minestudio import MineStudioTask, minestudio_task_from_dict
from histeve_jax.envs.tasks import TaskError

SPLITS = ("simple", "hard")
BENCH_MAX_STEPS = 600  # MineStudio Bench files give no length; its reference videos are 600 frames
OPENHA_MAX_STEPS = 400
OPENHA_TASK_DIR = Path(__file__).resolve().parent / "openha_tasks"
_KEYS = {"text", "custom_init_commands", "commands", "defaults", "reference_video", "init_inventory",
         "summon_mobs", "reward_cfg", "rewards", "max_steps", "maximum_steps", "blocks", "success"}
_REWARD_KEYS = {"event", "identity", "objects", "reward", "max_reward_times"}
_EQUIP = {0: "weapon.mainhand", 40: "weapon.offhand", 36: "armor.feet", 37: "armor.legs", 38: "armor.chest",
          39: "armor.head"}  # MineStudio's InitInventoryCallback slot numbering


@dataclasses.dataclass(frozen=True)
class RewardEvent:
    """One entry of MineStudio's ``RewardsCallback`` reward_cfg."""

    event: str
    identity: str
    objects: tuple[str, ...]
    reward: float
    max_reward_times: int

    def pays(self, info: Mapping[str, Any]) -> bool:
        """Whether this event has paid a positive reward by the step of ``info`` (counts since reset)."""
        if self.reward <= 0 or self.max_reward_times < 1:
            return False
        counts = info.get(self.event) or {}
        return sum(int(counts.get(o, 0)) for o in self.objects) > 0


@dataclasses.dataclass(frozen=True)
class MinecraftBenchTask(MineStudioTask):
    """A MineStudio task that ``run_episode`` and ``MineStudioEnv`` both take (name, text, max_steps, ...).

    ``is_success``: any reward event paid (OpenHA), else the optional ``success`` check, else False
    (MineStudio Bench is judged afterwards by the VLM). ``key`` is ``split/name``: Bench names repeat
    across splits.
    """

    split: str = ""
    source: str = ""
    rewards: tuple[RewardEvent, ...] = ()
    mobs: tuple[dict[str, Any], ...] = ()
    subgoals: tuple[tuple[str, dict[str, Any]], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.split}/{self.name}" if self.split else self.name

    def rewards_paid(self, info: Mapping[str, Any]) -> list[str]:
        """Identities of the reward events that have paid by the step of ``info``."""
        return [r.identity for r in self.rewards if r.pays(info)]

    def is_success(self, info: Mapping[str, Any]) -> bool:
        if self.rewards:
            return bool(self.rewards_paid(info))
        return super().is_success(info)

    def subgoals_done(self, info: Mapping[str, Any]) -> list[str]:
        return []

    def for_seed(self, seed: int) -> MinecraftBenchTask:
        """This task with its mobs' summon commands appended, positions drawn from ``seed`` (reproducible)."""
        if not self.mobs:
            return self
        rng = np.random.default_rng(seed)
        summons = []
        for mob in self.mobs:
            for _ in range(mob["number"]):
                x, z = rng.uniform(*mob["range_x"]), rng.uniform(*mob["range_z"])
                # the command SummonMobsCallback sends
                summons.append(f"/execute as @p at @p run summon minecraft:{mob['name']} "
                               f"~{x:.2f} ~3 ~{z:.2f} {{Age:0}}")
        return dataclasses.replace(self, commands=self.commands + tuple(summons), mobs=())


# ---------------------------------------------------------------------------------------------- parsing


def _inventory_commands(items: Any, where: str) -> list[str]:
    if not isinstance(items, list):
        raise TaskError(f"{where}: must be a list of {{slot, type, quantity}}, got {items!r}")
    out = []
    for i, it in enumerate(items):
        w = f"{where}[{i}]"
        if not isinstance(it, Mapping) or not {"slot", "type", "quantity"} <= set(it):
            raise TaskError(f"{w}: must have slot, type and quantity, got {it!r}")
        slot, kind, q = it["slot"], it["type"], it["quantity"]
        # MineStudio also draws "random" slots and quantities from Python's global RNG; an episode seed
        # would not reproduce them, so only the exact form is taken.
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot <= 40:
            raise TaskError(f"{w}.slot: must be an int in [0, 40] (random slots are not supported), "
                            f"got {slot!r}")
        if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= 64:
            raise TaskError(f"{w}.quantity: must be an int in [1, 64] (conditions and 'random' are not "
                            f"supported), got {q!r}")
        if not isinstance(kind, str) or not kind:
            raise TaskError(f"{w}.type: must be an item name, got {kind!r}")
        mc_slot = _EQUIP.get(slot) or (f"hotbar.{slot}" if slot <= 8 else f"inventory.{slot - 9}")
        out.append(f"/replaceitem entity @p {mc_slot} minecraft:{kind.removeprefix('minecraft:')} {q}")
    return out


def _range(v: Any, where: str) -> tuple[float, float]:
    if not isinstance(v, list | tuple) or len(v) != 2 or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in v) or v[0] > v[1]:
        raise TaskError(f"{where}: must be [low, high] numbers, got {v!r}")
    return float(v[0]), float(v[1])


def _mobs(mobs: Any, where: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(mobs, list):
        raise TaskError(f"{where}: must be a list of {{name, number, range_x, range_z}}, got {mobs!r}")
    out = []
    for i, m in enumerate(mobs):
        w = f"{where}[{i}]"
        name = m.get("name", m.get("mob_name")) if isinstance(m, Mapping) else None
        if not isinstance(name, str) or not name:
            raise TaskError(f"{w}.name: must be a mob name, got {m!r}")
        n = m.get("number")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise TaskError(f"{w}.number: must be a positive int, got {n!r}")
        out.append({"name": name.removeprefix("minecraft:"), "number": n,
                    "range_x": _range(m.get("range_x"), f"{w}.range_x"),
                    "range_z": _range(m.get("range_z"), f"{w}.range_z")})
    return tuple(out)


def _rewards(cfg: Any, where: str) -> tuple[RewardEvent, ...]:
    if not isinstance(cfg, list) or not cfg:
        raise TaskError(f"{where}: must be a non-empty list of reward events")
    out = []
    for i, r in enumerate(cfg):
        w = f"{where}[{i}]"
        if not isinstance(r, Mapping) or set(r) != _REWARD_KEYS:
            got = sorted(r) if isinstance(r, Mapping) else r
            raise TaskError(f"{w}: a reward event has exactly the keys {sorted(_REWARD_KEYS)}, got {got!r}")
        if r["event"] not in EVENT_KEYS:
            raise TaskError(f"{w}.event: {r['event']!r} is not an event our MineStudio backend reports; "
                            f"expected one of {list(EVENT_KEYS)}")
        objs = r["objects"]
        if not isinstance(objs, list) or not objs or not all(isinstance(o, str) and o for o in objs):
            raise TaskError(f"{w}.objects: must be a non-empty list of item names, got {objs!r}")
        # A negative event could cancel a positive one within a step (OpenHA reads the step's sum), which
        # a check on one info dict cannot see; no OpenHA task uses one.
        if isinstance(r["reward"], bool) or not isinstance(r["reward"], int | float) or r["reward"] < 0:
            raise TaskError(f"{w}.reward: must be a number >= 0, got {r['reward']!r}")
        m = r["max_reward_times"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise TaskError(f"{w}.max_reward_times: must be an int >= 0, got {m!r}")
        if not isinstance(r["identity"], str) or not r["identity"]:
            raise TaskError(f"{w}.identity: must be a non-empty string, got {r['identity']!r}")
        out.append(RewardEvent(r["event"], r["identity"], tuple(o.removeprefix("minecraft:") for o in objs),
                               float(r["reward"]), m))
    return tuple(out)


def task_from_dict(d: Any, name: str, *, source: str, split: str = "",
                   default_max_steps: int = BENCH_MAX_STEPS, chat_lines: bool = False) -> MinecraftBenchTask:
    """Parse one task mapping (the module docstring's keys); errors name ``source`` and the key.

    ``chat_lines``: keep init lines that do not start with '/' verbatim, as MineStudio does (it sends them
    to the chat, where they do nothing; simple/travel_by_boat's ``summon minecraft:boat`` is one).
    """
    if not isinstance(d, Mapping):
        raise TaskError(f"{source}: a task file must be a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - _KEYS)
    if unknown:
        raise TaskError(f"{source}.{unknown[0]}: unknown key; expected some of {sorted(_KEYS)}")
    for a, b in (("custom_init_commands", "commands"), ("reward_cfg", "rewards"),
                 ("max_steps", "maximum_steps")):
        if a in d and b in d:
            raise TaskError(f"{source}: both {a!r} and {b!r} given; they are the same key")
    commands = d.get("custom_init_commands", d.get("commands")) or []
    if not isinstance(commands, list) or not all(isinstance(c, str) for c in commands):
        raise TaskError(f"{source}.custom_init_commands: must be a list of strings, got {commands!r}")
    init = _inventory_commands(d["init_inventory"], f"{source}.init_inventory") if "init_inventory" in d \
        else []
    checked = [c for c in commands if c.startswith("/")] if chat_lines else commands
    max_steps = d.get("max_steps", d.get("maximum_steps", default_max_steps))
    base = minestudio_task_from_dict(
        {"text": d.get("text"), "custom_init_commands": checked, "success": d.get("success"),
         "max_steps": max_steps, "blocks": d.get("blocks")}, name, source)
    rewards = _rewards(d.get("reward_cfg", d.get("rewards")), f"{source}.reward_cfg") if (
        "reward_cfg" in d or "rewards" in d) else ()
    mobs = _mobs(d["summon_mobs"], f"{source}.summon_mobs") if "summon_mobs" in d else ()
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields["commands"] = tuple(init + commands)
    return MinecraftBenchTask(**fields, split=split, source=source, rewards=rewards, mobs=mobs)


def load_task_file(path: str | Path, *, split: str = "", default_max_steps: int = BENCH_MAX_STEPS,
                   chat_lines: bool = False) -> MinecraftBenchTask:
    """Parse one task YAML file (the task is named after the file); ``chat_lines`` as in task_from_dict."""
    p = Path(path)
    try:
        d = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise TaskError(f"{p}: cannot read: {e}") from e
    except yaml.YAMLError as e:
        raise TaskError(f"{p}: not valid YAML: {e}") from e
    return task_from_dict(d, p.stem, source=str(p), split=split, default_max_steps=default_max_steps,
                          chat_lines=chat_lines)


# ---------------------------------------------------------------------------------------------- suites


def minestudio_benchmark_dir() -> Path:
    """The installed ``minestudio/benchmark`` directory (task_configs/, auto_eval/); TaskError if absent."""
    spec = importlib.util.find_spec("minestudio")
    if spec is None or not spec.submodule_search_locations:
        raise TaskError("the minestudio package is not installed (pip install --no-deps minestudio): the "
                        "MineStudio Bench task files and rating prompts come from it")
    root = Path(list(spec.submodule_search_locations)[0]) / "benchmark"
    if not root.is_dir():
        raise TaskError(f"{root}: the installed minestudio package has no benchmark directory")
    return root


def _split_dir(split: str) -> Path:
    if split not in SPLITS:
        raise TaskError(f"unknown MineStudio Bench split {split!r}; expected one of {list(SPLITS)}")
    d = minestudio_benchmark_dir() / "task_configs" / split
    if not d.is_dir():
        raise TaskError(f"{d}: missing from the installed minestudio package")
    return d


def list_bench_tasks(split: str) -> list[str]:
    """The task names of one MineStudio Bench split (``simple`` or ``hard``), sorted."""
    return sorted(p.stem for p in _split_dir(split).glob("*.yaml"))


def load_bench_task(name: str, *, max_steps: int = BENCH_MAX_STEPS) -> MinecraftBenchTask:
    """A MineStudio Bench task by ``split/name`` (``"simple/build_gate"``) or by a name in one split only."""
    if "/" in name:
        split, stem = name.split("/", 1)
        path = _split_dir(split) / f"{stem}.yaml"
        if not path.exists():
            raise TaskError(f"no MineStudio Bench task {stem!r} in {path.parent}")
        return load_task_file(path, split=split, default_max_steps=max_steps, chat_lines=True)
    found = [s for s in SPLITS if (_split_dir(s) / f"{name}.yaml").exists()]
    if len(found) != 1:
        where = f"both splits; say {' or '.join(f'{s}/{name}' for s in found)}" if found else \
            f"neither split ({minestudio_benchmark_dir() / 'task_configs'})"
        raise TaskError(f"MineStudio Bench task {name!r} is in {where}")
    return load_task_file(_split_dir(found[0]) / f"{name}.yaml", split=found[0], default_max_steps=max_steps,
                          chat_lines=True)


def list_openha_tasks() -> list[str]:
    """The OpenHA-style tasks shipped with this package (``openha_tasks/*.yaml``), sorted."""
    return sorted(p.stem for p in OPENHA_TASK_DIR.glob("*.yaml"))


def load_openha_task(name_or_path: str, *, max_steps: int = OPENHA_MAX_STEPS) -> MinecraftBenchTask:
    """An OpenHA-style task by path or by shipped name; it must have reward events (its success rule)."""
    p = Path(name_or_path)
    if not (p.suffix in (".yaml", ".yml") and p.exists()):
        p = OPENHA_TASK_DIR / f"{name_or_path}.yaml"
        if not p.exists():
            raise TaskError(f"no OpenHA-style task {name_or_path!r} (a YAML path, or one of "
                            f"{list_openha_tasks()})")
    task = load_task_file(p, split="openha", default_max_steps=max_steps)
    if not task.rewards:
        raise TaskError(f"{p}.reward_cfg: missing; an OpenHA-style task succeeds on a reward from its events")
    return task
