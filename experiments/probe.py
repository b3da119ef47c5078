"""Which frames a trained policy looks at (``histeve_jax.eval.frame_probe``), on a run's demonstrations.

    python -m experiments.probe --run=<imitation workdir> --records=<records dir[,dir]> \
        [--task=craft_planks] [--gui_only] [--windows=24] [--init]

Prints, per frame slot (0 the oldest), how far the reply's token distributions move when that frame is
replaced by a black one and by the next window's, and the vision tower's spread over the windows, as one line:
``windows=<n> black_0=.. black_1=.. swap_0=.. swap_1=.. feature_spread=..``.
"""

from __future__ import annotations

import argparse

from flax import nnx

from histeve_jax.eval import frame_probe
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
    a = p.parse_args(argv)
    policy = load_run(a.run, a.step).policy
    if a.init:  # the same config, fresh weights: what training started from
        policy = Policy(policy.config, rngs=nnx.Rngs(0))
    spec = setup.feature_spec(RunSpec.from_config(_run_config(a.run), a.run), policy.config)
    windows = frame_probe.demo_windows(a.records.split(","), spec, task=a.task, gui_only=a.gui_only,
                                       limit=a.windows)
    print(frame_probe.probe(policy, spec, windows).summary())


if __name__ == "__main__":
    main()
