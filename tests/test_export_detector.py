"""The exported completion detector against the JAX ``CoupledDetector`` it came from: a policy run and a
detector run (the train loop's layout, config.json + an orbax checkpoint of the train state, written here
from drawn weights rather than trained: no train step to compile; the detector run as ``experiments.detector``
lays it out) export through the CLI with ``--detector``, the torch detector loads offline beside the exported
policy, its probabilities equal ours on batches of several frames, right- and left-padded, in both regimes,
and a detector of another policy is one line naming both runs."""

import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModel

from experiments.configs import imitation
from histeve_jax.detector import prune
from histeve_jax.detector.config import ANCHOR_OFFSET, tiny_config
from histeve_jax.detector.inputs import QueryInputs
from histeve_jax.detector.model import Detector
from histeve_jax.eval.policy_agent import load_run
from histeve_jax.export.__main__ import main as export_main
from histeve_jax.train import setup
from histeve_jax.train.specs import RunSpec
from tests.run_helpers import detector_run as _detector_run
from tests.run_helpers import filled as _filled
from tests.run_helpers import save_run as _save_run

POLICY_STEP, DETECTOR_STEP, THRESHOLD = 2, 3, 0.375  # tests.run_helpers.detector_run's defaults


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(policy run, detector run, the JAX coupled detector, its config, the policy config)."""
    root = tmp_path_factory.mktemp("detector_export")
    c = imitation.get_config("tiny")
    spec = RunSpec.from_config(c, str(root / "policy"))
    # Distinct RS-Norm rows (filled independently): the regime changes the detector's context.
    _save_run(spec, _filled(setup.policy_stage(spec).init_model, 1), POLICY_STEP)
    loaded = load_run(spec.workdir)
    # Width 32 against the policy's 64 (projections), 2 cross-attention blocks in 4 layers, 3 frames and the
    # invocation's first (the anchor slot), and the lower half of the anchor's and the query's frames again
    # at twice the scale (the detail crops).
    det_config = tiny_config(loaded.config, cross_attention_every=2, history_frames=2, stride=2,
                             policy_stride=loaded.stride, anchor=True, detail=(28, 56, 0, 56), max_len=208)
    assert det_config.projects and det_config.num_groups == 2
    det_dir, coupled = _detector_run(root, "det", loaded.policy, det_config, seed=5)
    return spec.workdir, det_dir, coupled, det_config, loaded.config


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    policy_dir, det_dir, *_ = runs
    out = str(tmp_path_factory.mktemp("exported") / "with_detector")
    assert export_main([f"--run={policy_dir}", f"--out={out}", f"--detector={det_dir}"]) == 0
    return out


@pytest.fixture(scope="module")
def torch_coupled(exported):
    sys.path.insert(0, os.path.join(exported, "detector"))
    try:
        from modeling_histeve_detector import load_coupled_detector
    finally:
        sys.path.pop(0)
    return load_coupled_detector(exported)


def _left_padded(ids, mask):
    ids, mask = ids.copy(), mask.copy()
    for b in range(ids.shape[0]):
        shift = ids.shape[1] - int(mask[b].sum())
        ids[b], mask[b] = np.roll(ids[b], shift), np.roll(mask[b], shift)
    return ids, mask


def _batch(det_config, policy_config):
    """Four queries of every frame slot (and the detail crops), instructions of different lengths, regimes
    NG, GUI, GUI, NG, right-padded as ``QueryInputs`` pads them, then the same four left-padded (rows 4-7)."""
    inputs = QueryInputs(det_config, policy_config)
    rng = np.random.default_rng(7)
    words = ["chop", "the", "tree", "mine", "stone", "open", "inventory", "craft", "planks", "dig"]
    rows = []
    for i, regime in enumerate([0, 1, 1, 0]):
        frames = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in inputs.slots[0]]
        rows.append(inputs(frames, " ".join(rng.choice(words, 1 + 3 * i)), regime))
    right = {k: np.stack([r[k] for r in rows]) for k in rows[0] if k != "label"}
    assert len(set(right["attention_mask"].sum(1).tolist())) == 4  # every row padded differently
    left = dict(right)
    for p in ("", "policy_"):
        left[f"{p}input_ids"], left[f"{p}attention_mask"] = _left_padded(right[f"{p}input_ids"],
                                                                         right[f"{p}attention_mask"])
    return {k: np.concatenate([right[k], left[k]]) for k in right}


@nnx.jit
def _jax_logits(coupled, batch):
    return coupled.logits(batch)


def _torch_logits(model, batch):
    t = {k: torch.from_numpy(v).long() if v.dtype.kind == "i" else torch.from_numpy(v)
         for k, v in batch.items()}
    with torch.no_grad():
        return model.logits(**t).numpy()


def test_detector_directory_loads_offline_with_every_tensor(exported, runs):
    _, det_dir, coupled, *_ = runs
    assert json.load(open(os.path.join(exported, "config.json")))["histeve"]["detector"] == "detector"
    assert json.load(open(os.path.join(exported, "histeve_actions.json")))["detector"] == "detector"
    cfg = json.load(open(os.path.join(exported, "detector", "config.json")))
    assert cfg["auto_map"]["AutoModel"] == "modeling_histeve_detector.HiSteveDetector"
    assert cfg["histeve"]["source"] == {"run": os.path.abspath(det_dir), "step": DETECTOR_STEP}
    # The frames both models read: the detector's (the invocation's first, then 3 frames 2 steps apart), the
    # policy's (its run's stride).
    want = sorted({ANCHOR_OFFSET, 4, 2, 0} | {runs[3].policy_stride, 0}, reverse=True)
    assert cfg["histeve"]["threshold"] == THRESHOLD and cfg["frame_slots"]["offsets"] == want
    assert cfg["detail_size"] == [56, 112]
    assert [want[i] for i in cfg["frame_slots"]["detail"]] == [ANCHOR_OFFSET, 0]
    model, info = AutoModel.from_pretrained(os.path.join(exported, "detector"), trust_remote_code=True,
                                            output_loading_info=True)
    assert type(model).__name__ == "HiSteveDetector" and len(model.cross) == 2
    assert not info["missing_keys"] and not info["unexpected_keys"]
    d = coupled.detector
    ours = {"image_proj.weight": np.asarray(d.image_proj[...]).T,
            "context_proj.weight": np.asarray(d.context_proj[...]).T,
            "cross.1.o_proj.weight": np.asarray(d.cross.o[1]).reshape(-1, 32).T,
            "cross.0.norm.weight": np.asarray(d.cross.norm.scale[0]),
            "language_model.layers.3.mlp.down_proj.weight": np.asarray(d.language_model.layers.mlp.down[3]).T,
            "head.bias": np.asarray(d.head_bias[...])}
    theirs = model.state_dict()
    for name, a in ours.items():
        np.testing.assert_array_equal(theirs[name].numpy(), a, err_msg=name)


def test_probabilities_match_the_jax_coupled_detector(runs, torch_coupled):
    _, _, coupled, det_config, policy_config = runs
    batch = _batch(det_config, policy_config)
    ours = np.asarray(_jax_logits(coupled, {k: jnp.asarray(v) for k, v in batch.items()}))
    theirs = _torch_logits(torch_coupled, batch)
    p_ours = np.asarray(jax.nn.softmax(ours, -1)[:, 1])
    p_theirs = torch.softmax(torch.from_numpy(theirs), -1)[:, 1].numpy()
    err = np.abs(ours - theirs).max() / np.abs(ours).max()
    print(f"P {np.round(p_ours[:4], 4).tolist()}: max |dP| {np.abs(p_ours - p_theirs).max():.2e}, logits "
          f"max |diff| / max |logit| {err:.2e}")
    assert np.abs(p_ours - p_theirs).max() < 1e-5 and err < 1e-4, (p_ours, p_theirs)
    np.testing.assert_allclose(theirs[4:], theirs[:4], atol=1e-5)  # left padding = right padding
    # The policy's context reaches the logits: its other RS-Norm row moves them far more than the error.
    flipped = _torch_logits(torch_coupled, {**batch, "regime": 1 - batch["regime"]})
    print(f"the other regime moves the logits by {np.abs(flipped - theirs).max():.3f}")
    assert np.abs(flipped - theirs).max() > 1000 * max(np.abs(ours - theirs).max(), 1e-7)


def test_a_detector_of_another_policy_is_one_line_naming_both(runs, tmp_path, capsys):
    policy_dir, det_dir, _, det_config, policy_config = runs
    # The same shapes, other weights: a detector trained beside another checkpoint of the policy.
    other = _filled(setup.policy_stage(RunSpec.from_config(imitation.get_config("tiny"), "")).init_model, 9)
    wrong_dir, _ = _detector_run(tmp_path, "other", other, det_config, seed=6)
    narrow = tmp_path / "narrow"  # a detector config for a policy of hidden width 32
    shutil.copytree(det_dir, narrow, symlinks=True)
    prune.save_detector(_filled(lambda: Detector(det_config.replace(policy_hidden_size=32), rngs=nnx.Rngs(0)),
                                0), str(narrow))
    capsys.readouterr()
    for bad, why in ((wrong_dir, "other policy weights"), (narrow, "hidden width 64")):
        out = tmp_path / "out"
        assert export_main([f"--run={policy_dir}", f"--out={out}", f"--detector={bad}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and str(bad) in err and policy_dir in err and why in err, err
        assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]
    assert export_main([f"--run={policy_dir}", f"--out={tmp_path / 'out'}", f"--detector={det_dir}/.."]) == 2
    assert "run_x2: pass one" in capsys.readouterr().err
