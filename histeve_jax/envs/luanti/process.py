"""One private Luanti instance: an Xvfb display, a minetest client (with its local server) and a temp world.

Processes are started with their pids recorded and stopped by those pids (terminate, then kill), always
reaped; a weakref finalizer and atexit hook stop them if the owner forgets, and PR_SET_PDEATHSIG stops them
if the Python process itself dies.

The display accepts only its owner: each instance draws a random 128-bit MIT-MAGIC-COOKIE-1, writes it to an
Xauthority file in its private (0700) dir and starts Xvfb with ``-auth`` on it, so a client without the
cookie (another local user, another instance) is refused. minetest gets ``XAUTHORITY`` in its environment;
our own connections (python-xlib, mss) are opened inside ``LuantiProcess.x_auth()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from histeve_jax.envs.base import PIXELS_PER_DEGREE, RENDER_SIZE

MINETEST_BIN = os.environ.get("HISTEVE_MINETEST", "/usr/games/minetest")
XVFB_BIN = shutil.which("Xvfb") or "/usr/bin/Xvfb"
PACKAGE_DIR = Path(__file__).resolve().parent
MOD_DIR = PACKAGE_DIR / "mod" / "histeve_bridge"
WORLD_TEMPLATE = PACKAGE_DIR / "world_template"

RENDER_H, RENDER_W = RENDER_SIZE
ARENA_SPAWN = (0.5, 9.5, 0.5)


class GameError(RuntimeError):
    """Base class for a Luanti instance that stopped working."""


class GameCrashed(GameError):
    """The minetest or Xvfb process exited."""


class GameHung(GameError):
    """The game stopped updating its state file."""


def minetest_available() -> bool:
    """True if the minetest client and Xvfb are installed."""
    return os.access(MINETEST_BIN, os.X_OK) and os.access(XVFB_BIN, os.X_OK)


# Xauthority entry families (Xau's FamilyLocal: a Unix-socket connection from `address` = the host name;
# FamilyWild: any address) and the one auth protocol we use.
FAMILY_LOCAL, FAMILY_WILD = 256, 65535
MIT_COOKIE = b"MIT-MAGIC-COOKIE-1"


def write_xauthority(path: str | os.PathLike, cookie: bytes) -> None:
    """Write an Xauthority file (Xau's binary format, mode 0600) granting ``cookie`` on this host.

    Entries have an empty display number, which Xau and python-xlib match to any display: Xvfb picks its own
    number (-displayfd) after reading the file, and the server itself ignores the entries' address fields.
    """
    def field(b: bytes) -> bytes:
        return struct.pack(">H", len(b)) + b

    host = socket.gethostname().encode()
    data = b"".join(struct.pack(">H", family) + field(addr) + field(b"") + field(MIT_COOKIE) + field(cookie)
                    for family, addr in ((FAMILY_LOCAL, host), (FAMILY_WILD, b"")))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def xauthority_env(path: str | os.PathLike) -> Iterator[None]:
    """Point XAUTHORITY at ``path`` while X connections are opened (python-xlib and libxcb read it then).

    The variable is process-wide, so connections to one game are opened one at a time in a process.
    """
    old = os.environ.get("XAUTHORITY")
    os.environ["XAUTHORITY"] = os.fspath(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XAUTHORITY", None)
        else:
            os.environ["XAUTHORITY"] = old


def _set_pdeathsig() -> None:
    # Runs in the child between fork and exec: die with the parent instead of lingering as an orphan.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def client_config(
    *, fps_max: int, viewing_range: int, map_seed: int, extra: dict[str, str] | None = None
) -> str:
    """The minetest.conf text for one instance: cheap rendering, fixed world, no pausing, exact mouse."""
    cfg = {
        "screen_w": str(RENDER_W),
        "screen_h": str(RENDER_H),
        "fullscreen": "false",
        "autosave_screensize": "false",
        "enable_sound": "false",
        "fps_max": str(fps_max),
        "fps_max_unfocused": str(fps_max),
        "pause_on_lost_focus": "false",
        "viewing_range": str(viewing_range),
        "enable_shaders": "false",
        "enable_clouds": "false",
        "enable_3d_clouds": "false",
        "enable_particles": "false",
        "smooth_lighting": "true",
        "enable_waving_water": "false",
        "enable_waving_leaves": "false",
        "enable_waving_plants": "false",
        "leaves_style": "opaque",
        "enable_minimap": "false",
        "show_debug": "false",
        "view_bobbing_amount": "0",
        "fall_bobbing_amount": "0",
        "camera_smoothing": "0",
        "invert_mouse": "false",
        # minetest turns the view by mouse_sensitivity degrees per pointer pixel; this makes the mapping
        # exactly base.PIXELS_PER_DEGREE (measured: 100 px -> 15.000 degrees).
        "mouse_sensitivity": f"{1.0 / PIXELS_PER_DEGREE:.6f}",
        "gui_scaling": "1",
        "hud_scaling": "1",
        "tooltip_show_delay": "100000",
        "doubletap_jump": "false",
        "always_fly_fast": "false",
        "free_move": "false",
        "fast_move": "false",
        "noclip": "false",
        "enable_damage": "true",
        "creative_mode": "false",
        "time_speed": "0",
        "dedicated_server_step": "0.05",
        "mg_name": "flat",
        "fixed_map_seed": str(map_seed),
        "mg_flags": "nocaves,nodungeons,light,decorations,biomes,ores",
        "mgflat_spflags": "nolakes,nohills",
        "mgflat_ground_level": "8",
        "static_spawnpoint": ",".join(str(int(v)) for v in ARENA_SPAWN),
        "give_initial_stuff": "false",
        "server_announce": "false",
        "enable_client_modding": "false",
        "menu_last_game": "minetest",
        "bind_address": "127.0.0.1",
        "enable_rollback_recording": "false",
        "server_map_save_interval": "60",
        "active_block_range": "2",
        "max_block_send_distance": "6",
        "chat_message_limit_per_10sec": "1000",
        # minetest 5.6 has no sprint key: the env's "sprint" is Aux1 (fast move where allowed), pinned to E
        # here (its default) because xinput.KEYSYMS sends E for it. "keymap_sprint" is not a 5.6 setting.
        "keymap_aux1": "KEY_KEY_E",
    }
    cfg.update(extra or {})
    return "".join(f"{k} = {v}\n" for k, v in cfg.items())


class LuantiProcess:
    """Starts Xvfb + minetest on a private world; `stop()` ends both by pid and removes the temp dir."""

    def __init__(
        self,
        *,
        fps_max: int = 30,
        viewing_range: int = 40,
        map_seed: int = 20240613,
        startup_timeout_s: float = 90.0,
        keep_dir: bool = False,
        extra_config: dict[str, str] | None = None,
    ):
        if not os.access(MINETEST_BIN, os.X_OK):
            raise FileNotFoundError(f"minetest client not found at {MINETEST_BIN} (apt-get install minetest)")
        if not os.access(XVFB_BIN, os.X_OK):
            raise FileNotFoundError(f"Xvfb not found at {XVFB_BIN} (apt-get install xvfb)")
        self.root = Path(tempfile.mkdtemp(prefix="histeve_luanti_"))
        self.keep_dir = keep_dir
        self.home = self.root / "home"
        self.world = self.root / "world"
        self.config_path = self.root / "minetest.conf"
        self.log_path = self.root / "minetest.log"
        self.xauthority = self.root / "Xauthority"
        self.xvfb: subprocess.Popen | None = None
        self.game: subprocess.Popen | None = None
        self.display: str | None = None
        self._procs_box: list[int] = []
        # finalize also runs at interpreter exit (its atexit flag), so this covers both forgotten objects
        # and a process that exits without calling stop().
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs_box, str(self.root), keep_dir)
        self.home.mkdir()
        write_xauthority(self.xauthority, secrets.token_bytes(16))
        shutil.copytree(WORLD_TEMPLATE, self.world)
        shutil.copytree(MOD_DIR, self.world / "worldmods" / MOD_DIR.name)
        self.config_path.write_text(client_config(fps_max=fps_max, viewing_range=viewing_range,
                                                  map_seed=map_seed, extra=extra_config))
        try:
            self._start_xvfb(startup_timeout_s)
            self._start_game()
        except BaseException:
            self.stop()
            raise

    # The state file the mod writes; callers poll it.
    @property
    def state_path(self) -> Path:
        return self.world / "histeve_state.json"

    @property
    def command_path(self) -> Path:
        return self.world / "histeve_cmd.json"

    def _start_xvfb(self, timeout_s: float) -> None:
        # -displayfd lets the server pick a free display number itself (no race with other instances).
        read_fd, write_fd = os.pipe()
        try:
            self.xvfb = subprocess.Popen(
                [XVFB_BIN, "-displayfd", str(write_fd), "-auth", str(self.xauthority),
                 "-screen", "0", f"{RENDER_W}x{RENDER_H}x24", "-nolisten", "tcp", "-noreset",
                 "+extension", "XTEST"],
                pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=_set_pdeathsig,
            )
            self._procs_box.append(self.xvfb.pid)
            os.close(write_fd)
            write_fd = -1
            buf = b""
            deadline = time.monotonic() + timeout_s
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or self.xvfb.poll() is not None:
                    raise GameCrashed(f"Xvfb did not report a display (exit code {self.xvfb.poll()})")
                ready, _, _ = select.select([read_fd], [], [], left)
                if ready:
                    chunk = os.read(read_fd, 64)
                    if not chunk:
                        raise GameCrashed("Xvfb closed -displayfd without a display number")
                    buf += chunk
            self.display = ":" + buf.decode().strip()
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)

    def _start_game(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "WAYLAND"))}
        env.update(DISPLAY=self.display, XAUTHORITY=str(self.xauthority), HOME=str(self.home),
                   LIBGL_ALWAYS_SOFTWARE="1")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (kept open for the child's lifetime)
        self.game = subprocess.Popen(
            [MINETEST_BIN, "--config", str(self.config_path), "--go", "--world", str(self.world),
             "--gameid", "minetest", "--name", "agent", "--password", "",
             "--port", str(_free_udp_port())],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=str(self.root), preexec_fn=_set_pdeathsig,
        )
        self._procs_box.append(self.game.pid)

    def x_auth(self) -> contextlib.AbstractContextManager[None]:
        """A context in which new X connections (python-xlib, mss) present this instance's cookie."""
        return xauthority_env(self.xauthority)

    def pids(self) -> list[int]:
        """Pids of the running game and display processes."""
        return [p.pid for p in (self.game, self.xvfb) if p is not None and p.poll() is None]

    def check_alive(self) -> None:
        """Raise GameCrashed if either process has exited."""
        for name, proc in (("minetest", self.game), ("Xvfb", self.xvfb)):
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise GameCrashed(f"{name} exited (code {code}); log: {self.log_tail()}")

    def log_tail(self, n: int = 600) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        """Stop both processes by pid (terminate, then kill), reap them, and delete the temp dir."""
        for proc in (self.game, self.xvfb):
            if proc is not None:
                _terminate(proc)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        self._procs_box.clear()
        self._finalizer()

    def __enter__(self) -> LuantiProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_udp_port() -> int:
    # The local server listens on UDP; ask the kernel for a free port so parallel instances don't collide.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _terminate(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # a stopped (hung) process would hold SIGTERM until continued
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    else:
        proc.wait()


def _stop_processes(pids: list[int], root: str, keep_dir: bool) -> None:
    # Finalizer path: only pids are left (the Popen objects may be gone), so signal and reap by pid.
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 3.0
    for pid in pids:
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done:
                break
            if time.monotonic() > deadline:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
                break
            time.sleep(0.05)
    pids.clear()
    if not keep_dir:
        shutil.rmtree(root, ignore_errors=True)
