"""The shared interface: action validation, angle conventions, the crosshair GUI detector, task files."""

import numpy as np
import pytest
import yaml

from histeve_jax.envs import base, list_tasks, load_task, make
from histeve_jax.envs.luanti.arena import reset_ops, tree_ops
from histeve_jax.envs.luanti.env import crosshair_visible
from histeve_jax.envs.tasks import TaskError, evaluate_check, task_from_dict


def test_validate_action_fills_missing_keys_and_converts():
    a = base.validate_action({"forward": True, "camera": [1, -2]})
    assert set(a) == set(base.BUTTONS) | {"camera"}
    assert a["forward"] == 1 and a["attack"] == 0
    assert a["camera"].dtype == np.float32 and a["camera"].tolist() == [1.0, -2.0]
    assert base.validate_action({"camera": np.array([[0.5, 0.25]])})["camera"].tolist() == [0.5, 0.25]


@pytest.mark.parametrize("action, key", [
    ({"fly": 1}, "'fly'"),
    ({"camera": [np.nan, 0.0]}, "'camera'.*finite"),
    ({"camera": [0.0, np.inf]}, "'camera'.*finite"),
    ({"camera": [1.0, 2.0, 3.0]}, "'camera'.*shape"),
    ({"attack": 2}, "'attack'.*0 or 1"),
    ({"jump": [1, 0]}, "'jump'.*scalar"),
])
def test_validate_action_names_the_bad_key(action, key):
    with pytest.raises(ValueError, match=key):
        base.validate_action(action)


def test_yaw_pitch_conventions():
    eye = (0.0, 10.0, 0.0)
    assert base.yaw_pitch_to(eye, (0.0, 10.0, 5.0)) == pytest.approx((0.0, 0.0))  # yaw 0 faces +z
    assert base.yaw_pitch_to(eye, (5.0, 10.0, 0.0))[0] == pytest.approx(90.0)  # turning right -> +x
    assert base.yaw_pitch_to(eye, (0.0, 5.0, 5.0))[1] == pytest.approx(45.0)  # positive pitch looks down
    assert base.wrap_degrees(190.0) == pytest.approx(-170.0) and base.wrap_degrees(-180.0) == -180.0
    assert base.PIXELS_PER_DEGREE == pytest.approx(1 / 0.15)  # VPT's 360/2400 degrees per pixel


def test_crosshair_detector():
    frame = np.full((360, 640, 3), 90, np.uint8)
    assert not crosshair_visible(frame)
    frame[170:191, 320] = 255
    frame[180, 310:331] = 255
    assert crosshair_visible(frame)
    frame[175, 320] = 60  # a GUI panel covering part of the cross
    assert not crosshair_visible(frame)


def test_shipped_tasks_load_and_cover_the_categories():
    names = list_tasks()
    tasks = [load_task(n) for n in names]
    assert {t.category for t in tasks} == {"mine", "craft", "smelt", "build", "explore", "long_horizon"}
    steel = load_task("steel_pickaxe")
    assert [n for n, _ in steel.subgoals][-1] == "steel_pickaxe" and len(steel.subgoals) == 10
    assert steel.init.get("inventory") is None  # from an empty inventory


def test_task_checks_evaluate_on_info():
    info = {"inventory": {"default:tree": 2}, "craft_item": {"default:wood": 4}, "pos": (1.0, 8.5, 1.0)}
    assert evaluate_check({"inventory": {"default:tree": ">=2"}}, info)
    assert not evaluate_check({"inventory": {"default:tree": ">2"}}, info)
    assert evaluate_check({"inventory": {"default:tree": 2}, "craft_item": {"default:wood": "==4"}}, info)
    assert not evaluate_check({"pickup": {"default:tree": 1}}, info)
    assert evaluate_check({"near": {"pos": [1.0, 8.5, 2.5], "radius": 2}}, info)
    assert not evaluate_check({"near": {"pos": [1.0, 8.5, 4.0], "radius": 2}}, info)
    assert evaluate_check({"any": [{"pickup": {"x": 1}}, {"inventory": {"default:tree": 1}}]}, info)


def _task(**over):
    d = {"name": "t", "category": "mine", "text": "dig", "max_steps": 10, "success": {"inventory": {"a": 1}}}
    d.update(over)
    return d


@pytest.mark.parametrize("over, msg", [
    ({"category": "dance"}, r"<dict>\.category"),
    ({"max_steps": 0}, r"max_steps"),
    ({"success": {"inventry": {"a": 1}}}, r"success\.inventry: unknown check key"),
    ({"success": {"inventory": {"a": "at least 1"}}}, r"success\.inventory\.a"),
    ({"init": {"pos": [0, 1]}}, r"init\.pos"),
    ({"init": {"inventory": [{"item": "a", "count": 0}]}}, r"init\.inventory\[0\]\.count"),
    ({"init": {"weather": "rain"}}, r"init: unknown key"),
    ({"init": {"inventory": [{"item": 5}]}}, r"init\.inventory\[0\]\.item"),
    ({"init": {"nodes": [{"pos": [0, 9, 0], "name": None}]}}, r"init\.nodes\[0\]\.name"),
    ({"subgoals": [{"name": "x"}]}, r"subgoals\[0\]"),
    ({"init": {"vary": {"roll": 5}}}, r"init\.vary: must be a mapping with keys from"),
    ({"init": {"vary": {"pitch": 100}}}, r"init\.vary\.pitch: must be a number in \[0, 89\.5\]"),
    ({"init": {"vary": {"yaw": -1}}}, r"init\.vary\.yaw"),
    ({"init": {"vary": {"beside": 1.5}}}, r"init\.vary\.beside: must be a number in \[0, 1\.0\]"),
    ({"colour": 1}, r"unknown key"),
])
def test_bad_task_files_raise_naming_the_key(over, msg):
    with pytest.raises(TaskError, match=msg):
        task_from_dict(_task(**over))


def test_a_start_spread_fills_in_the_defaults():
    assert task_from_dict(_task(init={"vary": {"yaw": 180}})).init["vary"] == {"pos": 0.25, "yaw": 180.0,
                                                                              "pitch": 0.0, "gap": 0.0,
                                                                              "beside": 0.0, "clutter": 0.0,
                                                                              "dug": 0.0, "against": 0.0,
                                                                              "far": 0.0}
    assert "vary" not in task_from_dict(_task()).init
    # The crafts start anywhere in mine_log's arena, looking anywhere (wooden_pickaxe hands them that view).
    craft, mine = load_task("craft_planks").init, load_task("mine_log").init
    assert craft["vary"]["yaw"] == 180.0 and craft["vary"]["pitch"] > 0 and craft["trees"] == mine["trees"]
    # mine_log from anywhere in the arena (a failure teleports the player), some trunks already chopped once
    assert mine["vary"]["pos"] >= 8 and mine["vary"]["yaw"] == 180.0 and 0 < mine["vary"]["gap"] < 1
    assert 0 < mine["vary"]["beside"] < 1  # and some right beside a trunk chopped once (its second log)
    # Half of each craft's starts hold what a long episode leaves (leaves first), and its text names the
    # slots of its inputs, which the policy cannot read at 112x196.
    for name, items in (("craft_planks", ["default:tree"]), ("craft_sticks", ["default:wood"]),
                        ("craft_wooden_pickaxe", ["default:stick", "default:wood"])):
        task = load_task(name)
        assert task.init["vary"]["clutter"] == 0.5
        assert [f"{{slot:{item}}}" in task.text for item in items] == [True] * len(items)
        # and half start where mine_log leaves the player: beside a trunk chopped once, facing its gap
        assert task.init["vary"]["beside"] == 0.5 and task.init["vary"]["gap"] > 0


def test_a_cluttered_inventory_moves_each_stack_one_slot_on_behind_leaves():
    """``tasks.clutter_inventory``: leaves (1-6) on slot 1, each listed stack on the next slot (32 stays) and
    0-2 larger."""
    import numpy as np

    from histeve_jax.envs.tasks import clutter_inventory

    rng = np.random.default_rng(0)
    pickaxe = load_task("craft_wooden_pickaxe").init["inventory"]  # sticks 4 on slot 1, planks 3 on 32
    seen = [clutter_inventory(pickaxe, rng) for _ in range(50)]
    for inv in seen:
        assert [it["slot"] for it in inv] == [1, 2, 32] and 1 <= inv[0]["count"] <= 6
        assert [it["item"] for it in inv] == ["default:leaves", "default:stick", "default:wood"]
        assert 4 <= inv[1]["count"] <= 6 and 3 <= inv[2]["count"] <= 5
    assert {inv[1]["count"] for inv in seen} == {4, 5, 6}
    assert {inv[0]["count"] for inv in seen} == set(range(1, 7))


def _slots(*stacks):
    """``info["inventory_slots"]`` as the game reports it: (item, count) per slot, the rest empty."""
    filled = [{"type": t, "quantity": n} for t, n in stacks]
    return {"inventory_slots": filled + [{"type": "air", "quantity": 0}] * (32 - len(filled))}


def test_an_instruction_names_the_slot_the_inventory_holds_its_item_in():
    """``{slot:<item>}`` in a task's text: the first slot holding the item where the instruction is read
    (``Task.instruction``); plain texts pass unchanged; an item nowhere held is an error naming the task."""
    from histeve_jax.envs.tasks import render_instruction

    task = task_from_dict(_task(text="craft planks from the log in slot {slot:default:tree}"))
    assert task.instruction(_slots(("default:tree", 1))) == "craft planks from the log in slot 1"
    cluttered = _slots(("default:leaves", 4), ("default:sapling", 1), ("default:tree", 2),
                       ("default:tree", 1))
    assert task.instruction(cluttered) == "craft planks from the log in slot 3"
    assert render_instruction("dig", {}) == "dig"
    assert task_from_dict(_task()).instruction(cluttered) == "dig"
    with pytest.raises(ValueError, match=r"task t: .* names the slot of default:tree, and no inventory slot"):
        task.instruction(_slots(("default:leaves", 4)))


def test_a_task_varied_replaces_only_the_spread_it_names():
    task = load_task("craft_planks")
    always = task.varied(clutter=1.0)
    assert always.init["vary"] == {**task.init["vary"], "clutter": 1.0}
    assert task.init["vary"]["clutter"] == 0.5  # the task itself is unchanged
    assert always.init["trees"] == task.init["trees"] and always.text == task.text
    assert task_from_dict(_task()).varied(gap=0.5).init["vary"]["gap"] == 0.5  # on the defaults
    with pytest.raises(TaskError, match=r"task craft_planks: unknown init.vary key\(s\) \['roll'\]"):
        task.varied(roll=1.0)
    with pytest.raises(TaskError, match=r"craft_planks: init\.vary\.clutter: must be a number in \[0, 1"):
        task.varied(clutter=2.0)


def test_a_task_variant_by_name_is_the_task_varied(tmp_path):
    task = load_task("mine_log[against=1, pos=3]")
    assert task.name == "mine_log" and task.init == load_task("mine_log").varied(against=1.0, pos=3.0).init
    assert task.source.endswith("mine_log.yaml[against=1,pos=3]")
    p = tmp_path / "other.yaml"
    p.write_text(yaml.safe_dump(_task()))
    assert load_task(f"{p}[gap=0.5]").init["vary"]["gap"] == 0.5  # a task file's path takes one too


@pytest.mark.parametrize("spec, msg", [
    ("mine_log[against]", r"'mine_log\[against\]': 'against' is not key=number"),
    ("mine_log[against=x]", r"'against=x' is not key=number"),
    ("mine_log[roll=1]", r"unknown init.vary key 'roll'; expected one of \['against'"),
    ("mine_log[against=2]", r"'mine_log\[against=2\]': task mine_log: init\.vary\.against: must be a number"),
    ("mine_log[]", r"'mine_log\[\]': empty variant"),
    ("mine_log]", r"a variant is written name\[key=value,...\]"),
    ("nope[gap=1]", r"no task named 'nope'"),
])
def test_a_bad_task_variant_is_refused_naming_it(spec, msg):
    with pytest.raises(TaskError, match=msg):
        load_task(spec)


@pytest.mark.parametrize("text", ["dig {count} logs", "dig {slot:tree}", "dig }"])
def test_a_text_with_another_placeholder_is_refused(text):
    with pytest.raises(TaskError, match=r"<dict>\.text: the only placeholder is \{slot:<mod>:<item>\}"):
        task_from_dict(_task(text=text))


def test_an_unknown_gui_backdrop_is_refused_before_any_game_starts():
    with pytest.raises(ValueError, match="gui_backdrop must be 'opaque' or 'game', got 'glass'"):
        make("luanti", gui_backdrop="glass")


def test_tasks_load_by_path_and_unknown_names_raise(tmp_path):
    p = tmp_path / "other.yaml"
    p.write_text(yaml.safe_dump(_task()))
    assert load_task(p).name == "t"  # outside the package any file name is fine
    with pytest.raises(TaskError, match="no task named 'nope'"):
        load_task("nope")


def test_reset_ops_rebuild_the_arena_then_place_the_task():
    ops = reset_ops(load_task("mine_stone"))
    kinds = [o["op"] for o in ops]
    assert kinds[0] == "emerge" and kinds[-1] == "reset_events"
    assert kinds.index("fill") < kinds.index("clear_inventory") < kinds.index("set_slot")
    assert {"op": "set_slot", "slot": 1, "item": "default:pick_wood", "count": 1} in ops
    assert {"op": "fill", "pos1": [-2, 9, 2], "pos2": [2, 10, 3], "name": "default:stone"} in ops
    trunk = tree_ops([0, 9, 3], 4)[-1]
    assert trunk == {"op": "fill", "pos1": [0, 9, 3], "pos2": [0, 12, 3], "name": "default:tree"}


def test_make_rejects_unknown_backends():
    with pytest.raises(ValueError, match="unknown env backend 'doom'"):
        make("doom")
