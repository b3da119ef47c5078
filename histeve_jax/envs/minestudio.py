"""MineStudioEnv: the same interface (base.py) over MineStudio's ``MinecraftSim`` (``action_type="env"``).

Minecraft needs MineStudio's simulator engine (``$MINESTUDIO_DIR/engine/build/libs/mcprec-6.13.jar``,
downloaded from a model hub, which these machines cannot reach) and Java 8; without them the constructor
raises ``MineStudioUnavailable`` saying what is missing. The translation code (our action -> the sim's,
the sim's obs/info -> our info, task YAML -> init commands) is pure and tested without the engine.

Differences from Luanti that the schema absorbs:
- Minecraft reports no cursor; while a GUI is open we integrate the camera motion from the screen centre
  (where Minecraft puts the cursor when a GUI opens) at ``PIXELS_PER_DEGREE``, clamped to the 640x360 render.
- Minecraft's statistics have no placement counter (placing a block counts as ``use_item``), so
  ``place_block`` is ``use_item`` restricted to the task's ``blocks`` list (else {}).
- The sim has no ``drop`` key in its env action space; keys the sim lacks are dropped from the action.
- The held slot is not reported; it is tracked from the hotbar keys (slot 1 at reset).
- Item names are Minecraft's without the namespace (``oak_log``), as MineStudio reports them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import yaml
from gymnasium import spaces

from histeve_jax.actions.codebook import BUTTONS, CAMERA
from histeve_jax.envs.base import (
    EVENT_KEYS,
    PIXELS_PER_DEGREE,
    RENDER_SIZE,
    inventory_counts,
    validate_action,
    wrap_degrees,
)
from histeve_jax.envs.tasks import TaskError, evaluate_check, validate_check

ENGINE_JAR = ("engine", "build", "libs", "mcprec-6.13.jar")
N_SLOTS = 36  # Minecraft's player inventory: slots 0-8 are the hotbar


class MineStudioUnavailable(RuntimeError):
    """MineStudio's engine, Java 8 or the package's full dependencies are missing."""


def minestudio_dir() -> Path:
    """MineStudio's data directory: ``$MINESTUDIO_DIR``, else ``<tmp>/MineStudio`` (as MineStudio has it)."""
    return Path(os.environ.get("MINESTUDIO_DIR") or os.path.join(tempfile.gettempdir(), "MineStudio"))


def java_major_version(java: str | None = None) -> int | None:
    """The major version of `java` on PATH (8 for 1.8.x), or None if there is none."""
    java = java or shutil.which("java")
    if not java:
        return None
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def missing_requirements() -> list[str]:
    """What MineStudio's Minecraft needs and this machine lacks (empty when it can run)."""
    missing = []
    jar = minestudio_dir().joinpath(*ENGINE_JAR)
    if not jar.exists():
        missing.append(f"MineStudio's simulator engine ({jar}; `python -m minestudio.simulator.entry -y` "
                       "downloads it from the Hugging Face hub)")
    v = java_major_version()
    if v != 8:
        found = "no java" if v is None else f"Java {v}"
        missing.append(f"Java 8 (found {found}; apt-get install openjdk-8-jdk)")
    return missing


# ---------------------------------------------------------------------------------------------- tasks


@dataclasses.dataclass(frozen=True)
class MineStudioTask:
    """A MineStudio Bench task: chat commands run after reset, the instruction, an optional success check."""

    name: str
    text: str
    commands: tuple[str, ...]
    success: dict[str, Any] | None = None
    max_steps: int = 600
    blocks: tuple[str, ...] = ()

    def is_success(self, info: Mapping[str, Any]) -> bool:
        return bool(self.success) and evaluate_check(self.success, info)

    def instruction(self, info: Mapping[str, Any]) -> str:
        """What the agent is told (``Task.instruction``'s interface; a MineStudio text has no slots)."""
        return self.text


def minestudio_task_from_dict(d: Any, name: str, source: str = "<dict>") -> MineStudioTask:
    """Translate a MineStudio task YAML mapping (``custom_init_commands`` or ``commands``, ``text``)."""
    if not isinstance(d, Mapping):
        raise TaskError(f"{source}: a MineStudio task must be a mapping")
    if "text" not in d or not isinstance(d["text"], str) or not d["text"].strip():
        raise TaskError(f"{source}.text: missing or empty")
    commands = d.get("custom_init_commands", d.get("commands", [])) or []
    if not isinstance(commands, list) or not all(isinstance(c, str) for c in commands):
        raise TaskError(f"{source}.custom_init_commands: must be a list of strings")
    for i, c in enumerate(commands):
        if not c.startswith("/"):
            raise TaskError(f"{source}.custom_init_commands[{i}]: chat commands start with '/', got {c!r}")
    success = d.get("success")
    if success is not None:
        validate_check(success, f"{source}.success")
    max_steps = d.get("max_steps", 600)
    if not isinstance(max_steps, int) or max_steps < 1:
        raise TaskError(f"{source}.max_steps: must be a positive int")
    blocks = d.get("blocks") or []
    # a bare string would otherwise become a tuple of its characters
    if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
        raise TaskError(f"{source}.blocks: must be a list of item names, got {blocks!r}")
    return MineStudioTask(name=name, text=" ".join(d["text"].split()), commands=tuple(commands),
                          success=success, max_steps=max_steps, blocks=tuple(blocks))


def minestudio_task_dirs() -> list[Path]:
    """MineStudio's shipped benchmark task directories (simple, hard)."""
    import importlib.util

    spec = importlib.util.find_spec("minestudio")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(list(spec.submodule_search_locations)[0]) / "benchmark" / "task_configs"
    return [p for p in (root / "simple", root / "hard") if p.is_dir()]


def load_minestudio_task(name_or_path: str | Path) -> MineStudioTask:
    """Load a MineStudio task YAML by path, or by name from MineStudio's benchmark (``"mine_dirt"``)."""
    p = Path(name_or_path)
    if not p.exists():
        candidates = [d / f"{name_or_path}.yaml" for d in minestudio_task_dirs()]
        candidates += [d.parent / f"{name_or_path}.yaml" for d in minestudio_task_dirs()]
        found = [c for c in candidates if c.exists()]
        if not found:
            raise TaskError(f"no MineStudio task {name_or_path!r} (looked in {minestudio_task_dirs()})")
        p = found[0]
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise TaskError(f"{p}: not valid YAML: {e}") from e
    return minestudio_task_from_dict(d, p.stem, str(p))


# ---------------------------------------------------------------------------------------------- translation


def to_sim_action(action: Mapping[str, Any], sim_keys: set[str] | frozenset[str]) -> dict[str, Any]:
    """Our env-format action (validated) -> MinecraftSim's env action: ints for keys, float32[2] camera."""
    a = validate_action(action)
    out: dict[str, Any] = {}
    for k in BUTTONS:
        if k in sim_keys:
            out[k] = int(a[k])
    if CAMERA in sim_keys:
        out[CAMERA] = np.asarray(a[CAMERA], np.float32)
    return out


def _count(v: Any) -> int:
    return int(np.asarray(v).item()) if v is not None else 0


def _slots(raw_inv: Mapping[Any, Any]) -> list[dict[str, Any]]:
    slots = [{"type": "air", "quantity": 0} for _ in range(N_SLOTS)]
    for sid, s in raw_inv.items():
        i = int(sid)
        if not 0 <= i < N_SLOTS:
            continue
        t = str(s.get("type", "air")).removeprefix("minecraft:")
        q = _count(s.get("quantity", 0))
        empty = q <= 0 or t in ("air", "none")
        slots[i] = {"type": "air", "quantity": 0} if empty else {"type": t, "quantity": q}
    return slots


class CursorTracker:
    """Estimates the GUI cursor from camera motion (Minecraft centres it when a GUI opens)."""

    def __init__(self) -> None:
        self.xy: tuple[float, float] | None = None

    def update(self, gui_open: bool, camera: np.ndarray | None) -> tuple[int, int] | None:
        """Advance by one step's camera action; returns the cursor in render pixels, or None outside GUIs."""
        h, w = RENDER_SIZE
        if not gui_open:
            self.xy = None
            return None
        if self.xy is None:
            self.xy = (w / 2.0, h / 2.0)
        elif camera is not None:
            x = min(max(self.xy[0] + float(camera[1]) * PIXELS_PER_DEGREE, 0.0), w - 1.0)
            y = min(max(self.xy[1] + float(camera[0]) * PIXELS_PER_DEGREE, 0.0), h - 1.0)
            self.xy = (x, y)
        return round(self.xy[0]), round(self.xy[1])


def info_from_sim(raw: Mapping[str, Any], *, cursor: tuple[int, int] | None, held_slot: int,
                  blocks: tuple[str, ...] = ()) -> dict[str, Any]:
    """MinecraftSim's info dict -> our info schema (base.py), without the task keys."""
    slots = _slots(raw.get("inventory") or {})
    pp = raw.get("player_pos")
    if pp is None:
        ls = raw.get("location_stats") or {}
        pp = {"x": ls.get("xpos", 0.0), "y": ls.get("ypos", 0.0), "z": ls.get("zpos", 0.0),
              "pitch": ls.get("pitch", 0.0), "yaw": ls.get("yaw", 0.0)}
    events = {}
    for k in ("mine_block", "craft_item", "pickup", "use_item"):
        events[k] = {str(n).removeprefix("minecraft:"): _count(c) for n, c in (raw.get(k) or {}).items()
                     if _count(c) > 0}
    events["place_block"] = {n: c for n, c in events["use_item"].items() if n in blocks}
    gui = bool(raw.get("is_gui_open", raw.get("isGuiOpen", False)))
    yaw = float(np.asarray(pp["yaw"]).item())
    return {
        "inventory": inventory_counts(slots),
        "hotbar": slots[:9],
        "inventory_slots": slots,
        "held_slot": held_slot,
        "is_gui_open": gui,
        "cursor": cursor if gui else None,
        "pos": tuple(float(np.asarray(pp[c]).item()) for c in ("x", "y", "z")),
        "yaw": wrap_degrees(yaw),
        "pitch": float(np.asarray(pp["pitch"]).item()),
        "health": float(np.asarray(raw.get("health", 20.0)).item()),
        **{k: events[k] for k in EVENT_KEYS},
    }


# ---------------------------------------------------------------------------------------------- env


class InitCommandsCallback:
    """MineStudio's ``CommandsCallback`` (run chat commands after reset) with the full callback interface.

    MineStudio's own module imports cv2 at import time; this copy keeps the translation layer importable
    where only the pure-Python parts of minestudio are installed.
    """

    def __init__(self, commands: tuple[str, ...] | list[str]):
        self.commands = list(commands)

    def before_reset(self, sim, reset_flag):
        return reset_flag

    def after_reset(self, sim, obs, info):
        for command in self.commands:
            _obs, _, _, _info = sim.env.execute_cmd(command)
            obs.update(_obs)
            info.update(_info)
        return sim._wrap_obs_info(obs, info)

    def before_step(self, sim, action):
        return action

    def after_step(self, sim, obs, reward, terminated, truncated, info):
        return obs, reward, terminated, truncated, info

    def before_close(self, sim):
        pass

    def after_close(self, sim):
        pass

    def before_render(self, sim, image):
        return image

    def after_render(self, sim, image):
        return image


class MineStudioEnv(gym.Env):
    """Minecraft through MineStudio's MinecraftSim with our action/info formats (see base.py)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(self, obs_size: tuple[int, int] = (224, 224), *, task: str | MineStudioTask | None = None,
                 seed: int = 0, sim_factory=None, **sim_kwargs: Any):
        self.obs_size = (int(obs_size[0]), int(obs_size[1]))
        self.task = load_minestudio_task(task) if isinstance(task, str) else task
        if sim_factory is None:
            missing = missing_requirements()
            if missing:
                raise MineStudioUnavailable(
                    "MineStudio's Minecraft cannot run here; missing: " + "; ".join(missing))
            try:
                from minestudio.simulator import MinecraftSim
            except ImportError as e:  # installed --no-deps: cv2, torch, gym3 ... may be absent
                raise MineStudioUnavailable(f"minestudio's simulator does not import ({e}); install its full "
                                            "dependencies in a separate environment") from e
            sim_factory = MinecraftSim
        self._factory = sim_factory
        self._seed = seed
        self._sim_kwargs = sim_kwargs
        self.sim = None
        self.cursor = CursorTracker()
        self.held_slot = 1
        self._steps = 0
        self.observation_space = spaces.Dict(
            {"image": spaces.Box(0, 255, (*self.obs_size, 3), dtype=np.uint8)})
        self.action_space = spaces.Dict({**{k: spaces.Discrete(2) for k in BUTTONS},
                                         CAMERA: spaces.Box(-180.0, 180.0, (2,), dtype=np.float32)})

    def _callbacks(self):
        if self.task is None or not self.task.commands:
            return []
        return [InitCommandsCallback(self.task.commands)]

    def _make_sim(self):
        # MinecraftSim takes obs_size as cv2's (W, H); ours is (H, W).
        return self._factory(action_type="env", obs_size=(self.obs_size[1], self.obs_size[0]),
                             seed=self._seed, callbacks=self._callbacks(), **self._sim_kwargs)

    def _wrap(self, obs, raw, camera=None):
        gui = bool(raw.get("is_gui_open", raw.get("isGuiOpen", False)))
        cursor = self.cursor.update(gui, camera)
        info = info_from_sim(raw, cursor=cursor, held_slot=self.held_slot,
                             blocks=self.task.blocks if self.task else ())
        info["task"] = self.task.name if self.task else ""
        info["success"] = self.task.is_success(info) if self.task else False
        info["steps"] = self._steps
        return {"image": np.asarray(obs["image"], np.uint8)}, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Reset the sim (MinecraftSim's reset takes no seed: the world seed is fixed at construction)."""
        super().reset(seed=seed)
        options = options or {}
        if "task" in options:
            t = options["task"]
            self.task = load_minestudio_task(t) if isinstance(t, str) else t
        if self.sim is None:
            self.sim = self._make_sim()
        else:
            self.sim.callbacks = self._callbacks()
        obs, raw = self.sim.reset()
        self.cursor = CursorTracker()
        self.held_slot = 1
        self._steps = 0
        return self._wrap(obs, raw)

    def step(self, action: Mapping[str, Any]):
        if self.sim is None:
            raise RuntimeError("MineStudioEnv.step() before reset()")
        keys = set(self.sim.action_space.spaces.keys())
        sim_action = to_sim_action(action, keys)
        for i in range(1, 10):
            if sim_action.get(f"hotbar.{i}"):
                self.held_slot = i
        obs, reward, terminated, truncated, raw = self.sim.step(sim_action)
        self._steps += 1
        obs, info = self._wrap(obs, raw, camera=sim_action.get(CAMERA))
        truncated = bool(truncated or (self.task is not None and self._steps >= self.task.max_steps))
        return obs, float(reward), bool(terminated), truncated, info

    def close(self) -> None:
        if self.sim is not None:
            self.sim.close()
            self.sim = None
