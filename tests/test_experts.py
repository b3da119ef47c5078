"""Scripted experts on the real game: they succeed through env-format actions only and name their subtasks."""

import math

import numpy as np
import pytest

from histeve_jax.envs import base, load_task, make
from histeve_jax.envs.experts import CRAFT_XY, EXPERT_TASKS, MAX_TURN, RECIPES, SLOT_XY, expert_for
from histeve_jax.envs.tasks import list_tasks, task_from_dict


def test_every_expert_task_is_shipped_and_has_an_expert():
    assert set(EXPERT_TASKS) <= set(list_tasks())
    for name in EXPERT_TASKS:
        assert expert_for(load_task(name)).task.name == name
    steel = load_task("steel_pickaxe")
    stages = [name for name, _ in expert_for(steel).stages]
    assert [n for n, _ in steel.subgoals] == [n for i, n in enumerate(stages) if n not in stages[:i]
                                             and n != "place_furnace"]
    odd = task_from_dict({"name": "dance", "category": "explore", "text": "dance", "max_steps": 5,
                          "success": {"inventory": {"x": 1}}})
    with pytest.raises(KeyError, match="no scripted expert for task 'dance'"):
        expert_for(odd)


def test_cursor_moves_are_bin_centres_and_converge():
    """The GUI experts' cursor moves are exactly representable as action tokens (token round trip), and the
    walk from any pixel offset ends within the smallest bin's reach instead of oscillating."""
    import numpy as np

    from histeve_jax.actions.tokens import ActionVocab
    from histeve_jax.envs.experts import cursor_move

    vocab = ActionVocab.contiguous("vpt", 0)
    rng = np.random.default_rng(0)
    for dx, dy in rng.uniform(-300, 300, size=(200, 2)):
        action = {**base.noop_action(), "camera": np.asarray(cursor_move(dx, dy), np.float32)}
        back, _ = vocab.decode(vocab.encode(action, 1))
        np.testing.assert_allclose(back["camera"], action["camera"], atol=1e-5)
        x, y = 0.0, 0.0
        for _ in range(40):  # the env moves the cursor by PIXELS_PER_DEGREE px per degree
            move = cursor_move(dx - x, dy - y)
            if move == (0.0, 0.0):
                break
            y, x = y + move[0] * base.PIXELS_PER_DEGREE, x + move[1] * base.PIXELS_PER_DEGREE
        assert move == (0.0, 0.0) and abs(dx - x) <= 2.1 and abs(dy - y) <= 2.1


def test_mine_log_walks_to_the_trunk_in_view_over_a_nearer_one_behind():
    """The expert's tree is the one ahead when one behind is only a little nearer (the frame shows the one
    ahead, not the other), and the nearer one when the difference is large; ties of turn go by distance."""
    from histeve_jax.envs.experts import MineExpert

    task = load_task("mine_log")
    expert = MineExpert(task, ("default:tree",), "default:tree")

    def target(yaw, trunks):
        expert.info = {"pos": (0.0, 8.5, 0.0), "nearby": [("default:tree", (x, 10, z)) for x, z in trunks]}
        expert.est_yaw, expert.est_pitch = yaw, 0.0
        return expert.target()[::2]

    assert target(0.0, [(0, 5), (0, -3)]) == (0, 5)  # yaw 0 looks along +z: the one ahead, 2 blocks further
    assert target(180.0, [(0, 5), (0, -3)]) == (0, -3)  # turned round: the nearer one is also ahead
    assert target(0.0, [(0, 9), (0, -2)]) == (0, -2)  # far ahead against right behind: the turn is worth it
    assert target(90.0, [(0, 5), (0, -3)]) == (0, -3)  # both 90 degrees off: the nearer


def test_gui_geometry_is_a_grid():
    assert SLOT_XY[1][1] == SLOT_XY[8][1] and SLOT_XY[9][0] == SLOT_XY[1][0]
    assert [SLOT_XY[i + 1][0] for i in range(8)] == sorted(SLOT_XY[i + 1][0] for i in range(8))
    assert CRAFT_XY[(0, 1)][0] - CRAFT_XY[(0, 0)][0] == 26
    assert set(RECIPES["default:pick_wood"].values()) == {"default:wood", "default:stick"}


@pytest.fixture(scope="module")
def env():
    e = make("luanti", obs_size=(36, 64), randomize_init=True)
    yield e
    e.close()


def _trace(env, task, seed, perturb=0.0):
    """Play ``task``'s expert from ``seed``: (the final info, and per step (subtask, action, the info the
    game reported after the step))."""
    _, info = env.reset(seed=seed, options={"task": task})
    expert = expert_for(task)
    if perturb:
        expert.set_perturbation(perturb, seed)
    expert.reset(info)
    steps = []
    for _ in range(task.max_steps):
        action, subtask = expert.act(info)
        _, _, terminated, truncated, info = env.step(action)
        steps.append((subtask, action, info))
        if terminated or truncated:
            break
    return info, steps


def _run(env, name, seed, clutter=None):
    task = load_task(name)
    if clutter is not None:  # the chance of a cluttered start (``init.vary.clutter``), not the task's own
        task = task.varied(clutter=clutter)
    _, info = env.reset(seed=seed, options={"task": task})
    expert = expert_for(task)
    expert.reset(info)
    subtasks = []
    for _ in range(task.max_steps):
        action, subtask = expert.act(info)
        base.validate_action(action)
        assert max(abs(float(v)) for v in action["camera"]) <= MAX_TURN + 1e-6
        if not subtasks or subtasks[-1] != subtask:
            subtasks.append(subtask)
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    return info, subtasks


@pytest.mark.parametrize("name", ["mine_log", "mine_stone", "craft_wooden_pickaxe", "smelt_iron",
                                  "build_wall", "find_gold"])
@pytest.mark.game
def test_expert_succeeds(env, name):
    info, subtasks = _run(env, name, seed=5)
    assert info["success"], f"{name}: expert failed; subtasks {subtasks}, inventory {info['inventory']}"
    if name == "craft_wooden_pickaxe":
        assert subtasks[0] == "open_inventory" and subtasks[-1] in ("store_output", "close_inventory")
        assert "take_output" in subtasks and "place_default:stick" in subtasks
    if name == "smelt_iron":
        assert info["craft_item"] == {"default:steel_ingot": 1}  # taken out of the furnace
        assert "load_ore" in subtasks and "take_product" in subtasks
    if name == "mine_stone":
        assert info["use_item"] == {"default:pick_wood": 1}  # the tool was used to break the stone
    if name == "mine_log":  # it walks up to its tree first (MineExpert(approach=2.0)), then digs the log at
        # eye level: walking there left it looking at it (no separate aim phase). From a start beside a trunk
        # (``init.vary.beside``, 0.85-1.6 blocks from it) it steps in to 1.1 blocks when further than 1.3, to
        # see the log above the gap through it, and aims up.
        start = env.reset(seed=5, options={"task": name})[1]
        near = min(math.hypot(start["pos"][0] - t["pos"][0], start["pos"][2] - t["pos"][2])
                   for t in load_task(name).init["trees"])
        if near > 2.5:
            assert subtasks[0] == "approach" and subtasks[1] in ("aim", "dig") and "dig" in subtasks, subtasks
        else:
            stepped_in = subtasks[0] == "approach" and near > 1.3
            assert subtasks[0] in ("aim", "dig") or stepped_in, (near, subtasks)
            assert "dig" in subtasks, subtasks


@pytest.mark.game
def test_craft_subtasks_chain_without_ambiguous_returns(env):
    """craft_sticks starts from what craft_planks leaves in wooden_pickaxe and leaves exactly what
    craft_wooden_pickaxe starts from. Spare items go to the empty slot farthest from the one they were
    picked from (a click on the source slot, or next to it, looks like the one before the grid). From a
    cluttered start (leaves on slot 1) the sticks land on slot 2 and the planks on 32: the pickaxe's
    cluttered start, whose text then names slots 2 and 32."""
    layout = lambda info: [{"item": s["type"], "count": s["quantity"], "slot": i}
                           for i, s in enumerate(info["inventory_slots"], start=1) if s["type"] != "air"]
    info, _ = _run(env, "craft_sticks", seed=7, clutter=1.0)
    assert info["success"], info["inventory"]
    assert [(it["item"], it["slot"]) for it in layout(info)] == [
        ("default:leaves", 1), ("default:stick", 2), ("default:wood", 32)]
    info, subtasks = _run(env, "craft_sticks", seed=7, clutter=0.0)
    assert info["success"] and "return_default:wood" in subtasks, subtasks
    pickaxe_start = load_task("craft_wooden_pickaxe").init["inventory"]
    assert layout(info) == sorted(pickaxe_start, key=lambda it: it["slot"])
    assert layout(info)[1]["slot"] == 32  # the spare planks: the slot farthest from slot 1
    info, subtasks = _run(env, "craft_wooden_pickaxe", seed=7, clutter=0.0)  # 4 sticks, slot 1: 2 to 32
    assert info["success"] and "return_default:stick" in subtasks, subtasks
    assert layout(info) == [{"item": "default:pick_wood", "count": 1, "slot": 1},
                            {"item": "default:stick", "count": 2, "slot": 32}]


@pytest.mark.game
def test_mine_dirt_digs_the_ground_ahead(env):
    """mine_dirt's expert digs a ground node ahead of the view (TURN_COST), pitching down rather than turning
    to whichever node lies nearest: from randomised starts (yaw +-15) its yaw ends within 30 degrees of where
    it started, and it digs the node its look points at."""
    from histeve_jax.envs.base import wrap_degrees

    task = load_task("mine_dirt")
    for seed in (0, 1, 2, 3):
        _, info = env.reset(seed=seed, options={"task": task})
        yaw0 = info["yaw"]
        expert = expert_for(task)
        expert.reset(info)
        turned = 0.0
        for _ in range(60):
            action, _subtask = expert.act(info)
            turned += abs(float(action["camera"][1]))
            _, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        assert info["success"], f"seed {seed}: inventory {info['inventory']}"
        assert abs(wrap_degrees(info["yaw"] - yaw0)) < 30 and turned < 40, (seed, yaw0, info["yaw"], turned)
        assert info["pitch"] > 30  # it looked down at the ground to dig


@pytest.mark.game
def test_mine_log_digs_the_log_at_eye_level(env):
    """The log the expert digs is the trunk's node around the eye (y = 10 with feet at 8.5), looked at level,
    or the one above it where that one is gone, never the base: a policy that stops short of the expert's
    spot still has the trunk under the crosshair, where the base log (looked at 45 degrees down) left it the
    ground in front (11 of 13 failures of a run). From mine_log's randomized starts (anywhere, some trunks
    missing their eye-level log)."""
    task = load_task("mine_log")
    for seed in (0, 1, 2, 3):
        _, info = env.reset(seed=seed, options={"task": task})
        expert = expert_for(task)
        expert.reset(info)
        target = expert.target()
        assert target is not None and target[1] >= 10, target  # at or above the eye, never the base (9)
        info, steps = _trace(env, task, seed)
        pitches = [i["pitch"] for n, _, i in steps if n == "dig"]
        assert info["success"], f"seed {seed}: inventory {info['inventory']}"
        assert pitches and max(pitches) < 10, pitches  # never looking down at the grass by the trunk


@pytest.mark.game
def test_a_perturbed_mine_expert_looks_off_the_log_and_comes_back(env):
    """``Expert.set_perturbation(1.0)``: before its aim the mining expert looks off the log and attacks there,
    and in its dig the view is thrown off while attack is held, every such step named ``PERTURB``; the
    expert's own steps after them turn back onto the log holding attack, bring the game's reported look back
    where it was before the throw, and it still gets its log."""
    from histeve_jax.envs.base import wrap_degrees
    from histeve_jax.envs.experts import PERTURB, is_perturbed

    assert is_perturbed(PERTURB) and is_perturbed("logs/" + PERTURB) and not is_perturbed("dig")
    task = load_task("mine_log")
    for seed in (0, 1):
        info, steps = _trace(env, task, seed, perturb=1.0)
        assert info["success"], f"seed {seed}: inventory {info['inventory']}"
        names = [n for n, _, _ in steps]
        look = [(i["yaw"], i["pitch"]) for _, _, i in steps]  # the reported look after each step
        first = names.index(PERTURB)
        aim = names.index("aim", first)
        assert "dig" not in names[:first] and names[aim - 1] == PERTURB  # looked off, then aimed
        # the turn back holds the button the look off pressed (a policy beside a log turns onto it digging)
        dig = names.index("dig")
        assert steps[aim - 1][1]["attack"] and all(steps[i][1]["attack"] for i in range(aim, dig))
        jolt = next(i for i in range(first + 1, len(names)) if names[i] == PERTURB and names[i - 1] == "dig")
        end = next(i for i in range(jolt, len(names)) if names[i] != PERTURB)
        assert all(a["attack"] for _, a, _ in steps[jolt:end])  # the dig's button held through the throw
        (yaw0, pitch0), (yaw1, pitch1) = look[jolt - 1], look[end - 1]
        assert max(abs(wrap_degrees(yaw1 - yaw0)), abs(pitch1 - pitch0)) > 3  # the throw moved the view
        dug = next((i for i in range(end, len(names)) if names[i] != "dig"), len(names)) - 1  # its last dig
        yaw2, pitch2 = look[dug]
        assert abs(wrap_degrees(yaw2 - yaw0)) < 2.5 and abs(pitch2 - pitch0) < 2.5, (look[jolt - 1],
                                                                                    look[dug])


@pytest.mark.game
def test_a_perturbed_craft_expert_clicks_on_nothing_and_moves_on(env):
    """``set_perturbation(1.0)`` on a craft: as the inventory opens, before it picks a stack and before it
    takes the output (its hand empty each time), the expert holds one button for 1-4 steps where a click
    changes nothing (where the inventory put the pointer or astray; 12-45 px off the stack or the output,
    on nothing or an empty cell or slot), every step ``PERTURB``; the GUI stays open, the game's inventory
    and grid are unchanged by them, and the expert's own next step moves the pointer on; the craft then
    succeeds."""
    from histeve_jax.envs.experts import PERTURB
    from histeve_jax.envs.experts.core import CRAFT_OUTPUT_XY, click_changes_nothing

    task = load_task("craft_planks").varied(clutter=0.0)
    strayed = set()
    for seed in (0, 1, 2, 3):
        info, steps = _trace(env, task, seed, perturb=1.0)
        names = [n for n, _, _ in steps]
        first = names.index(PERTURB)
        assert set(names[:first]) == {"open_inventory"}, names[:first + 1]
        clicking = [n == PERTURB and bool(a.get("attack") or a.get("use")) for n, a, _ in steps]
        blocks = [i for i in range(first, len(names)) if clicking[i] and not clicking[i - 1]]
        assert len(blocks) == 3, names  # as the inventory opens, before the log's pick, before the output
        for start in blocks:
            end = clicking.index(False, start)
            assert end - start <= 4, names[start:end + 1]
            assert len({b for i in range(start, end) for b in ("attack", "use") if steps[i][1].get(b)}) == 1
            assert not any(np.any(steps[i][1]["camera"]) for i in range(start, end))
            before, clicked = steps[start - 1][2], steps[end - 1][2]
            assert clicked["is_gui_open"], names[start:end + 1]
            assert click_changes_nothing(clicked["cursor"], clicked), clicked["cursor"]
            assert clicked["inventory"] == before["inventory"]  # a click on nothing took nothing
            assert [g["type"] for g in clicked["craft_grid"]] == [g["type"] for g in before["craft_grid"]]
            own = next(i for i in range(end, len(names)) if names[i] != PERTURB)
            assert np.any(steps[end][1]["camera"]) and np.any(steps[own][1]["camera"])  # moves on
            if start == blocks[0]:
                strayed.add(start > first)
                assert clicked["inventory"] == {"default:tree": 1}  # the task's (uncluttered) start
                assert all(g["type"] == "air" for g in clicked["craft_grid"]), clicked["craft_grid"]
        (x, y), (ox, oy) = steps[end - 1][2]["cursor"], CRAFT_OUTPUT_XY  # the last: before the output
        assert 12 - 5 <= max(abs(x - ox), abs(y - oy)) <= 45 + 5 and names[end] == "take_output"
        assert info["success"], names
    assert strayed == {False, True}, strayed  # in place on some seeds, moved astray first on others


@pytest.mark.game
def test_beside_a_chopped_trunk_the_expert_digs_the_log_above_through_the_gap(env):
    """The log above a trunk's gap sits in the crown's bottom layer, its sides behind leaves: aimed at its
    side, the expert dug a leaf first in 66 of 112 demonstrations (looking up into the crown, what a policy
    then copied). It aims at its bottom face through the gap now, stepping in when further than 1.3 blocks:
    from starts beside a chopped trunk (``beside: 1.0``) it digs the log and nothing else (the game's
    counters)."""
    task = load_task("mine_log").varied(beside=1.0)
    for seed in (0, 1, 2):
        _, info = env.reset(seed=seed, options={"task": task})
        expert = expert_for(task)
        expert.reset(info)
        assert expert.under_a_gap(expert.target())  # the start's target: the log above a gap
        info, steps = _trace(env, task, seed)
        pitches = [i["pitch"] for n, _, i in steps if n == "dig"]
        assert info["success"] and info["mine_block"] == {"default:tree": 1}, (seed, info["mine_block"])
        assert pitches and max(pitches) < -15, pitches  # looking up through the gap


@pytest.mark.parametrize("hotbar_full", [False, True])
@pytest.mark.game
def test_an_item_outside_the_hotbar_is_moved_into_it_and_placed(env, hotbar_full):
    """A full hotbar puts a craft's output in the main inventory (the steel pickaxe's furnace in slot 10):
    PlaceExpert moves it into the hotbar through the inventory GUI (swapping with slot 9 when no hotbar slot
    is free, the swapped stack going where the item was) and places it."""
    from histeve_jax.envs.experts import PlaceExpert
    from histeve_jax.envs.experts.core import HOTBAR

    filler = [{"item": "default:cobble", "count": 1 + i, "slot": i + 1} for i in range(HOTBAR * hotbar_full)]
    inventory = [*filler, {"item": "default:dirt", "count": 2, "slot": 12}]
    task = task_from_dict({"name": "place_dirt", "category": "build", "text": "place a dirt block",
                           "max_steps": 300, "init": {"pos": [0.0, 8.5, 0.0], "inventory": inventory},
                           "success": {"place_block": {"default:dirt": ">=1"}}})
    _, info = env.reset(seed=7, options={"task": task})
    assert [s["type"] for s in info["inventory_slots"]][11] == "default:dirt"
    expert = PlaceExpert(task, "default:dirt", [(0, 2)])
    expert.reset(info)
    for _ in range(task.max_steps):
        action, _phase = expert.act(info)
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    assert info["success"] and info["place_block"] == {"default:dirt": 1}
    slots = [s["type"] for s in info["inventory_slots"]]
    dirt = slots.index("default:dirt") + 1
    assert dirt <= HOTBAR and info["held_slot"] == dirt
    if hotbar_full:  # swapped: the dirt in slot 9, slot 9's cobble where the dirt was, no cobble lost
        assert dirt == HOTBAR and slots[11] == "default:cobble"
        assert info["inventory"]["default:cobble"] == sum(range(1, HOTBAR + 1))


@pytest.mark.game
def test_place_expert_stops_at_its_goal(env):
    """PlaceExpert with goal=2 over three cells places exactly two blocks (the third cell is a spare)."""
    from histeve_jax.envs.experts import PlaceExpert

    task = load_task("build_wall")
    _, info = env.reset(seed=3, options={"task": task})
    expert = PlaceExpert(task, "default:dirt", [(-1, 2), (0, 2), (1, 2)], goal=2)
    expert.reset(info)
    for _ in range(task.max_steps):
        action, phase = expert.act(info)
        if phase == "done":
            break
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    assert phase == "done" and info["place_block"] == {"default:dirt": 2}


def _disturbed(env, name, seed, prefix):
    """Play the env-format actions of ``prefix`` (a policy's stray moves), then let a fresh expert take over
    from the state they left; returns the final info, the expert's subtasks and the subtask of each of its
    inventory-key presses."""
    task = load_task(name)
    _, info = env.reset(seed=seed, options={"task": task})
    for action in prefix:
        _, _, _, _, info = env.step({**base.noop_action(), **action})
    expert = expert_for(task)
    expert.reset(info)
    subtasks, presses = [], []
    for _ in range(task.max_steps):
        action, subtask = expert.act(info)
        if not subtasks or subtasks[-1] != subtask:
            subtasks.append(subtask)
        if action["inventory"]:
            presses.append(subtask)
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    return info, subtasks, presses


def _cursor(dyaw, dpitch=0.0):
    import numpy as np

    return {"camera": np.asarray([dpitch, dyaw], np.float32)}


@pytest.mark.game
def test_craft_expert_takes_over_with_the_inventory_open_and_the_grid_wrong(env):
    """DAgger's takeover: an expert started in a state a policy left (inventory open, cursor far off, the log
    dropped in the wrong grid cell) keeps the GUI open, clears the wrong cell and crafts."""
    from histeve_jax.envs.experts import CRAFT_XY, cursor_move

    wait = [{}] * 3
    prefix = [{"inventory": 1}, *[{}] * 12]  # open the inventory; the cursor starts at the centre
    info_cursor = (320, 180)

    def to(xy):
        nonlocal info_cursor
        moves = []
        for _ in range(12):
            dy, dx = cursor_move(xy[0] - info_cursor[0], xy[1] - info_cursor[1])
            if (dy, dx) == (0.0, 0.0):
                break
            moves.append(_cursor(dx, dy))
            info_cursor = (info_cursor[0] + dx * base.PIXELS_PER_DEGREE,
                           info_cursor[1] + dy * base.PIXELS_PER_DEGREE)
        return moves

    prefix += to(SLOT_XY[1]) + wait + [{"attack": 1}, {}]  # the log onto the cursor
    prefix += to(CRAFT_XY[(2, 2)]) + wait + [{"use": 1}, {}]  # one log into the wrong cell
    prefix += to((560, 40)) + wait  # and the cursor far off, over the world
    info, subtasks, presses = _disturbed(env, "craft_planks", 11, prefix)
    assert info["success"], f"subtasks {subtasks}, grid {info['craft_grid']}, inventory {info['inventory']}"
    assert "clear_grid" in subtasks and set(presses) <= {"close_inventory"}  # never closed, then reopened


@pytest.mark.game
def test_closing_the_inventory_returns_the_crafting_grid_to_the_inventory(env):
    """As in Minecraft: a craft cut short (a plank in the grid, the rest on slot 32 after the expert's
    return) leaves nothing in the grid once the inventory is closed; every plank is back in the inventory."""
    from histeve_jax.envs.experts import cursor_move

    task = load_task("craft_sticks").varied(clutter=0.0)  # 4 planks on slot 1
    _, info = env.reset(seed=0, options={"task": task})
    at = [320.0, 180.0]  # the cursor starts at the centre

    def to(xy):
        for _ in range(12):
            dy, dx = cursor_move(xy[0] - at[0], xy[1] - at[1])
            if (dy, dx) == (0.0, 0.0):
                return
            yield _cursor(dx, dy)
            at[0], at[1] = at[0] + dx * base.PIXELS_PER_DEGREE, at[1] + dy * base.PIXELS_PER_DEGREE

    actions = [{"inventory": 1}, *[{}] * 12, *to(SLOT_XY[1]), {}, {"attack": 1}, {}]  # the stack, held
    actions += [*to(CRAFT_XY[(1, 1)]), {}, {"use": 1}, {}, *to(SLOT_XY[32]), {}, {"attack": 1}, {}, {}]
    for action in actions:
        _, _, _, _, info = env.step({**base.noop_action(), **action})
    grid = [s["type"] for s in info["craft_grid"]]
    assert grid.count("default:wood") == 1 and info["inventory"] == {"default:wood": 3}, (grid, info)
    for action in [{"inventory": 1}, *[{}] * 12]:
        _, _, _, _, info = env.step({**base.noop_action(), **action})
    assert not info["is_gui_open"]
    assert {s["type"] for s in info["craft_grid"]} == {"air"}
    assert info["inventory"] == {"default:wood": 4}, info["inventory"]


@pytest.mark.game
def test_world_expert_takes_over_with_the_inventory_open(env):
    """An expert of a world task, handed a state with the inventory open (a policy opened it), closes the GUI
    first and then does its task."""
    prefix = [{"inventory": 1}, *[{}] * 10, _cursor(5.8, -3.2)]
    info, subtasks, presses = _disturbed(env, "place_dirt", 12, prefix)
    assert info["success"] and subtasks[0] == "close_inventory", subtasks
    assert presses[:1] == ["close_inventory"]
