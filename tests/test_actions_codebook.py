"""The VPT action space against MineStudio's vpt_lib (the oracle): quantisation, agent format, regime."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from histeve_jax.actions import (
    BUTTONS,
    CODEBOOKS,
    N_JOINT_BUTTONS,
    Regime,
    agent_to_env,
    env_to_agent,
    regime_of,
)


@pytest.fixture(scope="module")
def vpt_lib():
    """MineStudio's real ``actions.py`` and ``action_mapping.py``.

    Importing them normally pulls ``minecraft_util``, whose torch action heads need ``gym`` and ``gym3``
    (gym3 pins numpy<2, so it cannot be installed here). The only thing ``actions.py`` takes from that module
    is ``store_args``, so we compile the real ``store_args`` out of its source and seed it under that name.
    """
    spec = importlib.util.find_spec("minestudio")
    root = Path(spec.submodule_search_locations[0]) / "utils" / "vpt_lib"
    src = (root / "minecraft_util.py").read_text()
    tree = ast.parse(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "store_args")
    util = types.ModuleType("minestudio.utils.vpt_lib.minecraft_util")
    code = "import functools\nimport inspect\n" + ast.get_source_segment(src, fn)
    exec(compile(code, str(root / "minecraft_util.py"), "exec"), util.__dict__)
    seeded = {"minestudio.utils.vpt_lib.minecraft_util": util}
    with mock.patch.dict(sys.modules, seeded):
        actions = importlib.import_module("minestudio.utils.vpt_lib.actions")
        mapping = importlib.import_module("minestudio.utils.vpt_lib.action_mapping")
    return actions, mapping


def _oracle(vpt_lib, name):
    actions, mapping = vpt_lib
    cb = CODEBOOKS[name]
    transformer = actions.ActionTransformer(
        camera_maxval=cb.maxval,
        camera_binsize=cb.binsize,
        camera_quantization_scheme=cb.scheme,
        camera_mu=cb.mu,
    )
    return transformer, mapping.CameraHierarchicalMapping(n_camera_bins=cb.n_bins)


def _random_env_actions(rng: np.random.Generator, n: int, dtype=np.float64) -> dict:
    # Sparse presses (so groups are often single), some dense rows to hit the tie rules, and camera values
    # spanning small motions, exact bin edges' neighbourhood, zeros and clipping.
    p = rng.choice([0.05, 0.3, 0.7], size=(n, 1))
    buttons = (rng.random((n, len(BUTTONS))) < p).astype(np.int64)
    cam = rng.choice([0.0, 1.0], size=(n, 2), p=[0.3, 0.7]) * rng.standard_normal((n, 2)) * rng.choice(
        [0.3, 3.0, 30.0], size=(n, 1)
    )
    act = {k: buttons[:, i] for i, k in enumerate(BUTTONS)}
    act["camera"] = cam.astype(dtype)
    return act


@pytest.mark.parametrize("name", ["vpt", "openha"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_env_to_agent_matches_vpt_lib(vpt_lib, name, dtype):
    transformer, mapping = _oracle(vpt_lib, name)
    act = _random_env_actions(np.random.default_rng(0), 4000, dtype)
    ref = mapping.from_factored(transformer.env2policy({k: v.copy() for k, v in act.items()}))
    ours = env_to_agent(act, name)
    np.testing.assert_array_equal(ours["buttons"], ref["buttons"][:, 0])
    np.testing.assert_array_equal(ours["camera"], ref["camera"][:, 0])


@pytest.mark.parametrize("name", ["vpt", "openha"])
def test_agent_to_env_matches_vpt_lib(vpt_lib, name):
    transformer, mapping = _oracle(vpt_lib, name)
    cb = CODEBOOKS[name]
    rng = np.random.default_rng(1)
    agent = {"buttons": rng.integers(0, N_JOINT_BUTTONS, 3000), "camera": rng.integers(0, cb.n_bins**2, 3000)}
    agent["buttons"][:50] = N_JOINT_BUTTONS - 1  # the inventory index
    column = {k: v[:, None].copy() for k, v in agent.items()}
    ref = transformer.policy2env(mapping.to_factored(column))
    ours = agent_to_env(agent, name)
    assert set(ours) == set(ref)
    for key in ref:
        np.testing.assert_array_equal(ours[key], ref[key], err_msg=key)


def test_codebooks_have_published_sizes():
    assert (CODEBOOKS["vpt"].mu, CODEBOOKS["vpt"].maxval, CODEBOOKS["vpt"].n_bins) == (10, 10, 11)
    assert (CODEBOOKS["openha"].mu, CODEBOOKS["openha"].maxval, CODEBOOKS["openha"].n_bins) == (20, 10, 21)
    assert N_JOINT_BUTTONS == 8641


def test_unbatched_noop_is_minestudio_noop():
    # MinecraftSim.noop_action() for the agent format is buttons 0, camera 60.
    assert env_to_agent({"camera": [0.0, 0.0]}) == {"buttons": 0, "camera": 60}
    env = agent_to_env({"buttons": 0, "camera": 60})
    assert all(env[k] == 0 for k in BUTTONS) and np.array_equal(env["camera"], [0.0, 0.0])


def test_single_action_hand_checked():
    # forward + attack, pitch -10 (bin 0), yaw 0: choices fore_back=1, attack=1, camera meta on.
    a = env_to_agent({"forward": 1, "attack": 1, "camera": np.array([-10.0, 0.0])})
    # joint index digits (hotbar, fore_back, left_right, sprint_sneak, use, drop, attack, jump, camera)
    digits, radices = [0, 1, 0, 0, 0, 0, 1, 0, 1], [10, 3, 3, 3, 2, 2, 2, 2, 2]
    idx = 0
    for d, r in zip(digits, radices, strict=True):
        idx = idx * r + d
    assert a == {"buttons": idx, "camera": 0 * 11 + 5}


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"camera": [0.0, 0.0], "jumpp": 1}, "'jumpp'"),
        ({"forward": 1}, "'camera'"),
        ({"camera": [0.0, np.nan]}, "'camera' is not finite"),
        ({"camera": [0.0, np.inf]}, "'camera' is not finite"),
        ({"camera": [0.0, 0.0, 0.0]}, r"shape \[\.\.\., 2\]"),
        ({"camera": [0.0, 0.0], "attack": 2}, "'attack' must be 0 or 1"),
        ({"camera": np.zeros((3, 2)), "attack": np.zeros(4)}, "'attack' has shape"),
    ],
)
def test_bad_env_action_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        env_to_agent(bad)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"buttons": 8641, "camera": 60}, "'buttons' must lie in 0..8640"),
        ({"buttons": 0, "camera": 121}, "'camera' must lie in 0..120"),
        ({"buttons": 0}, "missing key 'camera'"),
        ({"buttons": 0, "camera": 60, "esc": 1}, "'esc'"),
        ({"buttons": 0.5, "camera": 60}, "'buttons' must be integer"),
    ],
)
def test_bad_agent_action_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        agent_to_env(bad)


def test_regime_normalises_every_source():
    assert regime_of({"is_gui_open": True}) is Regime.GUI  # MineStudio info / our backends
    assert regime_of({"isGuiOpen": False}) is Regime.NG  # VPT contractor jsonl
    assert regime_of(np.bool_(True)) == 1 and regime_of(0) == 0 and regime_of("gui") is Regime.GUI
    for bad in ({"pov": 1}, 2, "menu", [0, 1]):
        with pytest.raises(ValueError, match="regime"):
            regime_of(bad)
