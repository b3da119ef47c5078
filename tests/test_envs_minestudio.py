"""MineStudio backend translation, on dictionaries of the shapes MinecraftSim returns (no engine needed).

The raw info below follows MineStudio's sources: ``PlainInventoryObservation`` (slot -> {type, quantity}),
``ObserveFromFullStats`` (defaultdicts of 0-d arrays), ``_multiagent.py`` (``player_pos``, ``is_gui_open``,
``isGuiOpen``, ``health``) and ``entry.py`` (``_wrap_obs_info`` merges obs into info; obs = {"image"}).
"""

from collections import defaultdict

import numpy as np
import pytest

from histeve_jax.envs import base, make, noop_action
from histeve_jax.envs.minestudio import (
    CursorTracker,
    MineStudioEnv,
    MineStudioTask,
    MineStudioUnavailable,
    info_from_sim,
    load_minestudio_task,
    minestudio_task_from_dict,
    missing_requirements,
    to_sim_action,
)
from histeve_jax.envs.tasks import TaskError

# MinecraftSim(action_type="env").action_space keys: no "drop" (MineStudio's HumanSurvival lacks it).
SIM_KEYS = frozenset({"attack", "back", "forward", "jump", "left", "right", "sneak", "sprint", "use",
                      "inventory", "camera", *(f"hotbar.{i}" for i in range(1, 10))})


def _stats(**kw):
    d = defaultdict(lambda: np.zeros((), dtype=float))
    for k, v in kw.items():
        d[k] = np.array(v, dtype=float)
    return d


def raw_info(gui=False, yaw=190.0):
    inv = {i: {"type": "air", "quantity": 0} for i in range(36)}
    inv[0] = {"type": "oak_log", "quantity": 3}
    inv[5] = {"type": "oak_log", "quantity": 2}
    inv[9] = {"type": "stick", "quantity": 4}
    return {
        "pov": np.zeros((360, 640, 3), np.uint8),
        "inventory": inv,
        "equipped_items": {"mainhand": {"type": "oak_log", "damage": 0, "maxDamage": 0}},
        "mine_block": _stats(oak_log=5, dirt=0),
        "craft_item": _stats(stick=4),
        "pickup": _stats(oak_log=5),
        "use_item": _stats(dirt=2, bread=1),
        "break_item": _stats(),
        "player_pos": {"x": 1.5, "y": 64.0, "z": -3.25, "pitch": 12.0, "yaw": yaw},
        "is_gui_open": gui,
        "isGuiOpen": gui,
        "health": 18.0,
    }


class FakeSim:
    """Stands in for MinecraftSim: same constructor keywords, same return shapes."""

    made = []

    def __init__(self, action_type, obs_size, seed, callbacks, **kw):
        assert action_type == "env"
        self.obs_size, self.callbacks, self.actions, self.gui = obs_size, callbacks, [], False
        FakeSim.made.append(self)

    class _Space:
        spaces = {k: None for k in SIM_KEYS}

    action_space = _Space()

    def _obs(self):
        w, h = self.obs_size
        return {"image": np.full((h, w, 3), 7, np.uint8)}

    def reset(self):
        self.gui = False
        return self._obs(), raw_info(gui=False)

    def step(self, action):
        self.actions.append(action)
        if action.get("inventory"):
            self.gui = not self.gui
        return self._obs(), 0.0, False, False, raw_info(gui=self.gui)

    def close(self):
        pass


def test_action_translation_keeps_sim_keys_and_types():
    a = noop_action()
    a.update({"forward": 1, "drop": 1, "hotbar.3": 1, "camera": [1.5, -2.0]})
    out = to_sim_action(a, SIM_KEYS)
    assert set(out) == SIM_KEYS  # drop is not in the sim's action space
    assert out["forward"] == 1 and out["hotbar.3"] == 1 and out["attack"] == 0
    assert out["camera"].dtype == np.float32 and out["camera"].tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="'jumpp'"):
        to_sim_action({"jumpp": 1}, SIM_KEYS)


def test_info_translation_matches_our_schema():
    info = info_from_sim(raw_info(), cursor=None, held_slot=2, blocks=("dirt",))
    assert set(base.INFO_KEYS) - {"task", "success", "steps"} <= set(info)
    assert info["inventory"] == {"oak_log": 5, "stick": 4}
    assert info["hotbar"][0] == {"type": "oak_log", "quantity": 3} and info["hotbar"][1]["type"] == "air"
    assert len(info["inventory_slots"]) == 36 and info["inventory_slots"][9]["quantity"] == 4
    assert info["pos"] == (1.5, 64.0, -3.25)
    assert info["yaw"] == pytest.approx(-170.0) and info["pitch"] == 12.0
    assert info["health"] == 18.0 and info["held_slot"] == 2
    assert info["mine_block"] == {"oak_log": 5}  # zero counters dropped
    assert info["craft_item"] == {"stick": 4} and info["pickup"] == {"oak_log": 5}
    assert info["use_item"] == {"dirt": 2, "bread": 1}
    assert info["place_block"] == {"dirt": 2}  # only the task's blocks count as placements
    assert info["is_gui_open"] is False and info["cursor"] is None


def test_cursor_tracker_integrates_camera_from_the_centre():
    c = CursorTracker()
    assert c.update(False, np.array([1.0, 1.0])) is None
    assert c.update(True, None) == (320, 180)
    assert c.update(True, np.array([3.0, -6.0])) == (320 - 40, 180 + 20)
    assert c.update(True, np.array([0.0, 1000.0])) == (639, 200)  # clamped to the render
    assert c.update(False, None) is None and c.update(True, None) == (320, 180)


def test_minestudio_task_yaml_becomes_init_commands():
    t = load_minestudio_task("mine_dirt")  # shipped with MineStudio's benchmark
    assert t.commands == ("/execute as @p at @s run fill ~ ~ ~ ~1 ~ ~ minecraft:dirt",)
    assert t.text == "Find and mine dirt using the right tool."
    t2 = minestudio_task_from_dict({"custom_init_commands": ["/give @s minecraft:coal 20"], "text": "x",
                                    "success": {"inventory": {"coal": ">=21"}}}, "t")
    assert t2.commands == ("/give @s minecraft:coal 20",)
    assert not t2.is_success({"inventory": {"coal": 20}}) and t2.is_success({"inventory": {"coal": 21}})
    with pytest.raises(TaskError, match=r"custom_init_commands\[0\]"):
        minestudio_task_from_dict({"custom_init_commands": ["give @s dirt"], "text": "x"}, "t")
    with pytest.raises(TaskError, match="text"):
        minestudio_task_from_dict({"custom_init_commands": []}, "t")
    with pytest.raises(TaskError, match="blocks"):
        minestudio_task_from_dict({"text": "x", "blocks": "dirt"}, "t")
    assert minestudio_task_from_dict({"text": "x", "blocks": ["dirt"]}, "t").blocks == ("dirt",)


def test_env_over_a_sim_with_minecraftsim_shapes():
    task = MineStudioTask(name="t", text="chop", commands=("/give @s minecraft:oak_log 1",),
                          success={"inventory": {"oak_log": ">=5"}}, max_steps=3)
    env = make("minestudio", obs_size=(48, 64), task=task, sim_factory=FakeSim)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(noop_action())
    obs, info = env.reset()
    sim = FakeSim.made[-1]
    assert sim.obs_size == (64, 48)  # cv2 order
    assert [type(c).__name__ for c in sim.callbacks] == ["InitCommandsCallback"]
    assert sim.callbacks[0].commands == ["/give @s minecraft:oak_log 1"]
    assert obs["image"].shape == (48, 64, 3) and info["success"] and info["task"] == "t"
    obs, _, _, trunc, info = env.step({"inventory": 1})
    assert info["is_gui_open"] and info["cursor"] == (320, 180)
    obs, _, _, trunc, info = env.step({"camera": [0.0, 3.0], "hotbar.4": 1})
    assert info["cursor"] == (340, 180) and info["held_slot"] == 4
    _, _, _, trunc, _ = env.step(noop_action())
    assert trunc  # max_steps = 3
    assert "drop" not in sim.actions[0]


def test_missing_engine_or_java_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MINESTUDIO_DIR", str(tmp_path))
    missing = missing_requirements()
    assert any("mcprec-6.13.jar" in m for m in missing)
    with pytest.raises(MineStudioUnavailable, match="simulator engine"):
        MineStudioEnv()
