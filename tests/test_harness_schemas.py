"""The harness's pieces that need no game or model: schemas, memories, the rules planner, verification."""

from __future__ import annotations

import json

import numpy as np
import pytest

from histeve_jax.envs.tasks import load_task
from histeve_jax.harness.memory import Memory, ProceduralMemory, relation
from histeve_jax.harness.planners.base import PlanningContext
from histeve_jax.harness.planners.rules import RulesPlanner, rule_for
from histeve_jax.harness.schemas import (
    SchemaError,
    evaluate_condition,
    load_schema,
    load_schemas,
    schema_from_dict,
)
from histeve_jax.harness.verify import ChangeMonitor, Verdict, decide, visual_change

SCHEMAS = load_schemas()
GOOD = {"name": "dig", "task": "mine_dirt", "description": "dig",
        "parameters": {"count": {"type": "integer", "minimum": 1, "maximum": 4}},
        "progress": {"key": "inventory", "item": "default:dirt"},
        "completion": {"inventory": {"default:dirt": ">={count}"}}, "budget": {"steps": 10}}


def test_every_schema_instantiates_into_its_atomic_task_text():
    assert len(SCHEMAS) == 15
    for s in SCHEMAS.values():
        sub = s.instantiate({})
        assert sub.instruction == load_task(s.task).text  # the text the policy was trained on
        assert sub.budget >= s.budget.steps
    sub = SCHEMAS["mine_stone"].instantiate({"count": 3})
    assert sub.completion == {"inventory": {"default:cobble": ">=3"}} and sub.budget == 200 + 150 * 3
    assert sub.label == "mine_stone(count=3)"


def test_a_subtask_is_told_the_slot_of_its_input_where_it_starts():
    """``Subtask.instruction_at``: a task text's ``{slot:<item>}`` is read from the invocation's first info
    (the executor and the detector are both told that), so a log behind leaves is named as slot 2."""
    import dataclasses

    sub = dataclasses.replace(SCHEMAS["craft_planks"].instantiate({}),
                              instruction="craft planks from the log in slot {slot:default:tree}")
    slots = [{"type": "default:leaves", "quantity": 3}, {"type": "default:tree", "quantity": 1}]
    info = {"inventory_slots": slots + [{"type": "air", "quantity": 0}] * 30}
    assert sub.instruction_at(info) == "craft planks from the log in slot 2"
    with pytest.raises(ValueError, match=r"subtask craft_planks\(count=4\): .*no inventory slot holds it"):
        sub.instruction_at({"inventory_slots": slots[:1]})


@pytest.mark.parametrize("change, msg", [
    ({"budget": None}, r"dig\.yaml: budget: Input should be a valid dictionary"),
    ({"colour": "red"}, r"dig\.yaml: colour: unknown field"),
    ({"progress": {"key": "inventory"}}, r"dig\.yaml: progress\.item: Field required"),
    ({"parameters": {"count": {"type": "integer", "minimum": 1}}},
     r"parameters\.count: .*minimum and maximum"),
    ({"parameters": {"count": {"type": "integer", "minimum": 1, "maximum": 4, "step": 2}}},
     r"parameters\.count\.step: unknown field"),
    ({"completion": {"inventory": {"default:dirt": ">={n}"}}}, r"completion: names parameter 'n'"),
    ({"completion": {"inventory": {"default:dirt": "lots"}}}, r"completion\.inventory\.default:dirt"),
    ({"task": "juggle"}, r"task: no task named 'juggle'"),
    ({"failure": [{"name": "x", "when": {"nearby": "default:tree"}}]}, r"failure\[0\]\.when\.nearby"),
])
def test_a_bad_schema_file_is_one_error_naming_file_and_field(tmp_path, change, msg):
    d = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    if change.get("budget", 0) is None:
        d["budget"] = "ten"
    p = tmp_path / "dig.yaml"
    p.write_text(json.dumps(d))
    with pytest.raises(SchemaError, match=msg):
        load_schema(p)


def test_missing_field_and_wrong_file_name(tmp_path):
    d = dict(GOOD)
    del d["completion"]
    with pytest.raises(SchemaError, match=r"x\.json: completion: Field required"):
        schema_from_dict(d, "x.json")
    p = tmp_path / "other.yaml"
    p.write_text(json.dumps(GOOD))
    with pytest.raises(SchemaError, match="does not match the file name"):
        load_schema(p)


def test_parameters_are_checked_and_conditions_evaluate():
    s = SCHEMAS["mine_log"]
    with pytest.raises(ValueError, match=r"mine_log\.count: must be an integer in \[1, 8\], got 9"):
        s.check_params({"count": 9})
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['colour'\]"):
        s.check_params({"colour": 1})
    with pytest.raises(ValueError, match="got True"):
        s.check_params({"count": True})
    info = {"inventory": {"default:tree": 2}, "nearby": [("default:tree", (0, 9, 3))]}
    assert evaluate_condition({"nearby": ["default:tree"], "inventory": {"default:tree": 2}}, info)
    assert not evaluate_condition({"absent": ["default:tree"]}, info)
    assert evaluate_condition({}, info)
    sub = s.instantiate({"count": 3})
    assert not sub.is_complete(info) and sub.failures(info) == []
    assert sub.failures({"inventory": {}, "nearby": []}) == [("nothing_to_mine", False)]


def _sim_info():
    nearby = [("default:tree", (0, 9, 3)), ("default:stone", (5, 9, -6)),
              ("default:stone_with_iron", (5, 9, -5)), ("default:stone_with_coal", (6, 11, -4)),
              ("default:dirt_with_grass", (1, 8, 1))]
    return {"inventory": {}, "pickup": {}, "craft_item": {}, "place_block": {}, "mine_block": {},
            "nearby": nearby, "pos": (0.0, 8.5, 0.0), "yaw": 0.0}


def _apply(sub, info):
    """The subtask's effect by the game's rules (what a perfect executor would leave)."""
    inv = info["inventory"]
    if sub.name == "place_furnace":
        inv["default:furnace"] -= 1
        info["nearby"].append(("default:furnace", (0, 9, -2)))
        return
    if sub.name == "build_wall":
        inv["default:dirt"] -= 3
        info["place_block"]["default:dirt"] = info["place_block"].get("default:dirt", 0) + 3
        return
    item = sub.progress[1]
    rule = rule_for(item)
    fuel_used = False
    while not sub.is_complete(info):
        for ing, k in rule.inputs.items():
            inv[ing] -= k
            assert inv[ing] >= 0, f"{sub.label} ran out of {ing}"
        if sub.name == "smelt_iron" and not fuel_used:
            inv["default:coal_lump"] -= 1
            fuel_used = True
        inv[item] = inv.get(item, 0) + rule.per_run
        key = "pickup" if sub.name.startswith("mine") else "craft_item"
        info[key][item] = info[key].get(item, 0) + rule.per_run


def _plan_all(task_name, planner=None):
    task, info, labels = load_task(task_name), _sim_info(), []
    planner = planner or RulesPlanner()
    while not task.is_success(info):
        info["subgoals_done"] = task.subgoals_done(info)
        adm = {n: s for n, s in SCHEMAS.items() if evaluate_condition(s.applicable, info)}
        ctx = PlanningContext(task.text, task.success, task.subgoals, [], info, {}, adm, {}, SCHEMAS)
        r = planner.plan(ctx)
        assert r.subtask is not None, r.error
        labels.append(r.subtask.label)
        _apply(r.subtask, info)
        assert len(labels) < 60
    return labels


def test_the_rules_planner_makes_a_steel_pickaxe_from_scratch():
    # By hand: 2 logs -> 8 planks (3 wooden pickaxe, 1 for 4 sticks; the steel pickaxe's sticks need more),
    # 11 cobble (3 stone pickaxe + 8 furnace), 3 iron with the stone pickaxe, 1 coal, furnace, 3 ingots.
    assert _plan_all("steel_pickaxe") == [
        "mine_log(count=2)", "craft_planks(count=8)", "craft_sticks(count=4)", "craft_wooden_pickaxe()",
        "mine_stone(count=11)", "craft_stone_pickaxe()", "mine_iron(count=3)", "mine_coal(count=1)",
        "craft_furnace()", "place_furnace()", "smelt_iron(count=3)", "craft_sticks(count=4)",
        "craft_steel_pickaxe()"]
    assert _plan_all("wooden_pickaxe") == ["mine_log(count=1)", "craft_planks(count=4)",
                                           "craft_sticks(count=4)", "craft_wooden_pickaxe()"]
    assert _plan_all("dirt_wall") == ["mine_dirt(count=3)", "build_wall()"]


def test_unit_steps_ask_for_one_run_at_a_time():
    unit = RulesPlanner(unit_steps=True)
    assert _plan_all("dirt_wall", unit) == ["mine_dirt(count=1)", "mine_dirt(count=2)", "mine_dirt(count=3)",
                                            "build_wall()"]
    assert _plan_all("wooden_pickaxe", unit) == _plan_all("wooden_pickaxe")  # one unit each already
    # A craft's unit is one craft (4 planks from a log); the total is never exceeded.
    labels = _plan_all("steel_pickaxe", unit)
    assert labels[:4] == ["mine_log(count=1)", "mine_log(count=2)", "craft_planks(count=4)",
                          "craft_planks(count=8)"], labels
    assert labels.count("mine_iron(count=1)") == 1 and "mine_iron(count=3)" in labels
    assert labels.count("mine_coal(count=1)") == 1 and labels.count("smelt_iron(count=3)") == 1  # one batch


def test_the_rules_planner_replans_from_a_loss_and_never_picks_an_inadmissible_subtask():
    task, info = load_task("wooden_pickaxe"), _sim_info()
    info.update(inventory={"default:wood": 3}, craft_item={"default:wood": 4, "default:stick": 4},
                pickup={"default:tree": 1})  # the sticks were taken
    info["subgoals_done"] = task.subgoals_done(info)
    ctx = lambda adm: PlanningContext(task.text, task.success, task.subgoals, [], info, {}, adm, {}, SCHEMAS)
    adm = {n: s for n, s in SCHEMAS.items() if evaluate_condition(s.applicable, info)}
    assert RulesPlanner().plan(ctx(adm)).subtask.label == "mine_log(count=1)"  # 3 planks + 2 sticks need 4
    r = RulesPlanner().plan(ctx({k: v for k, v in adm.items() if k != "mine_log"}))
    assert r.subtask is None and "not admissible" in r.error


def test_memories_serialise_learn_and_retrieve(tmp_path):
    mem = Memory("make a pickaxe")
    before = {"inventory": {"default:tree": 1}}
    after = {"inventory": {"default:wood": 4}}
    e = mem.procedural.learn("craft_planks(count=4)", "craft_planks", {"count": 4}, before, after, 40)
    assert e["consumed"] == {"default:tree": 1} and e["produced"] == {"default:wood": 4}
    mem.procedural.learn("craft_sticks(count=4)", "craft_sticks", {"count": 4}, after,
                         {"inventory": {"default:wood": 3, "default:stick": 4}}, 30)
    assert mem.procedural.dependencies("craft_sticks(count=4)") == ["craft_planks(count=4)"]
    mem.procedural.save(tmp_path / "p.json")
    again = ProceduralMemory.load(tmp_path / "p.json")  # the next episode starts with it
    assert again.retrieve(["craft_sticks"])[0]["depends_on"] == ["craft_planks(count=4)"]
    mem.world.observe({"nearby": [("default:tree", (0, 9, 3))], "pos": (0.0, 8.5, 0.0)}, 5, label="x")
    assert mem.world.retrieve((0.0, 8.5, 0.0), 0.0) == [
        {"kind": "default:tree", "pos": [0, 9, 3], "distance": 3.0, "bearing": "ahead"}]
    assert json.loads(json.dumps(mem.to_json()))["world"]["positions"][0]["after"] == "x"
    # yaw 0 faces +z and grows turning right: +x is to the right at yaw 0, behind at yaw 90... by hand
    assert relation((0, 0, 0), 0.0, (3, 0, 0))["bearing"] == "right"
    assert relation((0, 0, 0), 90.0, (0, 0, -4)) == {"distance": 4.0, "bearing": "right"}
    assert relation((0, 0, 0), 90.0, (-2, 0, 0))["bearing"] == "behind"
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="not a procedural memory file"):
        ProceduralMemory.load(tmp_path / "bad.json")


def test_visual_change_is_the_mean_signature_difference():
    black, white = np.zeros((56, 56, 3), np.uint8), np.full((56, 56, 3), 255, np.uint8)
    assert visual_change(black, white) == pytest.approx(1.0)
    half = black.copy()
    half[:, 28:] = 255
    assert visual_change(black, half) == pytest.approx(0.5)
    mon = ChangeMonitor()
    assert not mon.push(black, {"is_gui_open": False})
    assert not mon.push(white, {"is_gui_open": True})  # a GUI opening: expected
    assert not mon.push(black, {"is_gui_open": True}, {"camera": [0.0, 10.0]})  # the agent's own fast turn
    for _ in range(4):  # ... explains the next few steps' changes too (the server lags the input)
        assert not mon.push(black, {"is_gui_open": True}, {"camera": [0.0, 1.0]})
    assert not mon.jumped
    assert mon.push(white, {"is_gui_open": True}, {"camera": [0.0, 1.0]}) and "changed by 1.000" in mon.reason
    mon.reset()
    mon.push(black, {"pos": (0, 8.5, 0)})
    assert mon.push(black, {"pos": (5, 8.5, 0)}) and "moved 5.0 blocks" in mon.reason


def test_the_stall_monitor_counts_still_steps_outside_the_gui_and_the_unstick_motion_levels_and_turns():
    """Still = the privileged pose within STALL_MOVE / STALL_TURN of where the run began and the items
    unchanged (yaw across 360 counts as still); a move, a turn, an item or an open GUI starts the run again.
    ``unstick_actions``: UNSTICK_BACK steps back, then turns of at most UNSTICK_MAX_TURN summing to the
    pitch levelled and a yaw in UNSTICK_TURN either way, reproducible from its rng."""
    from histeve_jax.harness.controller import UNSTICK_BACK, UNSTICK_MAX_TURN, UNSTICK_TURN, unstick_actions
    from histeve_jax.harness.verify import StallMonitor

    with pytest.raises(ValueError, match="patience must be > 0"):
        StallMonitor(0)
    base = {"pos": (1.0, 8.5, 2.0), "yaw": 359.6, "pitch": -40.0, "inventory": {"default:tree": 1}}
    mon = StallMonitor(3)
    assert not mon.push(base)  # the run's anchor
    assert not mon.push({**base, "pos": (1.03, 8.5, 2.0), "yaw": 0.4})  # within 0.05 blocks, across 360
    assert not mon.push(base) and mon.still == 2
    assert mon.push({**base, "pitch": -39.2}) and mon.still == 3
    for change in ({"pos": (1.1, 8.5, 2.0)}, {"yaw": 1.0}, {"pitch": -38.5},
                   {"inventory": {"default:tree": 2}}, {"is_gui_open": True}):
        mon = StallMonitor(2)
        mon.push(base), mon.push(base)
        assert not mon.push({**base, **change}) and mon.still == 0, change
    assert not StallMonitor(1).push({"yaw": 0.0})  # no pose in the info: never still

    acts = unstick_actions(base, np.random.default_rng(0))
    assert all(a["back"] == 1 and not np.any(a["camera"]) for a in acts[:UNSTICK_BACK])
    turns = np.array([a["camera"] for a in acts[UNSTICK_BACK:]])
    assert len(turns) and np.abs(turns).max() <= UNSTICK_MAX_TURN + 1e-5
    assert not any(a["back"] or a["attack"] for a in acts[UNSTICK_BACK:])
    dpitch, dyaw = turns.sum(0)
    assert dpitch == pytest.approx(40.0, abs=1e-3) and UNSTICK_TURN[0] <= abs(dyaw) <= UNSTICK_TURN[1]
    again = unstick_actions(base, np.random.default_rng(0))
    assert np.array_equal(np.array([a["camera"] for a in again]), np.array([a["camera"] for a in acts]))
    yaws = {np.sign(np.sum([a["camera"][1] for a in unstick_actions(base, np.random.default_rng(s))]))
            for s in range(20)}
    assert yaws == {-1.0, 1.0}


def test_the_walk_back_closes_an_open_gui_first_then_turns_and_walks_to_its_target():
    """``WalkBack`` by hand, in a toy world (the camera moves the look exactly, ``forward`` 0.2 blocks along
    it, the inventory key closes the GUI): the key first, 3 still steps once closed, then turns of at most the
    experts' rate, walking only within 30 degrees of the target, done within reach of it, level and facing
    it. Against a wall (the position never changes) it jumps, and gives up after its step limit."""
    from histeve_jax.envs.experts.core import MAX_TURN
    from histeve_jax.harness.controller import WALK_BACK_MAX_STEPS, WALK_BACK_REACH, WalkBack

    target = (9, 9, -1)  # the node's centre (9.5, -0.5): 93 degrees to the right of +z, 9.5 blocks away

    def play(info, moves=True):
        walk, acts = WalkBack(target), []
        for _ in range(WALK_BACK_MAX_STEPS + 200):
            action, phase = walk.act(info)
            if phase == "done":
                return info, acts
            assert phase in ("close_inventory", "walk_back"), phase
            acts.append(action)
            yaw, pitch = info["yaw"] + action["camera"][1], info["pitch"] + action["camera"][0]
            x, y, z = info["pos"]
            if moves and action["forward"]:
                x, z = x + 0.2 * np.sin(np.radians(yaw)), z + 0.2 * np.cos(np.radians(yaw))
            info = {**info, "pos": (x, y, z), "yaw": float(yaw), "pitch": float(pitch),
                    "is_gui_open": info["is_gui_open"] and not action["inventory"]}
        raise AssertionError("the walk did not end")

    start = {"pos": (0.0, 8.5, 0.0), "yaw": 0.0, "pitch": 20.0, "is_gui_open": True}
    end, acts = play(start)
    assert [a["inventory"] for a in acts[:4]] == [1, 0, 0, 0] and not any(a["inventory"] for a in acts[4:])
    assert not any(np.any(a["camera"]) or a["forward"] for a in acts[:4])
    cams = np.array([a["camera"] for a in acts[4:]])
    assert np.abs(cams).max() <= MAX_TURN + 1e-5
    assert not acts[4]["forward"]  # 93 degrees off: it turns on the spot first
    dx, dz = 9.5 - end["pos"][0], -0.5 - end["pos"][2]
    assert np.hypot(dx, dz) <= WALK_BACK_REACH
    facing = (np.degrees(np.arctan2(dx, dz)) - end["yaw"] + 180.0) % 360.0 - 180.0
    assert abs(facing) <= 5.0 and abs(end["pitch"]) <= 5.0, end
    # a wall: never arrives, jumps once stuck, stops after WALK_BACK_MAX_STEPS steps of walking
    _, acts = play({**start, "yaw": 93.0, "pitch": 0.0, "is_gui_open": False}, moves=False)
    assert len(acts) == WALK_BACK_MAX_STEPS and any(a["jump"] for a in acts)


@pytest.mark.parametrize("outcome, applicable, failures, changed, recoveries, want", [
    ("success", True, [], True, 5, "advance"),
    ("failure", True, [("stalled", True)], False, 0, "recover"),
    ("failure", True, [("missing_inputs", False)], False, 0, "replan"),  # recovery infeasible
    ("failure", False, [], False, 0, "replan"),  # inapplicable now
    ("interrupted", True, [], True, 0, "replan"),  # the visual state changed substantially
    ("interrupted", True, [], False, 2, "replan"),  # recoveries spent
    ("interrupted", True, [], False, 1, "recover"),
])
def test_advance_recover_replan(outcome, applicable, failures, changed, recoveries, want):
    v = Verdict(outcome, "budget", outcome == "success", applicable, failures, 0, 0.0, changed, [])
    assert decide(v, recoveries, max_recoveries=2) == want == v.decision


def test_placing_experts_place_what_is_still_missing_with_spare_cells():
    """place_dirt's count is cumulative: with 2 placed, place_dirt(count=3) places one more; build_wall places
    three; both have cells to fall back on beyond their own, and a goal beyond the cells is refused."""
    from histeve_jax.envs.experts import PlaceExpert
    from histeve_jax.harness.executors import EXPERT_MAKERS, SPARE_CELLS, WALL_CELLS

    task = load_task("place_dirt")
    info = {"place_block": {"default:dirt": 2}, "inventory": {"default:dirt": 2}}
    expert = EXPERT_MAKERS["place_dirt"](task, SCHEMAS["place_dirt"].instantiate({"count": 3}), info)
    assert expert.goal == 1 and len(expert.cells) > 1 and expert.cells[0] == (0, 2)
    expert = EXPERT_MAKERS["place_dirt"](task, SCHEMAS["place_dirt"].instantiate({"count": 16}), {})
    assert expert.goal == len(expert.cells)
    wall = EXPERT_MAKERS["build_wall"](load_task("build_wall"), SCHEMAS["build_wall"].instantiate({}), {})
    assert wall.goal == 3 and list(wall.cells) == [*WALL_CELLS, *SPARE_CELLS]
    with pytest.raises(ValueError, match="goal 4 needs 1..3 cells"):
        PlaceExpert(task, "default:dirt", [(0, 2), (1, 2), (2, 2)], goal=4)


def test_the_furnace_goes_next_to_the_player_before_the_fixed_spot():
    """place_furnace tries ground cells within reach of where the player stands (no walk) before the
    arena's furnace spot, so a player walled into a mining pit still places it."""
    from histeve_jax.envs.experts import FURNACE_SPOT, REACH
    from histeve_jax.harness.executors import EXPERT_MAKERS

    info = {"pos": [5.8, 8.5, -2.2], "place_block": {}}
    subtask = SCHEMAS["place_furnace"].instantiate({})
    expert = EXPERT_MAKERS["place_furnace"](load_task("steel_pickaxe"), subtask, info)
    assert expert.goal == 1 and expert.cells[-1] == FURNACE_SPOT and len(expert.cells) == 5
    for cx, cz in expert.cells[:-1]:
        assert np.hypot(cx - 5.8, cz + 2.2) <= REACH - 1.0  # PlaceExpert walks only beyond REACH - 1
