"""The Luanti backend against the real game under Xvfb: state read back through the bridge mod and frames."""

import contextlib
import os
import signal
import time

import numpy as np
import pytest

from histeve_jax.envs import base, load_task, make, noop_action
from histeve_jax.envs.experts import expert_for
from histeve_jax.envs.luanti import GameCrashed, GameHung

pytestmark = pytest.mark.game  # skips without the game, fails under CI=true (conftest)


def _act(**kw):
    a = noop_action()
    for k, v in kw.items():
        a[k] = np.asarray(v, np.float32) if k == "camera" else v
    return a


def _steps(env, action, n):
    for _ in range(n):
        out = env.step(action)
    return out


def _alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


@contextlib.contextmanager
def randomized(env):
    """``env`` drawing each reset's start from its seed within the task's ``init.vary``, for the block."""
    env.randomize_init = True
    try:
        yield env
    finally:
        env.randomize_init = False


@pytest.fixture(scope="module")
def env():
    e = make("luanti", obs_size=(90, 160), task="mine_log", hang_timeout_s=4.0)
    yield e
    e.close()


def test_reset_gives_the_task_initial_state(env):
    task = load_task("mine_stone")
    obs, info = env.reset(options={"task": task})
    assert obs["image"].shape == (90, 160, 3) and obs["image"].dtype == np.uint8
    assert set(base.INFO_KEYS) <= set(info)
    np.testing.assert_allclose(info["pos"], task.init["pos"], atol=0.05)
    assert abs(info["yaw"]) < 0.01 and abs(info["pitch"]) < 0.01
    assert info["inventory"] == {"default:pick_wood": 1}
    assert info["hotbar"][0] == {"type": "default:pick_wood", "quantity": 1}
    assert info["health"] == 20.0 and info["held_slot"] == 1
    assert not info["is_gui_open"] and info["cursor"] is None
    assert all(info[k] == {} for k in base.EVENT_KEYS)
    # The stone wall the task places is in the world (the mod reports watched nodes near the player).
    assert ("default:stone", (0, 9, 2)) in info["nearby"]


def test_forward_moves_the_player_along_its_yaw(env):
    _, info0 = env.reset(options={"task": "place_dirt"})  # an open field ahead (the crafts start by a tree)
    _, _, _, _, info = _steps(env, _act(forward=1), 20)
    _, _, _, _, info = _steps(env, noop_action(), 5)
    dz = info["pos"][2] - info0["pos"][2]
    assert dz > 2.0, f"walked {dz} blocks along +z in 1 s"
    assert abs(info["pos"][0] - info0["pos"][0]) < 0.1


def test_camera_turns_the_view_by_the_requested_angle(env):
    _, info0 = env.reset(options={"task": "craft_planks"})
    _steps(env, _act(camera=[0.0, 4.5]), 10)  # 45 degrees right
    _steps(env, _act(camera=[-2.0, 0.0]), 5)  # 10 degrees up
    _, _, _, _, info = _steps(env, noop_action(), 6)
    assert info["yaw"] - info0["yaw"] == pytest.approx(45.0, abs=0.2)
    assert info["pitch"] - info0["pitch"] == pytest.approx(-10.0, abs=0.2)
    _, _, _, _, info = _steps(env, _act(camera=[0.0, -100.0]), 1)  # one big motion, split across frames
    _, _, _, _, info = _steps(env, noop_action(), 8)
    assert base.wrap_degrees(info["yaw"] - info0["yaw"]) == pytest.approx(-55.0, abs=0.2)


def test_turns_sent_while_the_client_stalls_are_all_taken(env):
    """A client that renders no frame for 0.3 s (as under CPU load) must still take every turn sent meanwhile:
    six 10-degree turns are 400 px of pointer motion, more than the 320 px from the centre to the screen's
    edge, so piled up they were clipped (measured: 47.85 of 60 degrees), and one landing between the client's
    read of the pointer and its re-centring was lost whole."""
    import threading

    _, info0 = env.reset(options={"task": "craft_planks"})
    game = env.unwrapped.proc.game.pid
    os.kill(game, signal.SIGSTOP)
    resume = threading.Timer(0.3, os.kill, (game, signal.SIGCONT))
    resume.start()
    try:
        _steps(env, _act(camera=[0.0, 10.0]), 6)
    finally:
        resume.join()
        os.kill(game, signal.SIGCONT)
    _, _, _, _, info = _steps(env, noop_action(), 10)
    assert base.wrap_degrees(info["yaw"] - info0["yaw"]) == pytest.approx(60.0, abs=0.2)


def test_attacking_a_tree_with_an_empty_hand_yields_a_log(env):
    obs, info = env.reset(options={"task": "mine_log"})
    assert info["inventory"] == {}
    steps = 0
    while steps < 120:  # 3.5 s to dig default:tree by hand
        obs, reward, terminated, _, info = env.step(_act(attack=1))
        steps += 1
        if terminated:
            break
    assert info["inventory"].get("default:tree") == 1, f"after {steps} steps: {info['inventory']}"
    assert info["mine_block"] == {"default:tree": 1} and info["pickup"] == {"default:tree": 1}
    assert reward == 1.0 and info["success"]


def test_inventory_key_opens_the_gui_and_camera_moves_the_cursor(env):
    env.reset(options={"task": "craft_planks"})
    env.step(_act(inventory=1))
    _, _, _, _, info = _steps(env, noop_action(), 4)
    assert info["is_gui_open"]
    x0, y0 = info["cursor"]
    _, _, _, _, info = env.step(_act(camera=[6.0, -15.0]))
    x1, y1 = info["cursor"]
    assert (x1 - x0, y1 - y0) == (round(-15 * base.PIXELS_PER_DEGREE), round(6 * base.PIXELS_PER_DEGREE))
    assert info["yaw"] == 0.0, "camera motion in a GUI must not turn the view"
    env.step(_act(inventory=1))
    _, _, _, _, info = _steps(env, noop_action(), 4)
    assert not info["is_gui_open"] and info["cursor"] is None


def test_the_gui_frame_shows_the_pointer_where_the_cursor_is(env):
    """The grabbed frame has no pointer (the X server draws it apart); the observation gets the arrow at the
    reported cursor in a GUI, and nothing in play."""
    from histeve_jax.envs.cursor import draw_cursor

    obs, info = env.reset(options={"task": "craft_planks"})
    assert info["cursor"] is None and np.array_equal(obs["image"], env._obs(info)["image"])
    env.step(_act(inventory=1))
    _, _, _, _, info = _steps(env, noop_action(), 4)
    x0, y0 = info["cursor"]
    obs, _, _, _, info = env.step(_act(camera=[-3.0, 9.0]))  # over the dark formspec, off the slots
    x, y = info["cursor"]
    raw = env.render()
    assert not (raw[y + 4:y + 20, x + 2:x + 8] == 255).all(axis=-1).any()  # no white arrow in the grab
    k = env.cursor_scale  # the sprite's white fill: rows 2-13, columns 1-5, each pixel k x k
    drawn = draw_cursor(raw, (x, y), k)
    assert (drawn[y + 2 * k:y + 14 * k, x + k:x + 6 * k] == 255).all(axis=-1).sum() >= 40 * k * k
    h, w = obs["image"].shape[:2]
    sy, sx = h / raw.shape[0], w / raw.shape[1]  # the arrow's fill, shrunk with the frame, still shows white
    box = obs["image"][int(y * sy):int((y + 12 * k) * sy) + 1, int(x * sx):int((x + 6 * k) * sx) + 1]
    assert box.min(axis=-1).max() > 150  # white, over the dark grey formspec
    # The guide lines through the tip cross the whole observation (magenta, unlike anything in the game).
    def is_magenta(img):
        img = img.astype(int)
        return (img[..., 0] > 180) & (img[..., 1] < 90) & (img[..., 2] > 180)

    magenta = is_magenta(obs["image"])
    assert env.cursor_lines > 0 and not is_magenta(raw).any()
    assert magenta[round(y * sy)].mean() > 0.8 and magenta[:, round(x * sx)].mean() > 0.8
    # The pointer moved in this step: cyan lines through where it was (cursor_previous); a step that leaves it
    # where it is shows none.
    def is_cyan(img):
        img = img.astype(int)
        return (img[..., 0] < 90) & (img[..., 1] > 180) & (img[..., 2] > 180)

    assert env.cursor_previous and not is_cyan(raw).any() and abs(y - y0) * sy > 4 and abs(x - x0) * sx > 4
    cyan = is_cyan(obs["image"])
    assert cyan[round(y0 * sy)].mean() > 0.7 and cyan[:, round(x0 * sx)].mean() > 0.7
    obs, _, _, _, _ = env.step(noop_action())
    assert not is_cyan(obs["image"]).any() and is_magenta(obs["image"])[round(y * sy)].mean() > 0.8
    env.step(_act(inventory=1))
    _steps(env, noop_action(), 4)


def test_a_gui_action_shows_in_the_next_observation(env):
    """The inventory key's step returns the frame with the GUI open (and closed), a click's step the frame
    that changed under it: a tick-synchronous game's contract, which the demonstrations' labels rely on."""
    from histeve_jax.envs.experts.core import SLOT_XY, cursor_move

    _, info = env.reset(options={"task": "craft_planks"})
    for _ in range(3):
        _, _, _, _, info = env.step(_act(inventory=1))
        assert info["is_gui_open"]
        _, _, _, _, info = env.step(noop_action())
        _, _, _, _, info = env.step(_act(inventory=1))
        assert not info["is_gui_open"]
        _, _, _, _, info = env.step(noop_action())
    _, _, _, _, info = env.step(_act(inventory=1))
    slot = next(i for i, s in enumerate(info["inventory_slots"], 1) if s["type"] == "default:tree")
    for _ in range(20):  # to the log's slot
        move = cursor_move(SLOT_XY[slot][0] - info["cursor"][0], SLOT_XY[slot][1] - info["cursor"][1])
        if move == (0.0, 0.0):
            break
        _, _, _, _, info = env.step(_act(camera=list(move)))
    _steps(env, noop_action(), 3)
    before = env.render().copy()
    env.step(_act(attack=1))  # the stack onto the pointer: the slot's look changes in this step's frame
    assert np.abs(env.render().astype(int) - before).max() > 30
    env.step(noop_action())
    env.step(_act(attack=1))  # and back into its slot
    env.step(_act(inventory=1))
    _steps(env, noop_action(), 2)


def test_expert_crafts_planks_in_the_inventory_gui(env):
    task = load_task("craft_planks")
    _, info = env.reset(options={"task": task})
    expert = expert_for(task)
    expert.reset(info)
    gui_steps = 0
    for _ in range(task.max_steps):
        action, _ = expert.act(info)
        _, _, terminated, truncated, info = env.step(action)
        gui_steps += info["is_gui_open"]
        if terminated or truncated:
            break
    assert info["success"] and info["inventory"].get("default:wood", 0) >= 4
    assert info["craft_item"] == {"default:wood": 4}
    assert gui_steps > 5


def test_reset_opens_the_inventory_on_the_crafting_page_again(env):
    """A page change in one episode (a click on the Recipes tab) does not carry over to the next."""
    env.reset(options={"task": "craft_planks"})
    env.command([{"op": "set_gui_page", "page": "mtg_craftguide:craftguide"}])
    assert env._read_state()["gui_page"] == "mtg_craftguide:craftguide"
    env.reset(options={"task": "craft_planks"})
    assert env._read_state()["gui_page"] == "sfinv:crafting"


def test_two_resets_give_the_same_state(env):
    def snapshot():
        obs, info = env.reset(seed=3, options={"task": "mine_log"})
        keys = ("pos", "yaw", "pitch", "inventory", "health", "held_slot", "nearby", *base.EVENT_KEYS)
        return obs["image"].astype(np.int16), {k: info[k] for k in keys}

    img1, s1 = snapshot()
    # Change the world and the player between the resets.
    _steps(env, _act(attack=1, camera=[0.0, 1.0]), 10)
    _steps(env, _act(forward=1), 10)
    img2, s2 = snapshot()
    assert s1 == s2
    assert np.abs(img1 - img2).mean() < 2.0


def test_randomized_init_is_a_function_of_the_seed(env):
    with randomized(env):
        _, a = env.reset(seed=11, options={"task": "place_dirt"})
        _, b = env.reset(seed=12, options={"task": "place_dirt"})
        _, c = env.reset(seed=11, options={"task": "place_dirt"})
        _, d = env.reset(seed=11, options={"task": "mine_log"})  # its spread: pitch and gapped trunks too
        _, e = env.reset(seed=11, options={"task": "mine_log"})
    assert a["pos"] == c["pos"] and a["yaw"] == pytest.approx(c["yaw"], abs=1e-6)
    assert a["pos"] != b["pos"]
    assert a["pitch"] == b["pitch"] == pytest.approx(0.0, abs=0.5)  # place_dirt's spread has no pitch
    assert d["pos"] == e["pos"] and d["pitch"] == pytest.approx(e["pitch"], abs=1e-6)
    assert sorted(d["nearby"]) == sorted(e["nearby"])


def test_a_task_spread_draws_the_look_the_game_then_holds(env):
    """craft_planks' ``init.vary`` (any yaw, pitch 25 +- 45): the starts the game reports spread over it."""
    task = load_task("craft_planks")
    vary, init = task.init["vary"], task.init
    with randomized(env):
        starts = [env.reset(seed=s, options={"task": "craft_planks"})[1] for s in range(20, 26)]
    for info in starts:
        assert abs(info["pitch"] - init["pitch"]) <= vary["pitch"] + 0.5, info["pitch"]
        (x, _, z), (x0, _, z0) = info["pos"], init["pos"]
        assert abs(x - x0) <= vary["pos"] + 0.05 and abs(z - z0) <= vary["pos"] + 0.05
        # the log, or (``clutter``, half the starts) leaves on slot 1 and 1-3 logs on slot 2
        assert info["inventory"].get("default:tree", 0) >= 1, info["inventory"]
        assert set(info["inventory"]) <= {"default:tree", "default:leaves"}, info["inventory"]
    pitches = sorted(i["pitch"] for i in starts)
    yaws = [i["yaw"] % 360 for i in starts]
    assert pitches[-1] - pitches[0] > 20 and max(yaws) - min(yaws) > 60, (pitches, yaws)


def test_a_cluttered_start_holds_leaves_on_slot_1_and_the_log_on_slot_2(env):
    """``init.vary.clutter`` 1 on craft_planks: the game's inventory is leaves (1-6) on slot 1 and the log,
    1-3 of them, on slot 2, and the instruction read from it names slot 2 (slot 1 without clutter); the
    start's place and look are those of the same seed without it (drawn last)."""
    task = load_task("craft_planks")
    assert task.init["vary"]["clutter"] == 0.5  # as shipped: half the starts
    with_clutter, task = task.varied(clutter=1.0), task.varied(clutter=0.0)
    with randomized(env):
        starts = [(env.reset(seed=s, options={"task": with_clutter})[1],
                   env.reset(seed=s, options={"task": task})[1]) for s in (50, 51, 52)]
    for info, plain in starts:
        slots = {i: s for i, s in enumerate(info["inventory_slots"], start=1) if s["type"] != "air"}
        assert set(slots) == {1, 2} and slots[1]["type"] == "default:leaves", slots
        assert 1 <= slots[1]["quantity"] <= 6, slots
        assert slots[2]["type"] == "default:tree" and 1 <= slots[2]["quantity"] <= 3, slots
        assert plain["inventory"] == {"default:tree": 1}
        assert with_clutter.instruction(info).endswith("from the log in slot 2")
        assert task.instruction(plain).endswith("from the log in slot 1")
        assert info["pos"] == pytest.approx(plain["pos"], abs=0.05)
        assert info["yaw"] == pytest.approx(plain["yaw"], abs=0.5)


def test_mine_logs_starts_clear_the_trunks_and_some_trunks_miss_their_eye_level_log(env):
    """mine_log's ``init.vary`` (anywhere within 9 blocks, ``gap`` 0.5): the game reports starts spread over
    the arena, never inside a trunk, and trunks without the log at eye level (y 10) on some seeds only."""
    task = load_task("mine_log")
    trunks = [(t["pos"][0], t["pos"][2]) for t in task.init["trees"]]
    with randomized(env):
        starts = [env.reset(seed=s, options={"task": "mine_log"})[1] for s in range(30, 36)]
    xs, gaps = [], []
    for info in starts:
        x, _, z = info["pos"]
        xs.append(x)
        assert abs(x) <= 9.05 and abs(z) <= 9.05, info["pos"]
        # never inside a trunk: 0.95 blocks clear, or 0.85 for a start beside one (``vary.beside``)
        assert all(max(abs(x - tx), abs(z - tz)) >= 0.8 for tx, tz in trunks), info["pos"]
        logs = {tuple(p) for n, p in info["nearby"] if n == "default:tree"}
        assert all(abs(p[0]) <= 12 and abs(p[2]) <= 12 for p in logs)  # the arena's only (it is reset)
        assert all((tx, 9, tz) in logs and (tx, 11, tz) in logs for tx, tz in trunks)  # each trunk stands
        gaps.append(sum((tx, 10, tz) not in logs for tx, tz in trunks))
    assert max(xs) - min(xs) > 6, xs
    assert 0 < sum(gaps) < 3 * len(starts), gaps  # some trunks chopped once, not all


@pytest.mark.parametrize("name", ["mine_log", "craft_planks"])
def test_a_start_beside_a_trunk_faces_its_gap(env, name):
    """``init.vary.beside`` 1: every start is 0.85-1.6 blocks from one trunk's centre, looking at it within 20
    degrees of yaw, and that trunk has lost its eye-level log (y 10), as the first chop leaves it; the
    seed fixes which trunk and where. mine_log's second log starts there, and so do the crafts after it."""
    from histeve_jax.envs.base import wrap_degrees, yaw_pitch_to

    task = load_task(name).varied(beside=1.0)
    trunks = [(t["pos"][0], t["pos"][2]) for t in task.init["trees"]]
    with randomized(env):
        starts = [env.reset(seed=s, options={"task": task})[1] for s in (40, 41, 42, 40)]
    beside = []
    for info in starts:
        x, _, z = info["pos"]
        near = [max(abs(x - tx), abs(z - tz)) for tx, tz in trunks]
        k = int(np.argmin(near))
        assert 0.8 <= near[k] <= 1.65 and sorted(near)[1] > 2, info["pos"]
        tx, tz = trunks[k]
        logs = {tuple(p) for n, p in info["nearby"] if n == "default:tree"}
        assert (tx, 10, tz) not in logs and (tx, 9, tz) in logs and (tx, 11, tz) in logs, sorted(logs)
        yaw = yaw_pitch_to((x, 10.0, z), (tx, 10.0, tz))[0]
        assert abs(wrap_degrees(info["yaw"] - yaw)) <= 21, (info["yaw"], yaw)
        beside.append((k, info["pos"]))
    assert beside[0] == beside[3] and beside[0] != beside[1]


def test_a_start_against_a_trunk_faces_it_level_or_up_into_its_gap_and_the_expert_chops_there(env):
    """``init.vary.against`` 1: every start is pressed against a face of one trunk (0.82 blocks from its
    centre, max-norm), facing it within 15 degrees; an intact trunk is seen level (bark fills the view), one
    without its eye-level log from 20-45 degrees under it; the seed fixes it. The expert gets a log there."""
    from histeve_jax.envs.base import wrap_degrees, yaw_pitch_to

    task = load_task("mine_log").varied(against=1.0)
    trunks = [(t["pos"][0], t["pos"][2]) for t in task.init["trees"]]
    with randomized(env):
        starts = [env.reset(seed=s, options={"task": task})[1] for s in (60, 61, 62, 63, 64, 60)]
        expert = expert_for(task)
        expert.reset(info := starts[-1])
        for _ in range(200):
            _, _, _, _, info = env.step(expert.act(info)[0])
            if info["success"]:
                break
    seen = []
    for start in starts:
        x, _, z = start["pos"]
        near = [max(abs(x - tx), abs(z - tz)) for tx, tz in trunks]
        k = int(np.argmin(near))
        tx, tz = trunks[k]
        assert 0.8 <= near[k] <= 0.85 and min(abs(x - tx), abs(z - tz)) <= 0.36, start["pos"]
        face = (tx + round(x - tx), tz + round(z - tz))  # the cell the player stands in, beside the face
        square = yaw_pitch_to((face[0], 10.0, face[1]), (tx, 10.0, tz))[0]
        assert abs(wrap_degrees(start["yaw"] - square)) <= 15.5, (start["yaw"], square)
        logs = {tuple(p) for n, p in start["nearby"] if n == "default:tree"}
        chopped = (tx, 10, tz) not in logs
        assert (-45.5 <= start["pitch"] <= -19.5) if chopped else (-20.5 <= start["pitch"] <= 20.5), start
        seen.append((k, tuple(start["pos"]), chopped))
    assert seen[0] == seen[-1] and {c for _, _, c in seen} == {True, False}, seen
    assert info["success"] and info["inventory"].get("default:tree", 0) >= 1, info["inventory"]


def test_a_far_start_lies_away_from_every_trunk_and_the_expert_walks_to_a_log(env):
    """``init.vary.far`` 1: every start lies in the arena at least FAR_FROM_TREES blocks from each trunk's
    centre (where the harness's teleports leave the player), the look the seed drew kept; the seed fixes it,
    and the trees stand as the task's other draws left them. The expert walks to a trunk and gets a log."""
    from histeve_jax.envs.tasks import FAR_FROM_TREES

    task = load_task("mine_log").varied(far=1.0)
    plain = load_task("mine_log")
    trunks = [(t["pos"][0], t["pos"][2]) for t in task.init["trees"]]
    with randomized(env):
        starts = [env.reset(seed=s, options={"task": task})[1] for s in (70, 71, 72, 70)]
        looks = [env.reset(seed=s, options={"task": plain})[1] for s in (70, 71)]
        expert = expert_for(task)
        expert.reset(info := env.reset(seed=71, options={"task": task})[1])
        walked = 0.0
        for _ in range(400):
            last = info["pos"]
            _, _, _, _, info = env.step(expert.act(info)[0])
            walked += float(np.hypot(info["pos"][0] - last[0], info["pos"][2] - last[2]))
            if info["success"]:
                break
    for start in starts:
        x, _, z = start["pos"]
        assert abs(x) <= 10.6 and abs(z) <= 10.6, start["pos"]
        assert min(np.hypot(x - tx, z - tz) for tx, tz in trunks) >= FAR_FROM_TREES - 0.05, start["pos"]
    assert starts[0]["pos"] == starts[3]["pos"] and starts[0]["pos"] != starts[1]["pos"]
    for start, look in zip(starts[:2], looks, strict=True):  # the yaw and pitch the plain start drew
        turned = abs(base.wrap_degrees(start["yaw"] - look["yaw"]))
        assert turned < 0.5 and abs(start["pitch"] - look["pitch"]) < 0.5, (start, look)
    assert info["success"] and info["inventory"].get("default:tree", 0) >= 1, info["inventory"]
    assert walked >= FAR_FROM_TREES - 3.0, walked  # it walked to the trunk (reach ~3.6 blocks)


def test_a_dug_start_holds_its_digs_and_the_expert_digs_beside_them(env):
    """``init.vary.dug`` 1: every start is where one or two earlier digs left a policy that digs what its
    crosshair is on (dirt_wall's second and third mine_dirt): looking 25-45 degrees down, the ground nodes
    along the view gone, as many dirt held; the seed fixes it. mine_dirt's success counts this episode's
    pickups, so the start is not done, and the atomic expert digs one more grass top, not down the hole."""
    from histeve_jax.envs.base import wrap_degrees, yaw_pitch_to

    task = load_task("mine_dirt").varied(dug=1.0)
    with randomized(env):
        starts = [env.reset(seed=s, options={"task": task})[1] for s in (50, 51, 52, 53, 50)]
        expert = expert_for(task)
        expert.reset(info := starts[-1])
        for _ in range(120):
            _, _, _, _, info = env.step(expert.act(info)[0])
            if info["success"]:
                break
        for _ in range(10):  # the mod lists the nodes nearby every 4th server step (0.2 s)
            _, _, _, _, info = env.step(noop_action())

    def grass(i, at):  # the grass tops within 2 blocks (max-norm) of cell `at`: all of them are among the
        # mod's 24 nearest of a kind when the player stands on `at`
        return {(p[0], p[2]) for n, p in i["nearby"] if n == "default:dirt_with_grass" and p[1] == 8
                and max(abs(p[0] - at[0]), abs(p[2] - at[1])) <= 2}

    cells = []
    for start in starts:
        held = start["inventory"].get("default:dirt", 0)
        assert held in (1, 2) and not start["success"] and not start["pickup"], start["inventory"]
        assert 25 - 1 <= start["pitch"] <= 45 + 1, start["pitch"]
        x, _, z = start["pos"]
        at = (round(x), round(z))
        gone = {(at[0] + i, at[1] + j) for i in range(-2, 3) for j in range(-2, 3)} - grass(start, at)
        assert 1 <= len(gone) <= held, gone
        for cx, cz in gone:  # on the line of sight
            yaw = yaw_pitch_to((x, 0, z), (cx, 0, cz))[0]
            assert abs(wrap_degrees(yaw - start["yaw"])) < 25, (gone, start)
        cells.append((held, gone, at))
    assert cells[0] == cells[4] and {h for h, _, _ in cells} == {1, 2}, cells
    held, gone, at = cells[4]
    assert info["success"] and info["pickup"] == {"default:dirt": 1}, info["pickup"]
    assert info["inventory"]["default:dirt"] == held + 1
    assert len(grass(info, at)) == 25 - len(gone) - 1  # a grass top, not a node under the holes


def test_the_inventory_looks_the_same_from_every_start(env):
    """The GUI backdrop is opaque (``gui_backdrop="opaque"``, the default): two craft_planks starts that
    look different show the same inventory frame, pointer and all."""
    with randomized(env):
        world, gui = [], []
        for seed in (20, 21):
            obs, info = env.reset(seed=seed, options={"task": "craft_planks"})
            world.append(obs["image"].astype(np.int16))
            env.step(_act(inventory=1))
            obs, _, _, _, info = env.step(noop_action())
            assert info["is_gui_open"]
            gui.append(obs["image"].astype(np.int16))
    assert np.abs(world[0] - world[1]).mean() > 10.0
    assert np.abs(gui[0] - gui[1]).mean() < 1.0


def test_killing_the_game_raises_and_the_next_reset_recovers(env):
    env.reset(options={"task": "mine_log"})
    game_pid, xvfb_pid = env.pids()
    starts = env.starts
    os.kill(game_pid, signal.SIGKILL)
    with pytest.raises(GameCrashed, match="minetest exited"):
        for _ in range(40):
            env.step(noop_action())
    assert not _exists(game_pid) and not _exists(xvfb_pid), "crashed instance not stopped and reaped"
    obs, info = env.reset(options={"task": "mine_log"})
    assert env.starts == starts + 1 and env.pids()[0] != game_pid
    _, _, _, _, info = env.step(_act(forward=1))
    assert info["pos"][1] == pytest.approx(8.5, abs=0.05)
    # the display going away is a crash too
    game_pid, xvfb_pid = env.pids()
    os.kill(xvfb_pid, signal.SIGKILL)
    with pytest.raises(GameCrashed):
        for _ in range(40):
            env.step(noop_action())
    assert not _exists(game_pid) and not _exists(xvfb_pid)
    env.reset(options={"task": "mine_log"})
    assert env.starts == starts + 2


def test_a_hung_game_raises_gamehung(env):
    env.reset(options={"task": "mine_log"})
    game_pid, _ = env.pids()
    os.kill(game_pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(GameHung):
        while time.monotonic() - t0 < 30:
            env.step(noop_action())
    assert not _exists(game_pid)
    env.reset(options={"task": "mine_log"})
    assert env.pids() and env.pids()[0] != game_pid


def test_close_leaves_no_processes_or_zombies():
    e = make("luanti", obs_size=(36, 64))
    e.reset(options={"task": "place_dirt"})
    pids = e.pids()
    root = e.proc.root
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    e.close()
    assert not any(_exists(p) for p in pids), "processes or zombies left after close()"
    assert not root.exists()


def test_a_failed_start_stops_the_instance_and_the_next_reset_starts_afresh(monkeypatch):
    from Xlib.error import DisplayConnectionError

    import histeve_jax.envs.luanti.env as env_mod

    started = []

    class Recorded(env_mod.LuantiProcess):
        def __init__(self, **kw):
            super().__init__(**kw)
            started.append(self)

    def no_display(name):
        raise DisplayConnectionError(name, "refused")

    real_xinput = env_mod.XInput
    monkeypatch.setattr(env_mod, "LuantiProcess", Recorded)
    monkeypatch.setattr(env_mod, "XInput", no_display)
    e = make("luanti", obs_size=(36, 64))
    try:
        with pytest.raises(GameCrashed, match="did not start"):
            e.reset(options={"task": "place_dirt"})
        assert e.proc is None and len(started) == 1
        assert not started[0].root.exists() and not started[0].pids()
        monkeypatch.setattr(env_mod, "XInput", real_xinput)
        _, info = e.reset(options={"task": "place_dirt"})
        assert e.starts == 2 and info["pos"][1] == pytest.approx(8.5, abs=0.05)
    finally:
        e.close()
