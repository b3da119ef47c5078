"""DAgger rounds over the fleet, the recorder's records and the train loop: play, relabel, retrain.

Round r: the current run's policy plays ``episodes`` episodes of each task on the fleet, the scripted
expert taking over at a switch step drawn per episode (``eval.takeover``); the expert's part of each
episode it finished is written as a demonstration (``takeover.expert_part``) under
``<workdir>/round_<r>/records``;
then the run is trained on for ``train_steps`` steps from the current weights (``init_from``) on the start
run's demonstrations plus every round's records so far, into ``<workdir>/round_<r>``, which the next round
plays. A round whose records or checkpoint already exist is not redone, so a killed run resumes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class DaggerSpec:
    """What DAgger starts from, how many rounds of how many episodes, and how long each retraining is."""

    start_run: str  # the imitation run whose policy plays first (its config is every round's base)
    workdir: str
    tasks: tuple[str, ...]
    rounds: int = 2
    episodes: int = 16  # per task and round
    seed: int = 2000  # round r plays seeds seed + r * episodes + i (apart from demos 0.. and eval 1000..)
    min_switch: int = 0  # the expert takes over after a number of policy steps drawn in [min, max]
    max_switch: int = 60
    max_steps: int = 0  # per episode; 0: the task's own budget
    train_steps: int = 500  # per round
    instances: int = 2
    temperature: float = 1.0
    env: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.rounds < 1 or self.episodes < 1 or self.train_steps < 1:
            raise ValueError(f"dagger: rounds ({self.rounds}), episodes ({self.episodes}) and train_steps "
                             f"({self.train_steps}) must be >= 1")
        if not 0 <= self.min_switch <= self.max_switch:
            raise ValueError(f"dagger: need 0 <= min_switch ({self.min_switch}) <= max_switch "
                             f"({self.max_switch})")


def round_dir(spec: DaggerSpec, r: int) -> str:
    return os.path.join(spec.workdir, f"round_{r}")


def collect(spec: DaggerSpec, run: str, r: int, out_dir: str) -> dict[str, Any]:
    """Play round ``r`` with ``run``'s policy and the expert taking over; write the expert parts of the
    episodes the expert finished to ``out_dir``. Returns per-task counts (``takeover.summary_row``)."""
    import shutil

    import ray

    from histeve_jax.data.records import ShardWriter
    from histeve_jax.eval.fleet import EpisodeSpec, Fleet
    from histeve_jax.eval.policy_agent import PolicyAgentFactory, PolicyServer
    from histeve_jax.eval.takeover import TakeoverFactory, expert_part, summary_row

    with open(os.path.join(run, "config.json")) as f:
        image_size = tuple(json.load(f)["data"]["image_size"])
    shutil.rmtree(out_dir + ".tmp", ignore_errors=True)  # a killed collection's partial records
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    first = spec.seed + r * spec.episodes
    specs = [EpisodeSpec(t, first + i, spec.max_steps or None)
             for t in spec.tasks for i in range(spec.episodes)]
    results: dict[str, list] = {t: [] for t in spec.tasks}
    kept = dict.fromkeys(spec.tasks, 0)
    server = ray.remote(num_cpus=0)(PolicyServer).remote(run, max_batch=spec.instances,
                                                         temperature=spec.temperature, seed=r)
    try:
        layout, _ = ray.get(server.layout.remote())
        factory = TakeoverFactory(PolicyAgentFactory(server, layout), spec.min_switch,
                                  spec.max_switch, seed=r)
        env_kwargs = {"obs_size": image_size, **dict(spec.env)}
        with Fleet(spec.instances, env_kwargs, run_kwargs={"kind": "eval"}) as fleet, \
                ShardWriter(out_dir + ".tmp", prefix=f"dagger-r{r}") as writer:
            for res in fleet.run(specs, factory):
                results[res.task].append(res)
                part = expert_part(res) if res.success else []
                if part:
                    writer.write_episode(part)
                    kept[res.task] += 1
    finally:
        ray.kill(server)
        if own_ray:
            ray.shutdown()
    os.replace(out_dir + ".tmp", out_dir)  # a round's records appear whole or not at all
    return {t: summary_row(results[t], kept[t]) for t in spec.tasks}


def run_dagger(spec: DaggerSpec, train_round: Callable[[str, str, list[str], int], None],
               log: Callable[[str], None] = print) -> str:
    """Run the rounds; returns the last round's run directory.

    ``train_round(init_from, workdir, train_dirs, steps)`` trains a run (the entry point builds it from the
    start run's config: ``experiments/dagger.py``).
    """
    from histeve_jax.train.checkpoint import Checkpointer

    os.makedirs(spec.workdir, exist_ok=True)
    with open(os.path.join(spec.start_run, "config.json")) as f:
        start = json.load(f)
    dirs = [d for d in str(start["data"]["train_dirs"]).split(",") if d.strip()]
    dirs = dirs or [os.path.join(spec.start_run, "data", "train")]
    run, rows = spec.start_run, []
    for r in range(spec.rounds):
        here = round_dir(spec, r)
        records = os.path.join(here, "records")
        if os.path.isdir(records):
            log(f"dagger round {r}: records already collected in {records}")
        else:
            os.makedirs(here, exist_ok=True)
            counts = collect(spec, run, r, records)
            rows.append({"round": r, "run": run, "tasks": counts})
            with open(os.path.join(here, "collect.json"), "w") as f:
                json.dump(rows[-1], f, indent=2)
            log(f"dagger round {r}: " + ", ".join(f"{t} kept {c['kept']}/{c['episodes']} (switch "
                                                  f"{c['mean_switch']:.0f})" for t, c in counts.items()))
        dirs.append(records)
        ckpts = os.path.join(here, "checkpoints")
        done = False
        if os.path.isdir(ckpts):
            with Checkpointer(ckpts, async_save=False) as ck:
                done = ck.latest_step() == spec.train_steps
        if not done:
            train_round(run, here, list(dirs), spec.train_steps)
        run = here
    return run
