"""LuantiEnv: the env-format interface over a real minetest client under Xvfb.

Input goes through XTest, frames come from the Xvfb screen through mss, privileged state comes from the
histeve_bridge mod's JSON file. Steps are paced to 50 ms of wall time because the client runs in real time.

GUI state: the server is not told when the client opens its inventory or a furnace, so ``is_gui_open`` is read
from the frame itself: the crosshair (white pixels in the centre) is drawn in play and hidden under every
formspec. ``cursor`` is the X pointer position while a GUI is open (in play minetest re-centres the pointer
every frame). The grabbed frame does not show the pointer (the X server draws it apart), so observations
get an arrow drawn at ``cursor`` (``envs.cursor``, ``cursor_scale`` times the 16 px sprite, over magenta
guide lines ``cursor_lines`` px wide through its tip across the frame, which stop ``cursor_gap`` px short of
the tip, and with ``cursor_previous`` the same lines in cyan through where the pointer was a step before, so a
frame shows whether the pointer has just moved; ``show_cursor=False`` leaves the frame as grabbed).

Timing: within a step the keys and buttons change first, then the mouse moves (in play, once the client has
re-centred the pointer after the last motion, see ``_await_centre``); the frame is grabbed 50 ms after the
previous one. A reset returns once the client itself reports the start pose (``_settle_start``). The
client applies input at its next rendered frame (fps_max 30) and the formspec reads the pointer once per
frame, so a GUI click is held back until 0.1 s after the last pointer motion, and a motion 0.1 s after a
release in the same step (the step then takes longer than 50 ms): a one-step click in the step after the
move lands, and is let go, where the pointer is. A step that presses the inventory key returns the first
frame that shows the GUI opened or closed (up to ``gui_sync_s``), and a step that clicks in a GUI the first
frame that differs from the one before the press (up to 0.3 s), as a tick-synchronous game (MineRL) shows
an action's effect in the next observation. Measured here: the inventory showed one step after the press
on a quiet machine and five steps after it with two games recording on 2 cores; a click changed the frame
45-150 ms after the press, after the step's grab. A frame that does not yet show an action looks like the
frame before it, so demonstrations held the same frame labelled with the action and with what follows it,
and a policy pressed again (closing the GUI it had opened). The privileged state lags the
frame by about one server step (50 ms); under CPU load both lags grow.

Determinism: the world is minetest_game on the flat mapgen at a fixed seed, the arena is rebuilt at every
reset (see arena.py), time does not pass (time_speed 0, noon), clouds are off (minetest_game's weather only
changes clouds), minetest_game has no mobs, and dropped items are cleared.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import mss
import numpy as np
from gymnasium import spaces
from mss.exception import ScreenShotError
from PIL import Image
from Xlib.error import ConnectionClosedError, DisplayError, XError

from histeve_jax.actions.codebook import BUTTONS, CAMERA
from histeve_jax.envs.base import (
    EVENT_KEYS,
    EYE_HEIGHT,
    PIXELS_PER_DEGREE,
    RENDER_SIZE,
    STEP_SECONDS,
    inventory_counts,
    slot_list,
    validate_action,
    wrap_degrees,
    yaw_pitch_to,
)
from histeve_jax.envs.cursor import draw_cursor
from histeve_jax.envs.luanti.arena import ARENA_RADIUS, DEFAULT_POS, EYE_LOG, GROUND_Y, reset_ops
from histeve_jax.envs.luanti.process import GameCrashed, GameError, GameHung, LuantiProcess
from histeve_jax.envs.luanti.xinput import BUTTONS as MOUSE_BUTTONS
from histeve_jax.envs.luanti.xinput import XInput
from histeve_jax.envs.tasks import DEFAULT_VARY, FAR_FROM_TREES, Task, clutter_inventory, load_task

# What a vanished X server or world directory raises from Xlib, mss or the file system (TimeoutError, from a
# window that never appears, is an OSError).
_LOST = (OSError, ConnectionError, ConnectionClosedError, XError, DisplayError, ScreenShotError)

# Per-event pointer motion limits in play: the pointer sits at the centre (320, 180) and the X server clamps
# it to the screen, so larger motions are split across frames.
_MAX_DX, _MAX_DY = 300, 170
_NUDGE_PX = 20  # the pointer motion that confirms the client took the reset's look (3 degrees)
# A GUI click waits until this long after the last pointer motion, and a motion this long after a release
# in the same step: the formspec takes the slot under the pointer from its last drawn frame, and under load
# a client draws less often than every 50 ms step.
_CLICK_AFTER_MOVE_S = 0.1
_GRAB_POLL_S = 0.01  # between grabs while a step waits for the frame to show a GUI action
_CHANGED = 30  # a pixel value difference that counts as the frame having changed
# A click's frame changed 45-150 ms after the press here; a click on nothing changes nothing, and waiting the
# inventory key's full gui_sync_s for it made a random agent's GUI episodes several times longer.
_CLICK_SYNC_S = 0.3


def crosshair_visible(frame: np.ndarray) -> bool:
    """True if minetest's white crosshair is drawn at the centre of a 360x640 render (i.e. no GUI open)."""
    h, w = frame.shape[:2]
    cy, cx = h // 2, w // 2
    vert = frame[cy - 8:cy + 9, cx]
    horiz = frame[cy, cx - 8:cx + 9]
    return bool((vert >= 250).all() and (horiz >= 250).all())


def _clear_of(x: float, z: float, trunks: list[tuple[float, float]], margin: float = 1.0) -> bool:
    """Whether a player at (x, z) stands ``margin`` blocks (max-norm, centre to centre) from every trunk: 1.0
    is clear of it (+-0.5 node, +-0.3 player, a margin), 0.85 right against it."""
    return all(max(abs(x - tx), abs(z - tz)) >= margin for tx, tz in trunks)


_REACH = 3.9  # a little under the hand's 4-node range (the experts' REACH is 3.6)


class LuantiEnv(gym.Env):
    """Luanti (minetest 5.6) as a gymnasium env with MineStudio's action and info formats (see base.py)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(
        self,
        obs_size: tuple[int, int] = (224, 224),
        *,
        task: str | Task = "mine_log",
        fps_max: int = 30,
        viewing_range: int = 40,
        map_seed: int = 20240613,
        realtime: bool = True,
        hang_timeout_s: float = 10.0,
        startup_timeout_s: float = 90.0,
        terminate_on_success: bool = True,
        randomize_init: bool = False,
        show_cursor: bool = True,
        cursor_scale: int = 1,
        cursor_lines: int = 7,
        cursor_gap: int = 14,
        cursor_previous: bool = True,
        gui_sync_s: float = 1.0,
        gui_backdrop: str = "opaque",
    ):
        if len(obs_size) != 2 or min(obs_size) < 1:
            raise ValueError(f"obs_size must be (H, W) with positive sizes, got {obs_size}")
        self.obs_size = (int(obs_size[0]), int(obs_size[1]))
        self.task = load_task(task) if isinstance(task, str) else task
        self.fps_max = fps_max
        self.viewing_range = viewing_range
        self.map_seed = map_seed
        self.realtime = realtime
        self.hang_timeout_s = hang_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.terminate_on_success = terminate_on_success
        self.randomize_init = randomize_init
        self.show_cursor = show_cursor
        self.cursor_scale = int(cursor_scale)
        self.cursor_lines = int(cursor_lines)  # 7 px at 640x360: 2 px of a 112x196 observation
        self.cursor_gap = int(cursor_gap)  # lines stop 14 px from the tip: the slot under it stays visible
        self.cursor_previous = bool(cursor_previous)  # cyan lines through last step's pointer (envs.cursor)
        self._last_cursor: tuple[float, float] | None = None  # the pointer of the last observation
        self.gui_sync_s = float(gui_sync_s)  # 0: return the frame 50 ms after the press, whatever it shows
        if gui_backdrop not in ("opaque", "game"):
            raise ValueError(f"gui_backdrop must be 'opaque' or 'game', got {gui_backdrop!r}")
        # "opaque": the world behind a GUI is not drawn (the client dims it to 45% by default), so an
        # inventory frame is the same wherever the player stood and looked when it opened; "game": the
        # game's own translucent backdrop. A client setting: it takes effect when the game (re)starts.
        self.gui_backdrop = gui_backdrop
        self.episode_task = self.task
        self.observation_space = spaces.Dict(
            {"image": spaces.Box(0, 255, (*self.obs_size, 3), dtype=np.uint8)})
        self.action_space = spaces.Dict(
            {**{k: spaces.Discrete(2) for k in BUTTONS},
             CAMERA: spaces.Box(-180.0, 180.0, (2,), dtype=np.float32)})
        self.proc: LuantiProcess | None = None
        self.x: XInput | None = None
        self._grabber = None
        self._held: dict[str, int] = {}
        self._residual = np.zeros(2)  # sub-pixel motion carried to the next step, [dy, dx]
        self._moved_at = 0.0  # time of the last pointer motion in a GUI
        self._cmd_id = 0
        self._steps = 0
        self._last_t = 0.0
        self._state: dict[str, Any] = {}
        self._state_tick = -1
        self._state_changed_t = 0.0
        self._succeeded = False
        self._frame = np.zeros((*RENDER_SIZE, 3), np.uint8)
        self.starts = 0  # how many game instances this env has started (restarts after crashes count)

    # ---------------------------------------------------------------- process lifecycle

    def _start(self) -> None:
        backdrop = {"formspec_fullscreen_bg_opacity": "255"} if self.gui_backdrop == "opaque" else {}
        self.proc = LuantiProcess(fps_max=self.fps_max, viewing_range=self.viewing_range,
                                  map_seed=self.map_seed, startup_timeout_s=self.startup_timeout_s,
                                  extra_config=backdrop)
        self.starts += 1
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.proc.state_path.exists():
            self.proc.check_alive()
            if time.monotonic() > deadline:
                raise GameHung(f"no state from the game within {self.startup_timeout_s:.0f} s; "
                               f"log: {self.proc.log_tail()}")
            time.sleep(0.1)
        with self.proc.x_auth():  # the display admits only clients with this instance's cookie
            self.x = XInput(self.proc.display)
            self._grabber = mss.MSS(display=self.proc.display)
        self.x.find_window(timeout_s=max(1.0, deadline - time.monotonic()), alive=self.proc.check_alive)
        from Xlib import X
        # Autorepeat would turn a held inventory key into a stream of toggles.
        self.x.d.change_keyboard_control(auto_repeat_mode=X.AutoRepeatModeOff)
        self._held = {}
        time.sleep(0.5)
        self.x.tap_f2()  # hide the chat overlay ("agent joined the game")
        time.sleep(3.0)  # the "Chat hidden" notice fades before the first frame is taken
        self._state_changed_t = time.monotonic()

    def _shutdown(self) -> None:
        if self._grabber is not None:
            try:
                self._grabber.close()
            except Exception:  # noqa: BLE001 (the display may be gone already)
                pass
            self._grabber = None
        if self.x is not None:
            self.x.close()
            self.x = None
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def close(self) -> None:
        """Stop the game and its display (by pid) and remove the temp world."""
        self._shutdown()

    def _fail(self, err: GameError) -> GameError:
        # Any game failure tears the instance down; the next reset starts a fresh one.
        self._shutdown()
        return err

    def pids(self) -> list[int]:
        """Pids of the running game and Xvfb processes (empty when none is running)."""
        return self.proc.pids() if self.proc is not None else []

    # ---------------------------------------------------------------- state and commands

    def _read_state(self) -> dict[str, Any]:
        path = self.proc.state_path
        for _ in range(5):
            try:
                state = json.loads(path.read_text())
                break
            except (OSError, json.JSONDecodeError):
                time.sleep(0.005)  # the rename keeps the file whole; this only covers odd filesystems
        else:
            state = self._state
        now = time.monotonic()
        if state.get("tick") != self._state_tick:
            self._state_tick = state.get("tick")
            self._state_changed_t = now
        elif now - self._state_changed_t > self.hang_timeout_s:
            raise self._fail(GameHung(f"the game's state has not changed for {self.hang_timeout_s:.0f} s "
                                      f"(tick {self._state_tick})"))
        self._state = state
        return state

    def _check(self) -> None:
        try:
            self.proc.check_alive()
        except GameCrashed as e:
            raise self._fail(e) from None

    def command(self, ops: list[dict[str, Any]], timeout_s: float = 30.0) -> dict[str, Any]:
        """Run mod commands (see the mod's `ops`) and wait until the mod has executed them all."""
        self._cmd_id += 1
        cmd_path: Path = self.proc.command_path
        deadline = time.monotonic() + timeout_s
        while cmd_path.exists():  # the mod has not consumed the previous command yet
            self._check()
            if time.monotonic() > deadline:
                raise self._fail(GameHung("the mod did not read its command file"))
            time.sleep(0.01)
        tmp = cmd_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self._cmd_id, "ops": ops}))
        os.replace(tmp, cmd_path)
        while True:
            self._check()
            state = self._read_state()
            if int(state.get("acked_cmd", -1)) == self._cmd_id:
                errors = state.get("errors") or []
                if errors:
                    raise RuntimeError(f"mod command {self._cmd_id} failed: {errors}")
                return state
            if time.monotonic() > deadline:
                # a command file the mod could not parse is never acked; its reason is in `errors`
                raise self._fail(GameHung(f"mod command {self._cmd_id} not done within {timeout_s:.0f} s "
                                          f"(mod errors: {state.get('errors') or 'none'})"))
            time.sleep(0.01)

    # ---------------------------------------------------------------- input

    def _set_held(self, name: str, down: int) -> None:
        if self._held.get(name, 0) == down:
            return
        if name in MOUSE_BUTTONS:
            self.x.button(name, bool(down))
        else:
            self.x.key(name, bool(down))
        self._held[name] = down

    def _tap(self, name: str) -> None:
        """Press and release a key outside the step's held keys (resets)."""
        self.x.key(name, True)
        self.x.sync()
        time.sleep(0.05)
        self.x.key(name, False)
        self.x.sync()

    def _release_all(self) -> None:
        for name in list(self._held):
            self._set_held(name, 0)
        self.x.sync()

    def _move(self, dpitch: float, dyaw: float, gui: bool) -> None:
        want = np.array([dpitch, dyaw]) * PIXELS_PER_DEGREE + self._residual
        px = np.round(want)
        self._residual = want - px
        dy, dx = int(px[0]), int(px[1])
        if gui:
            if dx or dy:
                self.x.move(dx, dy)  # the pointer is free in a GUI; X clamps it to the screen
                self._moved_at = time.monotonic()
            return
        while dx or dy:
            sx, sy = max(-_MAX_DX, min(_MAX_DX, dx)), max(-_MAX_DY, min(_MAX_DY, dy))
            self._await_centre()
            self.x.move(sx, sy)
            dx, dy = dx - sx, dy - sy
            if dx or dy:
                self.x.sync()

    def _await_frame(self, shows: Any, timeout_s: float | None = None) -> None:
        """Grab until ``shows(frame)`` holds or ``timeout_s`` (default ``gui_sync_s``) passes (a press the
        client swallowed, or a click on nothing, changes nothing: the step returns what it has); the next
        step's pacing starts from here."""
        deadline = time.monotonic() + (self.gui_sync_s if timeout_s is None else timeout_s)
        while not shows(self._frame) and time.monotonic() < deadline:
            time.sleep(_GRAB_POLL_S)
            self._grab()
        self._last_t = max(self._last_t, time.monotonic() - STEP_SECONDS)

    def _centred(self) -> bool:
        return self.x.pointer() == (RENDER_SIZE[1] // 2, RENDER_SIZE[0] // 2)

    def _await_centre(self, timeout_s: float = 0.5) -> None:
        """In play, wait (up to timeout_s) until the client has taken the last motion and re-centred.

        Each frame the client reads the pointer and, if it is off centre, warps it back there: a motion that
        lands between that read and that warp is lost whole (measured under CPU load: 10-degree turns gone,
        and motions piled up past the screen edge clipped). Off centre means a read and warp are still to
        come, so the next motion waits for them; at centre the client warps nothing, so no motion is lost.
        """
        deadline = time.monotonic() + timeout_s
        while not self._centred() and time.monotonic() < deadline:
            time.sleep(0.002)

    # ---------------------------------------------------------------- observation

    def _grab(self) -> np.ndarray:
        shot = self._grabber.grab(self._grabber.monitors[0])
        bgra = np.frombuffer(shot.raw, np.uint8).reshape(shot.height, shot.width, 4)
        self._frame = np.ascontiguousarray(bgra[:, :, 2::-1])
        return self._frame

    def _obs(self, info: dict[str, Any]) -> dict[str, np.ndarray]:
        h, w = self.obs_size
        previous, self._last_cursor = self._last_cursor, info["cursor"]
        img = draw_cursor(self._frame, info["cursor"], self.cursor_scale, self.cursor_lines, self.cursor_gap,
                          previous if self.cursor_previous else None) if self.show_cursor else self._frame
        if (h, w) != img.shape[:2]:
            img = np.asarray(Image.fromarray(img).resize((w, h), Image.BILINEAR))
        return {"image": img}

    def render(self) -> np.ndarray:
        """The last full-size 360x640 frame, as grabbed (without the drawn cursor)."""
        return self._frame

    def _info(self, state: dict[str, Any]) -> dict[str, Any]:
        main = state.get("main") or {}
        craft = state.get("craft") or {}
        slots = slot_list(main.get("names") or [], [int(c) for c in (main.get("counts") or [])])
        gui = not crosshair_visible(self._frame)
        events = state.get("events") or {}
        info = {
            "inventory": inventory_counts(slots),
            "hotbar": slots[:9],
            "inventory_slots": slots,
            "held_slot": int(state.get("wield_index", 1)),
            "is_gui_open": gui,
            "cursor": self.x.pointer() if gui else None,
            "pos": tuple(float(v) for v in state.get("pos", (0.0, 0.0, 0.0))),
            "yaw": float(state.get("yaw", 0.0)),
            "pitch": float(state.get("pitch", 0.0)),
            "health": float(state.get("hp", 0.0)),
            **{k: {n: int(c) for n, c in (events.get(k) or {}).items()} for k in EVENT_KEYS},
            "nearby": [(n["name"], tuple(n["pos"])) for n in (state.get("nearby") or [])],
            "craft_grid": slot_list(craft.get("names") or [], [int(c) for c in (craft.get("counts") or [])]),
            "tick": int(state.get("tick", 0)),
            "task": self.task.name,
            "steps": self._steps,
        }
        info["success"] = self.task.is_success(info)
        info["subgoals_done"] = self.task.subgoals_done(info)
        return info

    # ---------------------------------------------------------------- gym API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Restore the task's initial state (same world, teleport, look, time, inventory; no mobs or weather).

        options: {"task": name or Task}. A dead or hung game is restarted here. The world is fixed, so two
        resets of a task give the same state; with ``randomize_init`` the start position and look are drawn
        from the seed within the task's ``init.vary`` (default +-0.25 blocks, +-15 degrees of yaw; never
        inside a trunk; ``gap``: each tree's chance to start without its eye-level log), so (seed, task)
        still fixes the initial state.
        """
        super().reset(seed=seed)
        options = options or {}
        if "task" in options:
            t = options["task"]
            self.task = load_task(t) if isinstance(t, str) else t
        self.episode_task = self.task
        if self.randomize_init:
            init = dict(self.task.init)
            vary = init.get("vary", DEFAULT_VARY)
            x, y, z = init.get("pos", DEFAULT_POS)
            trunks = [(t["pos"][0], t["pos"][2]) for t in init.get("trees") or []]
            for _ in range(100):  # never inside (or rubbing) a trunk: +-0.5 node, +-0.3 player, a margin
                dx, dz = self.np_random.uniform(-vary["pos"], vary["pos"], size=2)
                if _clear_of(x + dx, z + dz, trunks):
                    break
            else:
                raise ValueError(f"task {self.task.name}: no start within init.vary.pos={vary['pos']} of "
                                 f"{init.get('pos', DEFAULT_POS)} clears its trees")
            init["pos"] = [float(x + dx), float(y), float(z + dz)]
            init["yaw"] = float(init.get("yaw", 0.0) + self.np_random.uniform(-vary["yaw"], vary["yaw"]))
            if vary["pitch"]:  # drawn only where asked: the other tasks' starts stay what their seeds gave
                pitch = init.get("pitch", 0.0) + self.np_random.uniform(-vary["pitch"], vary["pitch"])
                init["pitch"] = float(np.clip(pitch, -89.5, 89.5))
            gone = np.zeros(len(trunks), bool)
            if vary["gap"]:  # some trunks start with their eye-level log dug, as a chop leaves them
                gone = self.np_random.random(len(trunks)) < vary["gap"]
            # Drawn last and only where asked, so every other start of a seed stays what it was.
            if vary["beside"] and trunks and self.np_random.random() < vary["beside"]:
                k = int(self.np_random.integers(len(trunks)))
                init["pos"], init["yaw"] = self._beside(trunks, k, y)
                gone[k] = True
            if vary["clutter"] and self.np_random.random() < vary["clutter"]:  # drawn last, as beside
                init["inventory"] = clutter_inventory(init.get("inventory") or [], self.np_random)
            if vary["dug"] and self.np_random.random() < vary["dug"]:  # drawn last, as clutter
                init.update(self._dug(init))
            if vary["against"] and trunks and self.np_random.random() < vary["against"]:  # drawn last, as dug
                k = int(self.np_random.integers(len(trunks)))
                init["pos"], init["yaw"], init["pitch"], gone[k] = self._against(trunks, k, y)
            if vary["far"] and trunks and self.np_random.random() < vary["far"]:  # drawn last, as against
                init["pos"] = self._far(trunks, y)
            if gone.any():
                init["nodes"] = list(init.get("nodes") or []) + [
                    {"pos": [int(t["pos"][0]), int(t["pos"][1]) + EYE_LOG, int(t["pos"][2])], "name": "air"}
                    for t, g in zip(init.get("trees") or [], gone, strict=True) if g]
            self.episode_task = dataclasses.replace(self.task, init=init)
        if self.proc is not None:
            try:
                self.proc.check_alive()
            except GameCrashed:
                self._shutdown()
        if self.proc is None:
            try:
                self._start()
            except GameError:
                self._shutdown()
                raise
            except _LOST as e:  # no window, no X connection: a failed start (else the half-started
                # instance would stay in self.proc and the next reset would use its missing X connection)
                self._shutdown()
                raise GameCrashed(f"the game did not start: {e}") from e
        try:
            return self._reset_in_game()
        except _LOST as e:  # the X connection or the world dir vanished
            raise self._fail(GameCrashed(f"the game went away during reset: {e}")) from e

    def _beside(self, trunks: list[tuple[float, float]], k: int, y: float) -> tuple[list[float], float]:
        """A start 0.85-1.6 blocks (max-norm, clear of the other trunks) from trunk ``k``'s centre, yawed
        at its eye-level log within +-20 degrees: ``init.vary.beside``'s, where a chop leaves the player."""
        tx, tz = trunks[k]
        for _ in range(100):
            angle, r = self.np_random.uniform(0, 2 * np.pi), self.np_random.uniform(0.85, 1.6)
            x, z = tx + r * np.sin(angle), tz + r * np.cos(angle)
            if _clear_of(x, z, [trunks[k]], 0.85) and _clear_of(x, z, trunks[:k] + trunks[k + 1:]):
                break
        else:
            raise ValueError(f"task {self.task.name}: no start beside trunk {trunks[k]} clears the others")
        yaw, _ = yaw_pitch_to((x, y, z), (tx, y, tz))  # level: only the yaw is kept
        return [float(x), float(y), float(z)], float(yaw + self.np_random.uniform(-20, 20))

    def _against(self, trunks: list[tuple[float, float]], k: int,
                 y: float) -> tuple[list[float], float, float, bool]:
        """(pos, yaw, pitch, chopped): ``init.vary.against``'s start, pressed against a face of trunk ``k``
        (0.82 blocks from its centre, +-0.35 along the face, clear of the other trunks), facing it within
        +-15 degrees. Where a policy that walked on into a trunk stands: half the time the trunk is intact
        and the look level (+-20 degrees: bark fills the view; wooden_pickaxe's first ``mine_log`` held
        forward there for its whole budget), half the time its eye-level log is gone and the look 20-45
        degrees up into the gap (the view after a chop; an injected failure that took that log left a
        policy attacking the leaves beyond it)."""
        tx, tz = trunks[k]
        for _ in range(100):
            side = int(self.np_random.integers(4))
            along = float(self.np_random.uniform(-0.35, 0.35))
            nx, nz = ((1, 0), (-1, 0), (0, 1), (0, -1))[side]
            x, z = tx + 0.82 * nx + along * nz, tz + 0.82 * nz + along * nx
            if _clear_of(x, z, trunks[:k] + trunks[k + 1:]):
                break
        else:
            raise ValueError(f"task {self.task.name}: no start against trunk {trunks[k]} clears the others")
        yaw, _ = yaw_pitch_to((tx + nx, y, tz + nz), (tx, y, tz))  # square to the face
        chopped = bool(self.np_random.random() < 0.5)
        pitch = self.np_random.uniform(-45.0, -20.0) if chopped else self.np_random.uniform(-20.0, 20.0)
        yaw = float(yaw + self.np_random.uniform(-15, 15))
        return [float(x), float(y), float(z)], yaw, float(pitch), chopped

    def _far(self, trunks: list[tuple[float, float]], y: float) -> list[float]:
        """``init.vary.far``'s start: anywhere in the arena (1.5 blocks inside its edge) at least
        ``FAR_FROM_TREES`` blocks from every trunk's centre, the look the seed drew for the task's own start
        kept. Where the harness's teleports (``harness.inject.OPEN_SPOTS``) and a policy that wandered off
        leave the player: mine_log's own starts lie mostly within a few blocks of a trunk."""
        edge = ARENA_RADIUS - 1.5
        for _ in range(1000):
            x, z = self.np_random.uniform(-edge, edge, size=2)
            if all(np.hypot(x - tx, z - tz) >= FAR_FROM_TREES for tx, tz in trunks):
                return [float(x), float(y), float(z)]
        raise ValueError(f"task {self.task.name}: init.vary.far: no start in the arena is {FAR_FROM_TREES} "
                         f"blocks from every trunk of {trunks}")

    def _dug(self, init: dict[str, Any]) -> dict[str, Any]:
        """``init.vary.dug``'s start (changes to ``init``): where one or two earlier digs left the player. A
        policy digs what its crosshair is on and holds the look: pitched 25-45 degrees down at the drawn yaw,
        the ground node the view ray hits is dug, and for two digs the next node the ray then hits (within
        the hand's reach), as many dirt held on slot 1, the look kept. The view then falls on the node after
        those, often out of reach: dirt_wall's third ``mine_dirt`` held attack there for its whole budget
        (README "The third dig"). ``pickup`` counts only this episode's digs, so mine_dirt is not done at
        the start."""
        x, y, z = init["pos"]
        eye = np.array([x, y + EYE_HEIGHT, z])
        k = int(self.np_random.integers(1, 3))
        for _ in range(100):
            pitch = float(self.np_random.uniform(25.0, 45.0))
            yaw_r, pitch_r = np.radians(init["yaw"]), np.radians(pitch)
            ray = np.array([np.sin(yaw_r) * np.cos(pitch_r), -np.sin(pitch_r),
                            np.cos(yaw_r) * np.cos(pitch_r)])
            dug: list[list[int]] = []
            for t in np.arange(0.0, _REACH, 0.01):  # the ground nodes along the ray, nearest first
                node = [int(v) for v in np.floor(eye + t * ray + 0.5)]
                if node[1] <= GROUND_Y and node not in dug:
                    dug.append(node)
                    if len(dug) == k:
                        break
            if len(dug) == k:
                break
        else:
            raise ValueError(f"task {self.task.name}: init.vary.dug: no look reaches {k} ground nodes")
        return {"pitch": pitch,
                "nodes": list(init.get("nodes") or []) + [{"pos": n, "name": "air"} for n in dug],
                "inventory": list(init.get("inventory") or []) + [
                    {"item": "default:dirt", "count": k, "slot": 1}]}

    def _reset_in_game(self):
        self._release_all()
        time.sleep(0.1)
        self._grab()
        if not crosshair_visible(self._frame):  # a GUI is open: the inventory key closes any formspec
            for _ in range(3):
                self._tap("inventory")
                time.sleep(0.3)
                if crosshair_visible(self._grab()):
                    break
        self.command(reset_ops(self.episode_task), timeout_s=60.0)
        self._settle_start()
        time.sleep(0.25)  # the rebuilt blocks' meshes before the first frame
        self._residual[:] = 0.0
        self._last_cursor = None  # no previous pointer in an episode's first observation
        self._steps = 0
        self._succeeded = False
        self._grab()
        state = self._read_state()
        self._last_t = time.monotonic()
        info = self._info(state)
        return self._obs(info), info

    def _settle_start(self) -> None:
        """Wait until the client itself holds the start pose, confirmed through a round trip.

        The client owns the player's pose: the server's teleport and look reach it a frame or more later,
        and until then it keeps (and reports back) the old ones. Under CPU load that outlasts any fixed wait,
        and a look that lands after the first step overwrites that step's turn (measured with the suite
        beside two games: a branch's s0 still showing the last episode's yaw, a whole 10-degree turn lost).
        So the look is set _NUDGE_PX short of its target and the pointer then moves those pixels: the target
        comes back from the client only once it has applied the look (and the teleport sent before it) and
        then our input. Nothing is sent again while the client may still be on its way (a second look behind
        a pending one would undo the confirmed nudge); only a client that has been still for a while is set
        right: a lost (or doubled) nudge with the opposite motion, a position that momentum from the last
        episode carried off the target (or anything else) with the teleport, look and nudge again.
        """
        init = self.episode_task.init
        target = np.array(init.get("pos", DEFAULT_POS), dtype=float)
        yaw, pitch = float(init.get("yaw", 0.0)), float(init.get("pitch", 0.0))  # the client: |pitch| <= 89.5
        short = [{"op": "set_pos", "pos": target.tolist()},
                 {"op": "set_look", "yaw": yaw - _NUDGE_PX / PIXELS_PER_DEGREE, "pitch": pitch}]

        def send():
            self.command(short)
            self._tap("hotbar.1")
            time.sleep(0.2)  # let the blocks and the teleport arrive before the nudge
            self._await_centre()
            self.x.move(_NUDGE_PX, 0)
            self.x.sync()

        send()
        sends, last, since = 1, None, time.monotonic()
        deadline = since + 40.0
        while (now := time.monotonic()) < deadline:
            state = self._read_state()
            dyaw = wrap_degrees(float(state.get("yaw", 0.0)) - yaw)
            reported = float(state.get("pitch", 0.0))
            dpitch = min(abs(reported - pitch), abs(reported - float(np.clip(pitch, -89.5, 89.5))))
            pos_ok = np.abs(np.array(state["pos"]) - target).max() < 1e-3
            seen = (round(dyaw, 2), round(dpitch, 2), pos_ok, state.get("wield_index"), self._centred())
            if seen != last:
                last, since = seen, now
            still = now - since
            if not seen[-1]:  # a motion the client has not taken yet
                pass
            elif abs(dyaw) < 0.02 and abs(dpitch) < 0.02 and pos_ok and int(state.get("wield_index", 0)) == 1:
                if still >= 0.15:  # and it holds: no momentum left, no late packet
                    return
            elif still >= 1.0:  # the client has taken every motion, is still, and is not at the start
                px = dyaw * PIXELS_PER_DEGREE
                if abs(dpitch) < 0.02 and pos_ok and abs(px - round(px)) < 0.2:
                    self.x.move(-int(round(px)), 0)
                    self.x.sync()
                elif sends < 8:
                    send()
                    sends += 1
                last = None
            time.sleep(0.02)
        raise self._fail(GameHung(f"the client did not take the start pose {target.tolist()}, yaw {yaw:.2f}, "
                                  f"pitch {pitch:.2f} in 40 s (it reports pos {state.get('pos')}, "
                                  f"yaw {state.get('yaw')}, pitch {state.get('pitch')}, "
                                  f"wield {state.get('wield_index')})"))

    def step(self, action: dict[str, Any]):
        """One 50 ms step with an env-format action; returns (obs, reward, terminated, truncated, info).

        reward is 1.0 on the step the task's success check first holds, else 0.0.
        """
        if self.proc is None:
            raise RuntimeError("LuantiEnv.step() before reset() (or after a game error: call reset())")
        a = validate_action(action)
        self._check()
        gui = not crosshair_visible(self._frame)
        toggles = bool(a["inventory"]) and not self._held.get("inventory")
        clicks = gui and any(a[b] and not self._held.get(b) for b in MOUSE_BUTTONS)
        try:
            before = None
            if clicks:
                # a person clicks what the screen shows: a press right after a motion would land on the
                # slot the client drew last, not on the one now under the pointer
                wait = self._moved_at + _CLICK_AFTER_MOVE_S - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if self.gui_sync_s > 0:
                    before = self._grab().copy()
            released = gui and any(self._held.get(b) and not a[b] for b in MOUSE_BUTTONS)
            for name in BUTTONS:
                self._set_held(name, a[name])
            cam = a[CAMERA]
            if released and np.any(cam):
                # and releases before it moves on: a release the client handles after the motion, in the
                # same frame, would drop the stack where the pointer went (a drag)
                self.x.sync()
                time.sleep(_CLICK_AFTER_MOVE_S)
            self._move(float(cam[0]), float(cam[1]), gui)
            self.x.sync()
            if self.realtime:
                wait = self._last_t + STEP_SECONDS - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            self._last_t = max(self._last_t + STEP_SECONDS, time.monotonic() - STEP_SECONDS)
            self._grab()
            if toggles and self.gui_sync_s > 0:
                self._await_frame(lambda f: crosshair_visible(f) == gui)  # the GUI opened or closed
            elif before is not None:
                self._await_frame(lambda f: bool(np.abs(f.astype(np.int16) - before).max() > _CHANGED),
                                  min(self.gui_sync_s, _CLICK_SYNC_S))
            state = self._read_state()
            self._steps += 1
            info = self._info(state)
        except _LOST as e:
            self._check()
            raise self._fail(GameCrashed(f"lost the game's display: {e}")) from e
        reward = 0.0
        if info["success"] and not self._succeeded:
            self._succeeded = True
            reward = 1.0
        terminated = bool(info["success"] and self.terminate_on_success)
        truncated = self._steps >= self.task.max_steps
        return self._obs(info), reward, terminated, truncated, info

    def __del__(self):
        try:
            self._shutdown()
        except Exception:  # noqa: BLE001 (interpreter teardown)
            pass

