"""Closed-loop evaluation of agents in the game: per task, success rate with a 95% Wilson interval and
mean steps over seeded held-out episodes, for a trained policy beside the scripted expert and a random
policy (uniform over the grammar's valid actions) on the same seeds.

``evaluate(spec)`` checks everything it can before any game starts (task names, experts, the policy's
workdir and checkpoint), runs the episodes on a ``Fleet`` (one game per Ray actor, the policy behind one
batching ``PolicyServer``), writes every episode in the record schema (``kind="eval"``, with the sampled
action tokens and their log-probabilities) under ``<out_dir>/records/<agent>``, an HTML report for the
first episodes of each task and agent, ``summary.json`` and TensorBoard scalars, and returns the summary.
Interrupted episodes (the game crashed or hung, after the fleet's retries) are counted apart and left out
of the rates.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from histeve_jax.envs.tasks import load_task

AGENTS = ("policy", "expert", "random")


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default); (0, 1) when n == 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def sampling_settings(greedy: bool, temperature: float, top_p: float, where: str) -> dict[str, Any]:
    """How a policy's actions are drawn, checked (ValueError naming ``where``) and as summaries record it."""
    if not 0 < top_p <= 1 or temperature < 0:
        raise ValueError(f"{where}: top_p ({top_p}) must be in (0, 1] and temperature ({temperature}) >= 0")
    return {"greedy": bool(greedy), "temperature": float(temperature), "top_p": float(top_p)}


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What to evaluate, on which held-out seeds, where the results go."""

    tasks: tuple[str, ...]
    episodes: int  # per task and agent
    seed: int  # episode i of a task resets with seed + i (held out: the recorder's seeds start at 0)
    agents: tuple[str, ...] = AGENTS
    policy: str = ""  # a run's workdir (needed for the "policy" agent)
    step: int | None = None  # its checkpoint (None: the latest)
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus sampling (1: the whole distribution)
    max_steps: int = 0  # per episode; 0: the task's own budget
    # Steps each episode plays on after its success check first holds (``rollout.run_episode``): the records
    # then show what the agent does once done (the completion detector's positives); mean steps count them.
    after_success: int = 0
    instances: int = 1  # games in parallel
    # (H, W) of the frames the agents see and the records keep; (): the policy run's image size (the frames it
    # was trained on; 56x56 without a policy)
    obs_size: tuple[int, ...] = ()
    out_dir: str = "/tmp/histeve_runs/evaluate"
    reports: int = 1  # HTML reports of the first episodes of each (task, agent)
    progress_bar: bool = True
    ray_address: str = ""  # "": a local Ray
    env: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # envs.make keywords
    codebook: str = "vpt"

    def __post_init__(self):
        unknown = sorted(set(self.agents) - set(AGENTS))
        if unknown:
            raise ValueError(f"eval agents {unknown} unknown; choose from {AGENTS}")
        if "policy" in self.agents and not self.policy:
            raise ValueError("eval: the 'policy' agent needs policy=<a run's workdir>")
        if self.after_success < 0:
            raise ValueError(f"eval: after_success ({self.after_success}) must be >= 0")
        if self.episodes < 1 or self.instances < 1:
            raise ValueError(f"eval: episodes ({self.episodes}) and instances ({self.instances}) must be "
                             ">= 1")
        if self.obs_size and (len(self.obs_size) != 2 or min(self.obs_size) < 1):
            raise ValueError(f"eval: obs_size {tuple(self.obs_size)} must be (H, W), or () for the policy's")
        sampling_settings(self.greedy, self.temperature, self.top_p, "eval")

    @classmethod
    def from_config(cls, c: Any, **over: Any) -> EvalSpec:
        """From an ``experiments/configs/evaluate.py``-style ConfigDict (its fields are this class's)."""
        names = {f.name for f in dataclasses.fields(cls)}
        given = dict(c.to_dict() if hasattr(c, "to_dict") else c)
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"config: unknown eval field(s) {unknown}; known: {sorted(names)}")
        given.update(over)
        given["tasks"] = tuple(given["tasks"])
        given["agents"] = tuple(given.get("agents", AGENTS))
        given["obs_size"] = tuple(int(v) for v in given.get("obs_size", ()))
        if given.get("step") in (-1, ""):
            given["step"] = None
        return cls(**given)


def check(spec: EvalSpec) -> Any:
    """Everything that can be wrong before a game starts: unknown tasks, tasks without an expert, a policy
    workdir without a (matching) checkpoint. Returns the loaded policy (or None)."""
    from histeve_jax.envs.experts import expert_for

    names = []
    for name in spec.tasks:
        task = load_task(name)  # TaskError names an unknown task
        names.append(task.name)
        if "expert" in spec.agents:
            try:
                expert_for(task)
            except (KeyError, ValueError) as e:
                raise ValueError(f"eval task {name!r}: no scripted expert ({e})") from e
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # results go by task name: two entries of one name would be pooled under it
        raise ValueError(f"eval tasks {tuple(spec.tasks)}: {twice} given more than once (a task and its "
                         "variant or file are evaluated in runs of their own)")
    if "policy" in spec.agents:
        from histeve_jax.eval.policy_agent import load_run

        return load_run(spec.policy, spec.step)
    return None


def frame_size(spec: EvalSpec, loaded: Any) -> tuple[int, int]:
    """(H, W) the games render at: ``spec.obs_size``, else the loaded policy's image size, else 56x56."""
    if spec.obs_size:
        return tuple(int(v) for v in spec.obs_size)
    return tuple(int(v) for v in loaded.config.image_size) if loaded is not None else (56, 56)


def _row(results: Sequence[Any]) -> dict[str, Any]:
    done = [r for r in results if not r.interrupted]
    k = sum(r.success for r in done)
    lo, hi = wilson_interval(k, len(done))
    return {
        "episodes": len(done), "successes": k, "success_rate": k / len(done) if done else 0.0,
        "ci95": [lo, hi], "mean_steps": sum(r.steps for r in done) / len(done) if done else 0.0,
        "mean_progress": sum(r.progress for r in done) / len(done) if done else 0.0,
        "interrupted": len(results) - len(done), "seeds": [r.seed for r in done],
        "success_by_seed": {str(r.seed): bool(r.success) for r in done},
    }


def format_table(summary: Mapping[str, Any]) -> str:
    """The per-task table: for each agent, successes / episodes, the rate, its 95% interval, mean steps."""
    agents = list(summary["agents"])
    head = f"{'task':24s}" + "".join(f"{a + ' success (95% CI)':>34s}{'steps':>7s}" for a in agents)
    lines = [head, "-" * len(head)]
    for task in summary["tasks"]:
        cells = []
        for a in agents:
            r = summary["results"][a][task]
            lo, hi = r["ci95"]
            cells.append(f"{r['successes']:>3d}/{r['episodes']:<3d} {r['success_rate']:5.2f} "
                         f"[{lo:4.2f}, {hi:4.2f}]".rjust(34) + f"{r['mean_steps']:7.0f}")
        lines.append(f"{task:24s}" + "".join(cells))
    return "\n".join(lines)


def evaluate(spec: EvalSpec, loaded: Any = None) -> dict[str, Any]:
    """Run the evaluation described by ``spec`` (module docstring); returns the summary."""
    import ray
    from tqdm import tqdm

    from histeve_jax.data.records import ShardWriter
    from histeve_jax.eval import report as report_lib
    from histeve_jax.eval.fleet import EpisodeSpec, Fleet
    from histeve_jax.eval.rollout import expert_agent, random_agent

    loaded = loaded if loaded is not None else check(spec)
    os.makedirs(spec.out_dir, exist_ok=True)
    own_ray = not ray.is_initialized()
    if own_ray:
        kw = {"address": spec.ray_address} if spec.ray_address else {
            "num_cpus": os.cpu_count(), "include_dashboard": False}
        with warnings.catch_warnings():  # Ray's fork is an exec of its own processes, not a JAX program
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
            ray.init(logging_level="ERROR", log_to_driver=False, **kw)
    env_kwargs = {"obs_size": frame_size(spec, loaded), **dict(spec.env)}
    names = [load_task(t).name for t in spec.tasks]  # a task may be given by its file's path or a variant
    summary: dict[str, Any] = {"tasks": names, "agents": list(spec.agents), "results": {},
                               "seeds": [spec.seed + i for i in range(spec.episodes)],
                               "policy": spec.policy, "out_dir": spec.out_dir, "reports": [],
                               "sampling": sampling_settings(spec.greedy, spec.temperature, spec.top_p,
                                                             "eval"),
                               "obs_size": list(env_kwargs["obs_size"]), "after_success": spec.after_success}
    specs = [EpisodeSpec(t, spec.seed + i, spec.max_steps or None) for t in spec.tasks
             for i in range(spec.episodes)]
    bar = tqdm(total=len(specs) * len(spec.agents), desc="evaluate", unit="ep", disable=not spec.progress_bar,
               dynamic_ncols=True)
    server = None
    try:
        with Fleet(spec.instances, env_kwargs, address=spec.ray_address or None,
                   run_kwargs={"kind": "eval", "after_success": spec.after_success}) as fleet:
            for agent in spec.agents:
                if agent == "policy":
                    from histeve_jax.eval.policy_agent import PolicyAgentFactory, PolicyServer

                    server = ray.remote(num_cpus=0)(PolicyServer).remote(
                        spec.policy, loaded.step, max_batch=spec.instances, greedy=spec.greedy,
                        temperature=spec.temperature, top_p=spec.top_p)
                    layout, summary["policy_checkpoint"] = ray.get(server.layout.remote())
                    factory = PolicyAgentFactory(server, layout)
                elif agent == "expert":
                    factory = expert_agent
                else:
                    factory = functools.partial(random_agent, codebook=spec.codebook)
                results: dict[str, list] = {t: [] for t in names}
                with ShardWriter(os.path.join(spec.out_dir, "records", agent), prefix=f"eval-{agent}") as w:
                    for res in fleet.run(specs, factory):
                        results[res.task].append(res)
                        if res.records:
                            w.write_episode(res.records)
                        if res.records and len(results[res.task]) <= spec.reports:
                            name = f"{agent}_{res.task}_{res.seed}.html"
                            path = os.path.join(spec.out_dir, "reports", name)
                            report_lib.write_report(
                                res.records, path, title=f"{agent}: {res.task} seed {res.seed}",
                                summary={"agent": agent, "task": res.task, "seed": res.seed,
                                         "success": res.success, "steps": res.steps})
                            summary["reports"].append(path)
                        bar.update(1)
                        bar.set_postfix(agent=agent, task=res.task)
                summary["results"][agent] = {t: _row(sorted(rs, key=lambda r: r.seed))
                                             for t, rs in results.items()}
                if server is not None:
                    summary["policy_server"] = ray.get(server.stats.remote())
                    ray.kill(server)
                    server = None
    finally:
        bar.close()
        if server is not None:
            ray.kill(server)
        if own_ray and ray.is_initialized():
            ray.shutdown()
    _write_summary(spec, summary)
    return summary


def print_report(summary: Mapping[str, Any]) -> None:
    """Print the table, where the results are, and the headline line (the entry points' output)."""
    h = summary["headline"]
    print(format_table(summary))
    print(f"results: {summary['out_dir']}/summary.json; episode reports: {summary['out_dir']}/reports/")
    print(f"tasks={h['tasks']} mean_success={h['mean_success']:.2f} tasks_over_half={h['tasks_over_half']} "
          f"expert_mean={h['expert_mean']:.2f} min_success={h['min_success']:.2f}")


def headline(summary: Mapping[str, Any]) -> dict[str, float]:
    """tasks, mean_success (policy), tasks_over_half (policy rate > 0.5), expert_mean, min_success (the
    policy's lowest task)."""
    res = summary["results"]
    tasks = summary["tasks"]
    pol = [res["policy"][t]["success_rate"] for t in tasks] if "policy" in res else []
    exp = [res["expert"][t]["success_rate"] for t in tasks] if "expert" in res else []
    return {"tasks": len(tasks), "mean_success": sum(pol) / len(pol) if pol else float("nan"),
            "tasks_over_half": sum(p > 0.5 for p in pol), "expert_mean": sum(exp) / len(exp) if exp
            else float("nan"), "min_success": min(pol) if pol else float("nan")}


def _write_summary(spec: EvalSpec, summary: dict[str, Any]) -> None:
    from clu import metric_writers

    summary["headline"] = headline(summary)
    path = os.path.join(spec.out_dir, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)
    writer = metric_writers.create_default_writer(os.path.join(spec.out_dir, "tb"), just_logging=False)
    scalars = {f"eval/{a}/{t}/success_rate": r["success_rate"] for a, rows in summary["results"].items()
               for t, r in rows.items()}
    scalars.update({f"eval/{a}/{t}/mean_steps": r["mean_steps"] for a, rows in summary["results"].items()
                    for t, r in rows.items()})
    scalars.update({f"eval/{k}": float(v) for k, v in summary["headline"].items()})
    writer.write_scalars(0, scalars)
    writer.close()
