"""Which frames a trained policy looks at (``histeve_jax.eval.frame_probe``), on a run's demonstrations.

    python -m experiments.probe --run=<imitation workdir> --records=<records dir[,dir]> \
        [--task=craft_planks] [--gui_only] [--windows=24] [--init]

Prints, per frame slot (0 the oldest), how far the reply's token distributions move when that frame is
replaced by a black one and by the next window's, and the vision tower's spread over the windows, as one line:
``windows=<n> black_0=.. black_1=.. swap_0=.. swap_1=.. feature_spread=..``.

    python -m experiments.probe --run=<workdir> --records=<fit dir[,dir]> --eval_records=<dir[,dir]> \
        --task=mine_log --inventory_item=default:tree [--crop=84,112,14,154 --scale=2]

With ``--inventory_item``: whether the policy's vision tower sees that item held (``eval.inventory_probe``,
a logistic probe fit on ``--records``' episodes and scored on ``--eval_records``'), as one line:
``fit=<n> scored=<n> held=.. train_acc=.. eval_acc=.. balanced_acc=..``.
"""

from __future__ import annotations

import argparse

from flax import nnx

from histeve_jax.data.image_processing import parse_crop
from histeve_jax.eval import frame_probe, inventory_probe
from histeve_jax.eval.policy_agent import _run_config, load_run
from histeve_jax.policy import Policy
from histeve_jax.train import setup
from histeve_jax.train.specs import RunSpec


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="an imitation (or RL) run's workdir")
    p.add_argument("--records", required=True, help="comma-separated record directories")
    p.add_argument("--task", default=None)
    p.add_argument("--gui_only", action="store_true")
    p.add_argument("--windows", type=int, default=24)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--init", action="store_true", help="probe the run's policy at random initialisation")
    p.add_argument("--inventory_item", default="", help="probe the tower for this item held instead")
    p.add_argument("--eval_records", default="", help="the inventory probe's scored records")
    p.add_argument("--crop", default="", help="top,bottom,left,right pixels of each frame to probe")
    p.add_argument("--scale", type=float, default=1.0, help="the crop's resize factor")
    a = p.parse_args(argv)
    policy = load_run(a.run, a.step).policy
    if a.init:  # the same config, fresh weights: what training started from
        policy = Policy(policy.config, rngs=nnx.Rngs(0))
    if a.inventory_item:
        if not (a.task and a.eval_records):
            p.error("--inventory_item needs --task and --eval_records")
        try:
            crop = parse_crop(a.crop, "--crop")
        except ValueError as e:
            p.error(str(e))
        got = inventory_probe.run_probe(policy, a.records.split(","), a.eval_records.split(","), a.task,
                                        a.inventory_item, crop=crop, scale=a.scale)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in got.items()))
        return
    spec = setup.feature_spec(RunSpec.from_config(_run_config(a.run), a.run), policy.config)
    windows = frame_probe.demo_windows(a.records.split(","), spec, task=a.task, gui_only=a.gui_only,
                                       limit=a.windows)
    print(frame_probe.probe(policy, spec, windows).summary())


if __name__ == "__main__":
    main()
