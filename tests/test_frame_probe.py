"""``eval.frame_probe``: the frame-sensitivity diagnostic, on a tiny random policy and synthetic demos."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from histeve_jax.data import pipeline as P
from histeve_jax.data import synthetic
from histeve_jax.eval import frame_probe
from histeve_jax.policy import Policy, tiny_config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    synthetic.write_demo_dataset(d, episodes=3, length=6, height=56, width=56, gui_fraction=0.5, seed=1)
    config = tiny_config(history_frames=1)
    spec = P.FeatureSpec(history=1, stride=2, image_size=(56, 56), max_len=96,
                         compact_vocab=P.CompactVocab(action_base=config.action_token_base))
    return str(d), spec, Policy(config, rngs=nnx.Rngs(0))


def test_a_policy_sees_both_frames_and_tells_windows_apart(setup):
    records, spec, policy = setup
    windows = frame_probe.demo_windows(records, spec, limit=5)
    got = frame_probe.probe(policy, spec, windows)
    assert got.windows == 5 and len(got.black) == len(got.swap) == 2
    assert all(v > 1e-6 for v in got.black + got.swap)
    assert 0 < got.feature_spread < 1
    assert got.summary().startswith("windows=5 black_0=")


def test_a_policy_whose_vision_tower_outputs_nothing_is_reported_frame_blind(setup):
    records, spec, policy = setup
    blind = nnx.clone(policy)
    merger = blind.model.visual.merger
    merger.fc2.set_value(np.zeros_like(merger.fc2.get_value()))
    merger.fc2_bias.set_value(np.zeros_like(merger.fc2_bias.get_value()))
    got = frame_probe.probe(blind, spec, frame_probe.demo_windows(records, spec, limit=2))
    assert got.black == (0.0, 0.0) and got.swap == (0.0, 0.0)
    assert got.feature_spread == 0.0


def test_bad_selections_are_named(setup):
    records, spec, policy = setup
    with pytest.raises(ValueError, match="no demonstration windows"):
        frame_probe.demo_windows(records, spec, task="no_such_task")
    with pytest.raises(ValueError, match="at least 2 windows"):
        frame_probe.probe(policy, spec, frame_probe.demo_windows(records, spec, limit=1))
