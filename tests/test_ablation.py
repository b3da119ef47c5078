"""The ablation entry point: every row trained on the same data and evaluated on the same seeds, the rows'
switches reaching the policy, the table and the last line (a tiny budget on the real game)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from histeve_jax.data import synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_row_figures_average_gui_and_world_tasks_apart():
    from experiments.ablation import row_figures

    def cell(k, n):
        return {"successes": k, "episodes": n, "success_rate": k / n, "ci95": [0.0, 1.0]}

    summary = {"results": {"policy": {"craft_planks": cell(1, 4), "smelt_iron": cell(3, 4),
                                      "place_dirt": cell(4, 4), "mine_dirt": cell(0, 4)}}}
    got = row_figures(summary)
    assert got["gui"] == 0.5 and got["world"] == 0.5
    assert set(got["tasks"]) == set(summary["results"]["policy"])


def test_the_rl_row_is_a_command_line_experiments_rl_accepts(tmp_path):
    """The RL row's flags parse with ``experiments.rl``'s own flags (the row once passed ``--workdir``, a
    flag that entry point does not have) and land where the row reads its results."""
    from experiments.ablation import rl_args
    from experiments.configs.ablation import get_config

    c = get_config()
    code = ("import sys, json; from absl import flags; import experiments.rl; "
            "flags.FLAGS(['rl', *sys.argv[1:]]); c = flags.FLAGS.config; print(json.dumps("
            "[c.workdir, c.start_run, c.task, c.train_minutes, c.eval.seed, c.eval.episodes, "
            "c.learner.learning_rate, c.rl.replay_rows]))")
    out = subprocess.run([sys.executable, "-c", code, *rl_args(c, str(tmp_path))], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    want = [str(tmp_path / "full_rl"), str(tmp_path / "full"), c.rl_task, c.rl_minutes, c.eval.seed,
            c.eval.episodes, 3e-5, 8]  # the row's overrides (config.rl) reach the RL config
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want


@pytest.mark.game
def test_the_ablation_trains_its_rows_on_the_same_data_and_compares_them(tmp_path):
    synthetic.write_demo_dataset(tmp_path / "demos", episodes=4, length=8, seed=0)
    work = tmp_path / "ablation"
    budget = (f"data.train_dirs={tmp_path / 'demos'}", "num_train_steps=2", "optimizer.warmup_steps=1",
              "data.batch_size=2", "eval_every=0", "progress_bar=False", "eval.instances=1")
    cmd = [sys.executable, "-m", "experiments.ablation", f"--workdir={work}",
           "--config.rows=('shared','full')",
           "--config.world_knowledge=False", "--config.rl_minutes=0", f"--config.imitation={budget!r}",
           "--config.eval.tasks=('place_dirt','craft_planks')", "--config.eval.episodes=1",
           "--config.eval.max_steps=5", "--config.eval.progress_bar=False"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1].split()
    assert [kv.split("=")[0] for kv in last] == ["gui_shared", "gui_full", "world_shared", "world_full"]
    configs = {row: json.load(open(work / row / "config.json")) for row in ("shared", "full")}
    assert (configs["shared"]["model"]["rs_norm"], configs["shared"]["model"]["dual_mouse"]) == (False, False)
    assert (configs["full"]["model"]["rs_norm"], configs["full"]["model"]["dual_mouse"]) == (True, True)
    demos = str(tmp_path / "demos")
    assert configs["shared"]["data"]["train_dirs"] == configs["full"]["data"]["train_dirs"] == demos
    table = json.load(open(work / "ablation.json"))
    assert set(table["rows"]) == {"shared", "full"} and table["seeds"] == [1000]
    assert set(table["expert"]) == {"place_dirt", "craft_planks"}  # the full row is played beside the expert
