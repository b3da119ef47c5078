"""Each game's X display accepts only its owner: clients need the instance's MIT-MAGIC-COOKIE-1."""

import os
import stat

import numpy as np
import pytest
from mss.exception import ScreenShotError
from Xlib import display
from Xlib.error import DisplayConnectionError, XError

from histeve_jax.envs import load_task, make, noop_action
from histeve_jax.envs.luanti.process import write_xauthority, xauthority_env

pytestmark = pytest.mark.game


@pytest.fixture(scope="module")
def env():
    e = make("luanti", obs_size=(64, 64), task="place_dirt")
    e.reset(options={"task": load_task("place_dirt")})
    yield e
    e.close()


def _connect(name: str, xauthority) -> None:
    """Open (and close) a python-xlib and an mss connection to `name` with XAUTHORITY = `xauthority`."""
    import mss

    with xauthority_env(xauthority):
        display.Display(name).close()
        with mss.MSS(display=name) as m:
            m.grab(m.monitors[0])


def test_xauthority_file_is_private_and_holds_a_128_bit_cookie(env):
    path = env.proc.xauthority
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(env.proc.root).st_mode) == 0o700
    raw = path.read_bytes()
    assert raw.count(b"MIT-MAGIC-COOKIE-1") == 2
    assert raw[-18:-16] == b"\x00\x10"  # the cookie field: 16 bytes


@pytest.mark.parametrize("which", ["empty", "wrong_cookie"])
def test_connection_without_the_cookie_is_refused(env, tmp_path, which):
    bad = tmp_path / "Xauthority"
    if which == "empty":
        bad.write_bytes(b"")
    else:
        write_xauthority(bad, os.urandom(16))
    with pytest.raises(DisplayConnectionError, match="uthoriz|Invalid MIT-MAGIC-COOKIE-1"):
        with xauthority_env(bad):
            display.Display(env.proc.display)
    import mss

    with pytest.raises((ScreenShotError, XError)):
        with xauthority_env(bad), mss.MSS(display=env.proc.display) as m:
            m.grab(m.monitors[0])


def test_connection_with_the_cookie_is_accepted(env):
    _connect(env.proc.display, env.proc.xauthority)


def test_game_with_auth_takes_input_and_captures_frames(env):
    obs, info = env.reset(options={"task": load_task("place_dirt")})
    assert obs["image"].shape == (64, 64, 3) and obs["image"].std() > 1.0
    a = noop_action()
    a["camera"] = np.array([0.0, 10.0], np.float32)
    for _ in range(6):
        obs, _, _, _, after = env.step(a)
    turned = (after["yaw"] - info["yaw"] + 180.0) % 360.0 - 180.0
    assert 40.0 < turned < 80.0  # 6 steps x 10 degrees, through XTest on the authenticated connection
    assert "XAUTHORITY" not in os.environ or os.environ["XAUTHORITY"] != str(env.proc.xauthority)
