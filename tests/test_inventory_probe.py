"""``eval.inventory_probe`` and ``experiments.probe --inventory_item``: the logistic probe and its scores by
hand, crops, and the whole probe on records in the real format through a run's policy."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import probe as probe_cli
from experiments.configs import imitation
from histeve_jax.data import records as R
from histeve_jax.eval import inventory_probe as IP
from histeve_jax.train import setup
from histeve_jax.train.specs import RunSpec
from tests.run_helpers import filled, save_run


def test_the_probe_and_its_scores_by_hand():
    x, y = np.array([[0.0], [1.0], [2.0], [3.0]]), np.array([0, 0, 1, 1])
    assert IP.fit_logistic(x, y)(x).tolist() == [0, 0, 1, 1]
    # 1 of 2 negatives and 2 of 2 positives right: accuracy 3/4, balanced (1/2 + 1) / 2
    assert IP.scores(np.array([0, 1, 1, 1]), y) == {"acc": 0.75, "balanced_acc": 0.75}
    # one class only: the absent class's recall counts 0, so always answering "held" is not rewarded
    assert IP.scores(np.array([1, 1]), np.array([1, 1])) == {"acc": 1.0, "balanced_acc": 0.5}


def test_a_crop_at_a_scale_must_give_whole_merged_patches():
    frame = np.arange(112 * 196 * 3, dtype=np.int64).astype(np.uint8).reshape(112, 196, 3)
    (hotbar,) = IP.crop_frames([frame], (84, 112, 14, 154), 2.0)
    assert hotbar.shape == (56, 280, 3)
    assert IP.crop_frames([frame], None)[0] is frame
    with pytest.raises(ValueError, match=r"crop \(0, 30, 0, 56\) at scale 1.0 is 30x56"):
        IP.crop_frames([frame], (0, 30, 0, 56))


def _episodes(directory, n, seed, inventory=True):
    """mine_log episodes of 56x56 frames: dark, with a bright square low on the left from the step the log
    is held (4 of 8 steps) on; the metadata's inventory says so."""
    rng = np.random.default_rng(seed)
    eps = []
    for e in range(n):
        rows = []
        for i in range(8):
            held = i >= 4
            frame = rng.integers(0, 40, (56, 56, 3)).astype(np.uint8)
            if held:
                frame[40:52, 4:16] = 230
            meta = {"inventory": {"default:tree": 1} if held else {}} if inventory else {}
            rows.append(R.StepRecord(episode_id=f"ep{seed}-{e}", step=i, task_id="mine_log", kind="eval",
                                     instruction="chop a tree", frame=R.encode_frame(frame),
                                     action={"camera": [0.0, 0.0]}, is_gui_open=False, completed=int(held),
                                     metadata=meta))
        eps.append(rows)
    R.write_episodes(directory, eps)
    return str(directory)


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory):
    spec = RunSpec.from_config(imitation.get_config("tiny"), str(tmp_path_factory.mktemp("probe") / "run"))
    save_run(spec, filled(setup.policy_stage(spec).init_model, 3), 2)
    return spec.workdir


def test_the_probe_through_a_runs_tower_on_records(policy_run, tmp_path, capsys):
    fit, scored = _episodes(tmp_path / "fit", 4, 1), _episodes(tmp_path / "eval", 2, 2)
    probe_cli.main([f"--run={policy_run}", f"--records={fit}", f"--eval_records={scored}", "--task=mine_log",
                    "--inventory_item=default:tree"])
    line = capsys.readouterr().out.strip()
    got = dict(kv.split("=") for kv in line.split())
    # every second step of 4 and 2 episodes of 8, half held; the square is told apart on unseen episodes
    assert (got["fit"], got["scored"], got["held"]) == ("16", "8", "0.500")
    assert float(got["balanced_acc"]) == 1.0 and float(got["train_acc"]) == 1.0
    with pytest.raises(ValueError, match="always or never held"):
        from histeve_jax.eval.policy_agent import load_run

        IP.run_probe(load_run(policy_run).policy, [fit], [scored], "mine_log", "default:dirt")
    bare = _episodes(tmp_path / "bare", 1, 3, inventory=False)
    with pytest.raises(ValueError, match="carries an inventory"):
        IP.labelled_frames([bare], "mine_log", "default:tree")
