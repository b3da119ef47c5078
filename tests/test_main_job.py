"""The main job's whole path (``python -m experiments.imitation``): train, then play closed loop in the game
and print the table and the headline line, in one program, on a tiny budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from histeve_jax.data import synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.game
def test_the_main_job_trains_then_evaluates_closed_loop(tmp_path):
    synthetic.write_demo_dataset(tmp_path / "demos", episodes=4, length=8, seed=0)
    work = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.imitation", f"--workdir={work}",
           f"--config.data.train_dirs={tmp_path / 'demos'}", "--config.num_train_steps=2",
           "--config.optimizer.warmup_steps=1", "--config.data.batch_size=2", "--config.eval_every=0",
           "--config.progress_bar=False", "--config.eval.tasks=('place_dirt',)", "--config.eval.episodes=1",
           "--config.eval.agents=('policy','random')", "--config.eval.max_steps=5",
           "--config.eval.instances=1", "--config.eval.progress_bar=False"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("tasks=1 mean_success=") and "tasks_over_half=" in lines[-1]
    assert "min_success=" in lines[-1]
    assert any(line.startswith(f"run: {work}") for line in lines)
    assert any(f"--config.policy={work}" in line for line in lines)
    summary = json.load(open(work / "eval" / "summary.json"))
    assert summary["results"]["policy"]["place_dirt"]["episodes"] == 1
    assert summary["results"]["random"]["place_dirt"]["seeds"] == [1000]
    # The output reads cleanly: no TensorFlow banners between the training and the results.
    assert "oneDNN" not in out.stdout + out.stderr


def test_the_pickaxe_variant_is_the_main_job_on_seven_tasks():
    """imitation.py:pickaxe is the main job's run (model, frames, data settings) on the main four tasks and
    the rest of wooden_pickaxe's subtasks, recorded by record.py:pickaxe at its frame size, each with an
    expert."""
    from experiments.configs import imitation, record
    from experiments.configs.evaluate import MAIN_TASKS
    from experiments.record import episodes_by_task
    from histeve_jax.envs import load_task
    from histeve_jax.envs.experts import EXPERT_TASKS
    from histeve_jax.train.specs import RunSpec

    tiny, pick = imitation.get_config("tiny"), imitation.get_config("pickaxe")
    rec = record.get_config(pick.record.variant)
    assert tuple(pick.eval.tasks) == (*MAIN_TASKS, "mine_log", "craft_sticks", "craft_wooden_pickaxe")
    # the recorder's: those, then starts of mine_log and mine_dirt the agent's episodes showed (variants)
    assert tuple(rec.tasks) == (*pick.eval.tasks, "mine_log[beside=1]", "mine_log[against=1]",
                                "mine_dirt[dug=1]")
    assert [load_task(t).init["vary"]["against"] for t in rec.tasks[-3:]] == [0.0, 1.0, 0.0]
    assert {load_task(t).name for t in rec.tasks} <= set(EXPERT_TASKS)
    assert tuple(rec.obs_size) == tuple(pick.data.image_size)
    assert rec.episodes == pick.record.episodes and rec.task_episodes == pick.record.task_episodes
    assert sum(episodes_by_task(rec).values()) == 544 and episodes_by_task(rec)["mine_log[against=1]"] == 48
    assert rec.perturb == pick.record.perturb > 0

    def flat(c, prefix=""):
        out = {}
        for k, v in c.items():
            out.update(flat(v, f"{prefix}{k}.") if hasattr(v, "items") else {f"{prefix}{k}": v})
        return out

    a, b = flat(tiny.to_dict()), flat(pick.to_dict())
    assert a.keys() == b.keys()
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {"variant", "workdir", "record.variant", "record.task_episodes", "record.timeout_s",
                       "record.perturb", "num_train_steps", "data.task_weights",
                       "optimizer.total_steps", "eval_every", "checkpoint_every", "eval.tasks", "eval.agents",
                       "eval.max_steps"}
    assert pick.optimizer.total_steps == pick.num_train_steps == 28000
    spec = RunSpec.from_config(pick, "/tmp/unused")
    assert spec.variant == "pickaxe" and spec.data.stride == tiny.data.stride
    weights = dict(spec.data.task_weights)
    assert weights["craft_planks"] == 8 and "mine_log" not in weights
    with pytest.raises(ValueError, match="unknown config variant 'pickax' for imitation"):
        imitation.get_config("pickax")
    with pytest.raises(ValueError, match="unknown record config variant 'pickax'"):
        record.get_config("pickax")
