"""DAgger: the run's policy plays, the scripted expert takes over from the states it reached, retrain.

    python -m experiments.dagger --config.start_run=/tmp/histeve_runs/imitation_tiny --workdir=/tmp/dagger
    python -m experiments.dagger --config.tasks="('craft_planks',)" --config.rounds=3

Each round plays ``episodes`` episodes per task on the fleet (the expert takes over after a switch step
drawn per episode), keeps the expert's part of those it finished as records, and trains the run on for
``train_steps`` on the start run's demonstrations plus every round's records (``histeve_jax.train.dagger``).
Then the last round is evaluated closed loop on the held-out seeds (``eval``), beside the expert, and the
last line is the evaluation's headline. Rerun with the same workdir to resume after a kill.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments.config_cli import define_config_and_workdir


def train_round(init_from: str, workdir: str, train_dirs: list[str], steps: int) -> None:
    """Train ``steps`` steps from ``init_from``'s weights on ``train_dirs``, with that run's config (the start
    run's, carried from round to round)."""
    import ml_collections

    from histeve_jax.train.loop import train
    from histeve_jax.train.specs import RunSpec

    with open(os.path.join(init_from, "config.json")) as f:
        cfg = ml_collections.ConfigDict(json.load(f))
    cfg.init_from = init_from
    cfg.data.train_dirs = ",".join(train_dirs)
    cfg.num_train_steps = steps
    cfg.optimizer.total_steps = steps
    cfg.eval_every = cfg.checkpoint_every = steps
    if "eval" in cfg:
        cfg.eval.enabled = False
    train(RunSpec.from_config(cfg, workdir))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from histeve_jax.eval.evaluate import EvalSpec, evaluate, print_report
    from histeve_jax.train.dagger import DaggerSpec, run_dagger

    c = flags.FLAGS.config
    fields = {k: v for k, v in c.to_dict().items() if k not in ("eval", "workdir")}
    fields["workdir"] = flags.FLAGS.workdir or c.workdir
    fields["tasks"] = tuple(fields["tasks"])
    spec = DaggerSpec(**fields)
    if not os.path.exists(os.path.join(spec.start_run, "config.json")):
        raise app.UsageError(f"config.start_run={spec.start_run!r} is not a run's workdir (no config.json): "
                             "run python -m experiments.imitation first")
    run = run_dagger(spec, train_round)
    print(f"dagger: last round's run {run}")
    if c.eval.enabled:
        with open(os.path.join(run, "config.json")) as f:
            image_size = tuple(json.load(f)["data"]["image_size"])
        ev = {k: v for k, v in c.eval.to_dict().items() if k != "enabled"}
        ev.update(policy=run, obs_size=image_size, out_dir=ev.get("out_dir") or os.path.join(run, "eval"),
                  tasks=tuple(spec.tasks))
        print_report(evaluate(EvalSpec.from_config(ev)))


def define_flags() -> None:
    define_config_and_workdir("dagger", "DAgger config.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
