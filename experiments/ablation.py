"""The paper's ablation on Luanti: which of RS-Norm and Dual-Mouse makes the policy work in the GUI.

    python -m experiments.ablation                            # every row, ~1 hour on 2 cores
    python -m experiments.ablation --config.rows="('shared','full')" --config.world_knowledge=False \\
        --config.rl_minutes=0 --workdir=/tmp/ablation        # only the two rows the last line compares

Rows, each the main job (``experiments.imitation``) with the same demonstrations (recorded once, by the
first row), the same steps, seed and held-out evaluation seeds:
(a) ``shared``: one RMSNorm scale and one mouse token set; (b) ``rs_norm``: RS-Norm only; (c) ``dual_mouse``:
Dual-Mouse only; (d) ``full``: both (evaluated beside the scripted expert); then (d) initialised from stage 1
(``full_wk``: ``experiments.world_knowledge``) and (d) after stage 3 on the GUI task (``full_rl``:
``experiments.rl`` for ``rl_minutes``, with ``config.rl``'s overrides). Each row's success per task with
95% Wilson intervals, and the GUI tasks (craft, smelt) and world tasks averaged apart, as the paper reports
them; ``ablation.json`` in the workdir. A row whose evaluation exists is not rerun. The last line:
``gui_shared=<x> gui_full=<y> world_shared=<z> world_full=<w>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

from experiments.config_cli import define_config_and_workdir
from experiments.configs.ablation import ROWS

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUI_CATEGORIES = ("craft", "smelt")


def _run(args: list[str]) -> None:
    print("ablation: " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", *args], check=True, cwd=_REPO)


def _eval_flags(c, agents: tuple[str, ...]) -> list[str]:
    e = c.eval
    return [f"--config.eval.tasks={tuple(e.tasks)!r}", f"--config.eval.episodes={e.episodes}",
            f"--config.eval.seed={e.seed}", f"--config.eval.max_steps={e.max_steps}",
            f"--config.eval.agents={agents!r}", f"--config.eval.progress_bar={e.progress_bar}"]


def _summary(run: str) -> dict | None:
    path = os.path.join(run, "eval", "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def row_data(run: str) -> tuple[str, str]:
    """(train, eval) shard directories a row trained on: its given ones, or those it recorded."""
    with open(os.path.join(run, "config.json")) as f:
        d = json.load(f)["data"]
    if d["train_dirs"]:
        return d["train_dirs"], d["eval_dirs"]
    return os.path.join(run, "data", "train"), os.path.join(run, "data", "eval")


def train_row(c, workdir: str, name: str, rs_norm: bool, dual_mouse: bool, data: tuple[str, str] | None,
              extra: tuple[str, ...] = ()) -> dict:
    """One imitation row (trained and evaluated unless its evaluation exists) on ``data`` (None: its own);
    its eval summary."""
    run = os.path.join(workdir, name)
    if _summary(run) is None:
        agents = ("policy", "expert") if name == "full" else ("policy",)
        args = ["experiments.imitation", f"--workdir={run}", f"--config.model.rs_norm={rs_norm}",
                f"--config.model.dual_mouse={dual_mouse}", *_eval_flags(c, agents),
                *(f"--config.{kv}" for kv in c.imitation), *extra]
        if data:
            args += [f"--config.data.train_dirs={data[0]}", f"--config.data.eval_dirs={data[1]}"]
        _run(args)
    return _summary(run)


def rl_args(c, workdir: str) -> list[str]:
    """``experiments.rl``'s flags for the RL row: stage 3 on ``rl_task`` from the full row, in full_rl."""
    return [f"--config.workdir={os.path.join(workdir, 'full_rl')}",
            f"--config.start_run={os.path.join(workdir, 'full')}", f"--config.task={c.rl_task}",
            f"--config.train_minutes={c.rl_minutes}", f"--config.eval.seed={c.eval.seed}",
            f"--config.eval.episodes={c.eval.episodes}", *(f"--config.{kv}" for kv in c.rl)]


def rl_row(c, workdir: str) -> dict:
    """Stage 3 on the GUI task from the full row, then the learner's weights evaluated on every task."""
    run, full = os.path.join(workdir, "full_rl"), os.path.join(workdir, "full")
    learner = os.path.join(run, "learner")
    if _summary(run) is None:
        if not os.path.isdir(os.path.join(learner, "checkpoints")):
            _run(["experiments.rl", *rl_args(c, workdir)])
        with open(os.path.join(full, "config.json")) as f:
            image_size = tuple(json.load(f)["data"]["image_size"])
        e = c.eval
        _run(["experiments.evaluate", f"--config.policy={learner}", f"--config.out_dir={run}/eval",
              f"--config.tasks={tuple(e.tasks)!r}", f"--config.episodes={e.episodes}",
              f"--config.seed={e.seed}", f"--config.max_steps={e.max_steps}", "--config.agents=('policy',)",
              f"--config.obs_size={image_size!r}", f"--config.progress_bar={e.progress_bar}"])
    return _summary(run)


def row_figures(summary: dict) -> dict:
    """Per task (successes, episodes, rate, interval) and the GUI and world averages of the policy."""
    from histeve_jax.envs.tasks import load_task

    res = summary["results"]["policy"]
    tasks = {t: {k: res[t][k] for k in ("successes", "episodes", "success_rate", "ci95")} for t in res}
    gui = [r["success_rate"] for t, r in tasks.items() if load_task(t).category in GUI_CATEGORIES]
    world = [r["success_rate"] for t, r in tasks.items() if load_task(t).category not in GUI_CATEGORIES]
    return {"tasks": tasks, "gui": sum(gui) / len(gui) if gui else float("nan"),
            "world": sum(world) / len(world) if world else float("nan")}


def format_rows(rows: dict[str, dict], expert: dict | None) -> str:
    tasks = list(next(iter(rows.values()))["tasks"])
    head = f"{'row':12s}" + "".join(f"{t:>26s}" for t in tasks) + f"{'GUI':>7s}{'world':>7s}"
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        cells = "".join(
            f"{c['successes']:>3d}/{c['episodes']:<3d}[{c['ci95'][0]:.2f},{c['ci95'][1]:.2f}]".rjust(26)
            for c in r["tasks"].values())
        lines.append(f"{name:12s}{cells}{r['gui']:7.2f}{r['world']:7.2f}")
    if expert:
        cells = "".join(f"{expert[t]['successes']:>3d}/{expert[t]['episodes']:<3d}".rjust(26) for t in tasks)
        lines.append(f"{'expert':12s}{cells}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    c = flags.FLAGS.config
    workdir = flags.FLAGS.workdir or c.workdir
    unknown = sorted(set(c.rows) - {name for name, *_ in ROWS})
    if unknown:
        raise app.UsageError(f"config.rows: unknown {unknown}; choose from {[n for n, *_ in ROWS]}")
    order = sorted(c.rows, key=lambda n: n != "full")  # the full row first: it records the shared data
    summaries, data = {}, None
    for name in order:
        _, rs_norm, dual_mouse = next(r for r in ROWS if r[0] == name)
        summaries[name] = train_row(c, workdir, name, rs_norm, dual_mouse, data)
        data = data or row_data(os.path.join(workdir, name))
    if c.world_knowledge:
        wk = c.world_knowledge_run or os.path.join(workdir, "world_knowledge")
        if not os.path.isdir(os.path.join(wk, "checkpoints")):
            with open(os.path.join(workdir, order[0], "config.json")) as f:
                base = json.load(f)["model"]["base"]
            _run(["experiments.world_knowledge", f"--workdir={wk}", f"--config.model.base={base}"])
        summaries["full_wk"] = train_row(c, workdir, "full_wk", True, True, data,
                                         (f"--config.init_from={wk}",))
    if c.rl_minutes > 0 and "full" in summaries:
        summaries["full_rl"] = rl_row(c, workdir)
    rows = {name: row_figures(s) for name, s in summaries.items()}
    expert = summaries.get("full", {}).get("results", {}).get("expert")
    print(format_rows(rows, expert))
    with open(os.path.join(workdir, "ablation.json"), "w") as f:
        json.dump({"rows": rows, "expert": expert, "seeds": summaries[order[0]]["seeds"]}, f, indent=2)
    nan = {"gui": float("nan"), "world": float("nan")}
    shared, full = rows.get("shared", nan), rows.get("full", nan)
    print(f"gui_shared={shared['gui']:.2f} gui_full={full['gui']:.2f} world_shared={shared['world']:.2f} "
          f"world_full={full['world']:.2f}")


def define_flags() -> None:
    define_config_and_workdir("ablation", "Ablation config.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
