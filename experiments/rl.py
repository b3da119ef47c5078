"""Stage 3: RL from branch groups in the game, from the imitation run, evaluated before and after.

    python -m experiments.rl                                   # tiny: Luanti on CPU, ~30 minutes in all
    python -m experiments.rl --config.task=build_wall --config.train_minutes=5
    python -m experiments.rl --config=experiments/configs/rl.py:qwen7b --config.role=learner   # TPU workers
    python -m experiments.rl --config=experiments/configs/rl.py:qwen7b --config.role=actors \
        --config.ray_address=auto --config.task=craft_planks                                 # Ray head
    python -m experiments.rl --config=experiments/configs/rl.py:rehearsal   # the pod topology, here

Starts from ``config.start_run`` (the imitation main job; run first when it has no checkpoint), picks the
weakest atomic task of its evaluation that the policy completes at all (``rl.driver.weakest_task``; or
``config.task``), evaluates it on held-out seeds, trains with branch groups for ``config.train_minutes``
(learner in its own process, games on a local Ray), evaluates again on the same seeds. The last line:
``task=... success_before=... success_after=... groups=... skipped_groups=... max_policy_lag=...``.
The rehearsal (``histeve_jax.rl.rehearsal``) ends with ``learner_processes=2 weight_max_diff=<x>
resume_exact=<0|1> actor_node_killed_survived=<0|1> server_killed_survived=<0|1>``.
The library is ``histeve_jax.rl``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from absl import app, flags

from experiments.config_cli import define_config

define_config(os.path.join(os.path.dirname(__file__), "configs", "rl.py:tiny"), "RL config.")


def _ensure_start_run(path: str) -> None:
    """The tiny imitation main job, run first when ``path`` holds no evaluated checkpoint."""
    if os.path.exists(os.path.join(path, "eval", "summary.json")):
        return
    print(f"no evaluated imitation run at {path}: running python -m experiments.imitation first", flush=True)
    subprocess.run([sys.executable, "-m", "experiments.imitation", f"--workdir={path}"], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from absl import logging

    from histeve_jax.rl.driver import run_rl

    logging.set_verbosity(logging.WARNING)
    c = flags.FLAGS.config
    if c.role == "learner":  # the learner alone (a pod slice): until the actors write DONE
        from histeve_jax.rl.driver import resolve, run_learner

        rl, _, _, cfg = resolve(c)
        run_learner(cfg.to_json_best_effort(), rl)
        return
    if c.role == "actors":  # the actors alone (a Ray cluster): until train_minutes have passed
        import time

        from histeve_jax.rl.driver import resolve, run_actors

        rl, task, learner_dir, cfg = resolve(c)
        s = run_actors(c, rl, task, learner_dir, cfg.data.image_size, time.monotonic() + 60 * c.train_minutes)
        print(f"task={task} groups={s['groups']} written={s['written']} skipped_groups={s['skipped']} "
              f"dropped={s['dropped']} successes={s['successes']}")
        return
    if c.role == "rehearsal":
        from histeve_jax.rl.rehearsal import run_rehearsal

        r = run_rehearsal(c)
        print(f"rehearsal: {r['actors']['written']} groups written, {r['actors']['dropped']} dropped; "
              f"faults {r['faults']}; learner samples/s {r['learner_samples_per_s_1']:.1f} (1 process), "
              f"{r['learner_samples_per_s_2']:.1f} ({r['learner_processes']} processes); act calls/s per "
              f"replica {[round(x, 1) for x in r['act_calls_per_s_per_replica']]}; {r['total_s']:.0f} s; "
              f"{os.path.join(c.workdir, 'rehearsal.json')}")
        print(f"learner_processes={r['learner_processes']} weight_max_diff={r['weight_max_diff']:.3g} "
              f"resume_exact={r['resume_exact']} "
              f"actor_node_killed_survived={r['actor_node_killed_survived']} "
              f"server_killed_survived={r['server_killed_survived']}")
        return
    if c.role != "all":
        raise app.UsageError(f"config.role={c.role!r}: one of all, learner, actors, rehearsal")
    _ensure_start_run(c.start_run)
    s = run_rl(c)
    b, a, act = s["before"], s["after"], s["actors"]
    print(f"before: {b['successes']}/{b['episodes']}  after: {a['successes']}/{a['episodes']}  "
          f"(seeds {c.eval.seed}..{c.eval.seed + c.eval.episodes - 1}); learner steps {s['learner_step']}; "
          f"groups written {act['written']}, dropped {act['dropped']}; branches {act['branches']} "
          f"({act['successes']} successes); summary {os.path.join(c.workdir, 'rl_summary.json')}")
    lag = s["learner"].get("max_policy_lag", 0)
    print(f"task={s['task']} success_before={b['success_rate']:.2f} success_after={a['success_rate']:.2f} "
          f"groups={act['groups']} skipped_groups={act['skipped']} max_policy_lag={lag}")


if __name__ == "__main__":
    app.run(main)
