"""Train the completion detector and report it on held-out episodes; or plan its 3B step.

    python -m experiments.detector                                   # tiny: CPU, minutes
    python -m experiments.detector --config.detector.records=/tmp/det_rec/records --workdir=/tmp/det
    python -m experiments.detector --config=experiments/configs/detector.py:qwen3b --plan

The run: expert records (given, or recorded from Luanti), the policy's closed-loop evaluation episodes,
(``detector.rollout_episodes``) its own rollouts played on past success and (``detector.harness_episodes``)
its own invocations through the harness, each a unit from its own start, are split by episode into
train / validation / test; a Hugging Face Qwen2.5-VL directory (tiny: a random 3B-style one written here)
is FFN-pruned into the detector; the shared train loop trains it beside the frozen policy; the threshold
is calibrated on validation (best F1), the loop's threshold on the validation episodes' replays
(``detector.loop_rule``), and the test split is scored. Writes ``detector_report.json``; the library is
``histeve_jax.detector``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from typing import Any

from absl import app, flags

from experiments.config_cli import define_config

_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def policy_of(cfg: Any) -> tuple[Any, Any, int]:
    """(policy config, ``load_policy`` or None, the policy's frame stride): the trained run's, or a random
    tiny policy (one past frame, 4 steps back, as the tiny imitation run)."""
    d, t = cfg.detector, cfg.train
    if d.policy:
        from histeve_jax.eval.policy_agent import load_run

        loaded = load_run(d.policy)
        return loaded.config, (lambda: loaded.policy), loaded.stride
    from histeve_jax.policy import tiny_config

    return tiny_config(history_frames=1, image_size=tuple(t.data.image_size)), None, 4


def template_of(cfg: Any, policy_config: Any, cross_attention_every: int | None = None) -> Any:
    """The detector config (its base is replaced by the pruned Hugging Face shape)."""
    from histeve_jax.data.image_processing import parse_crop
    from histeve_jax.detector.config import DetectorConfig, qwen3b_config, tiny_base

    d = cfg.detector
    kw = dict(cross_attention_every=d.cross_attention_every if cross_attention_every is None
              else cross_attention_every, history_frames=d.history_frames, stride=d.stride,
              anchor=bool(d.anchor), detail=parse_crop(d.detail, "detector.detail"),
              detail_scale=int(d.detail_scale), max_len=d.max_len, policy_max_len=d.policy_max_len)
    if cfg.variant == "qwen3b":
        return qwen3b_config(d.ffn_keep, d.multiple_of, **kw)
    pc = policy_config.model_config
    return DetectorConfig(base=tiny_base(), policy_hidden_size=pc.text.hidden_size, policy_vision=pc.vision,
                          image_size=tuple(policy_config.image_size), **kw)


def run_spec(cfg: Any, workdir: str, **data: Any) -> Any:
    from histeve_jax.train.specs import RunSpec

    spec = RunSpec.from_config(cfg.train, workdir)
    return dataclasses.replace(spec, data=dataclasses.replace(spec.data, **data)) if data else spec


def source_records(cfg: Any, workdir: str) -> list[str]:
    """Expert record dirs (given, or recorded now) and the policy's evaluation records when there are."""
    from histeve_jax.train.specs import dir_list

    d = cfg.detector
    dirs = list(dir_list(d.records))
    if not dirs:
        out = os.path.join(workdir, "records")
        if not os.path.isdir(out):
            h, w = cfg.train.data.image_size
            cmd = [sys.executable, "-m", "experiments.record", f"--config={_CONFIGS}/record.py",
                   f"--workdir={os.path.join(workdir, 'record_run')}", f"--config.output_dir={out}",
                   f"--config.tasks={tuple(d.record_tasks)!r}", f"--config.episodes={d.record_episodes}",
                   f"--config.obs_size=({h}, {w})", "--config.instances=2", "--config.progress_bar=False",
                   f"--config.after_success={d.record_after_success}"]
            subprocess.run(cmd, check=True, cwd=_REPO, timeout=1800)
        dirs = [out]
    evald = os.path.join(d.policy, "eval", "records", "policy") if d.eval_records == "auto" and d.policy \
        else d.eval_records if d.eval_records != "auto" else ""
    dirs += [x for x in dir_list(evald) if os.path.isdir(x)]
    return dirs + policy_rollouts(cfg, workdir) + harness_rollouts(cfg, workdir)


def policy_rollouts(cfg: Any, workdir: str) -> list[str]:
    """The policy's own rollouts of ``record_tasks`` (``rollout_episodes`` each, except where
    ``rollout_task_episodes`` says): ``experiments.evaluate`` on the rollout seeds, played on
    ``rollout_after_success`` steps past success, one evaluation per episode count under
    ``workdir/rollouts/<n>_per_task``; their records' directories (none when every count is 0). Made once:
    a finished evaluation (its ``summary.json``) is reused."""
    from experiments.config_cli import task_counts

    d = cfg.detector
    counts = task_counts(tuple(d.record_tasks), d.rollout_episodes, d.rollout_task_episodes,
                         "detector.rollout_task_episodes")
    groups: dict[int, list[str]] = {}
    for task, n in counts.items():
        if n:
            groups.setdefault(n, []).append(task)
    if groups and not d.policy:
        raise ValueError("detector.rollout_episodes needs detector.policy (the run whose rollouts they are)")
    dirs = []
    for n, tasks in sorted(groups.items()):
        out = os.path.join(workdir, "rollouts", f"{n}_per_task")
        if not os.path.exists(os.path.join(out, "summary.json")):
            shutil.rmtree(out, ignore_errors=True)  # cut off part way: its episodes would be written twice
            cmd = [sys.executable, "-m", "experiments.evaluate", f"--config={_CONFIGS}/evaluate.py:tiny",
                   f"--config.policy={d.policy}", f"--config.tasks={tuple(tasks)!r}",
                   "--config.agents=('policy',)", f"--config.episodes={n}",
                   f"--config.seed={d.rollout_seed}", f"--config.max_steps={d.rollout_max_steps}",
                   f"--config.after_success={d.rollout_after_success}",
                   f"--config.temperature={d.rollout_temperature}", f"--config.top_p={d.rollout_top_p}",
                   "--config.reports=0", f"--config.out_dir={out}", "--config.progress_bar=False",
                   f"--config.instances={min(2, n * len(tasks))}"]  # no more games than episodes
            subprocess.run(cmd, check=True, cwd=_REPO, timeout=3600)
        dirs.append(os.path.join(out, "records", "policy"))
    return dirs


def harness_rollouts(cfg: Any, workdir: str) -> list[str]:
    """The policy's own invocations through the harness (``harness_episodes`` per harness task; none when
    0): ``experiments.longhorizon`` with the privileged check held ``harness_after`` steps past each
    subtask's completion, records labelled per invocation, under ``workdir/harness``; their records'
    directory. Made once: a finished suite (its ``summary.json``) is reused, one cut off resumes."""
    d = cfg.detector
    if d.harness_episodes <= 0:
        return []
    if not d.policy:
        raise ValueError("detector.harness_episodes needs detector.policy (whose invocations they are)")
    out = os.path.join(workdir, "harness")
    if not os.path.exists(os.path.join(out, "summary.json")):
        cmd = [sys.executable, "-m", "experiments.longhorizon", f"--config={_CONFIGS}/longhorizon.py:tiny",
               f"--config.policy={d.policy}", f"--config.tasks={tuple(d.harness_tasks)!r}",
               "--config.executors=('policy',)", f"--config.episodes={d.harness_episodes}",
               f"--config.seed={d.harness_seed}", f"--config.policy_max_steps={d.harness_max_steps}",
               "--config.completion=privileged", f"--config.privileged_after={d.harness_after}",
               "--config.goal_only=False", "--config.unit_steps=True", "--config.records=True",
               "--config.resume=True", f"--config.temperature={d.rollout_temperature}",
               f"--config.top_p={d.rollout_top_p}", "--config.reports=0", f"--config.out_dir={out}"]
        subprocess.run(cmd, check=True, cwd=_REPO, timeout=4 * 3600)
    return [os.path.join(out, "records", "policy")]


def pruned_detector(cfg: Any, template: Any, workdir: str) -> tuple[str, Any]:
    """(the pruned detector's directory, its config): pruned from ``hf_source`` (tiny: a random 3B-style
    Hugging Face directory written under the workdir) unless ``detector.pruned`` names one."""
    from histeve_jax.detector import prune

    d = cfg.detector
    if d.pruned:
        return d.pruned, prune.read_config(d.pruned)
    src = d.hf_source
    if not src:
        import jax.numpy as jnp
        from flax import nnx

        from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLModel, save_hf

        src = os.path.join(workdir, "hf_base")
        if not os.path.exists(os.path.join(src, "config.json")):
            save_hf(Qwen2_5_VLModel(template.base.replace(dtype=jnp.float32), rngs=nnx.Rngs(7)), src)
    out = os.path.join(workdir, f"pruned_x{template.cross_attention_every}")
    detector, kept = prune.prune_hf(src, template, keep=d.ffn_keep, multiple_of=d.multiple_of)
    prune.save_detector(detector, out, kept)
    return out, detector.config


def eval_options(cfg: Any, seed: int) -> Any:
    """How validation and test queries are drawn: ``detector.eval_subtasks`` False scores the task units
    only (the atomic subtasks the harness invokes and the loop ends), not the expert's phases (aim, dig)."""
    from histeve_jax.detector.stage import QueryOptions

    d = cfg.detector
    return QueryOptions(d.per_unit, d.post_window, d.eval_subtasks, seed)


def run(cfg: Any, workdir: str, *, cross_attention_every: int | None = None, log: Any = print) -> dict:
    """Split, prune, train, calibrate on validation, score the test split; returns the report."""
    from histeve_jax.data import pipeline
    from histeve_jax.detector import data as data_lib
    from histeve_jax.detector import prune
    from histeve_jax.detector.inputs import QueryInputs
    from histeve_jax.detector.loss import binary_metrics, calibrate_threshold
    from histeve_jax.detector.model import parameter_count
    from histeve_jax.detector.predict import load_trained, predict
    from histeve_jax.detector.stage import QueryOptions, detector_stage, queries_of
    from histeve_jax.train.loop import train

    d = cfg.detector
    os.makedirs(workdir, exist_ok=True)
    sources = source_records(cfg, workdir)
    splits = [os.path.join(workdir, "data", s) for s in ("train", "val", "test")]
    if not all(os.path.isdir(s) for s in splits):
        n = data_lib.write_splits(sources, splits, tuple(d.splits), d.split_seed)
        log(f"episodes: train {n[0]}, validation {n[1]}, test {n[2]} (from {sources})")
    policy_config, load_policy, stride = policy_of(cfg)
    template = template_of(cfg, policy_config, cross_attention_every).replace(policy_stride=stride)
    pruned_dir, det_config = pruned_detector(cfg, template, workdir)
    run_dir = os.path.join(workdir, f"run_x{det_config.cross_attention_every}")
    spec = run_spec(cfg, run_dir, train_dirs=(splits[0],), eval_dirs=(splits[1],))
    options = QueryOptions(d.per_unit, d.post_window, d.subtasks, spec.data.seed, d.start_jitter,
                           bool(d.resume_units))
    scored = eval_options(cfg, spec.data.seed)  # validation and test: the task units, from the first step
    stage = detector_stage(spec, det_config, policy_config, load_policy=load_policy, detector_dir=pruned_dir,
                           queries=options)
    phases = dataclasses.replace(scored, subtasks=d.subtasks)  # the test with the expert's phases too
    sets = {"train": (splits[0], options), "val": (splits[1], scored), "test": (splits[2], scored),
            "test_phases": (splits[2], phases)}
    counts = {name: data_lib.label_counts(queries_of([s], det_config, policy_config, o)[1])
              for name, (s, o) in sets.items()}
    log(f"queries: {counts}")
    history = train(spec, stage)
    module = load_trained(spec, stage)
    scores = {}
    one_pass = pipeline.LoaderOptions(batch_size=1, shuffle=False, num_epochs=1, shard_index=0, shard_count=1)
    for name in ("val", "test", "test_phases"):
        # One query per batch: every query scored (a batch iterator drops a last partial batch).
        shards, qs = queries_of([sets[name][0]], det_config, policy_config, sets[name][1])
        inputs = QueryInputs(det_config, policy_config, spec.data.tokenizer_path or None)
        scores[name] = predict(module, data_lib.make_batches(shards, qs, inputs, one_pass))
    threshold = calibrate_threshold(*scores["val"])
    report = {"cross_attention_every": det_config.cross_attention_every, "threshold": threshold,
              "validation": binary_metrics(*scores["val"], threshold),
              "test": binary_metrics(*scores["test"], threshold),
              "test_phases": binary_metrics(*scores["test_phases"], threshold), "queries": counts,
              "parameters": parameter_count(det_config), "pruned_dir": pruned_dir, "run_dir": run_dir,
              "final_loss": history[max(history)].get("loss") if history else None}  # None: resumed done
    curves, tasks = loop_curves(cfg, report, splits[1], module, with_tasks=True)
    report.update(loop_calibration(curves, tasks, d))
    path = os.path.join(run_dir, "detector_report.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
    # The run describes itself (the export reads it): the pruned directory's config is the backbone's, and
    # runs with and without cross-attention share that directory.
    with open(os.path.join(run_dir, prune.CONFIG_FILE), "w") as f:
        json.dump(prune.config_to_dict(det_config), f, indent=2, default=str)
    return report


def loop_calibration(curves: list, tasks: list[str], d: Any) -> dict[str, Any]:
    """The report's loop fields from the validation replays (``loop_curves``) and their tasks.

    ``loop_threshold``: the loop's own threshold under the stop rule (``d.consecutive`` queries in a row at
    or over it), by ``d.loop_rule`` (``monitor.loop_threshold``): the lowest that ends at most
    ``d.max_early`` of the replays early, or the one with the fewest early and missed stops; what the
    harness uses. With ``d.per_task_thresholds``, ``loop_thresholds``: one per task by the same rule from its
    own replays (a subtask of that task is held to it). ``loop_validation``: how the replays end at the
    thresholds the harness will use, in all and by task."""
    from histeve_jax.detector.monitor import loop_stops, loop_threshold, loop_thresholds

    rule = (d.consecutive, d.max_early, d.loop_rule, d.early_cost)
    out: dict[str, Any] = {"loop_threshold": loop_threshold(curves, *rule), "max_early": d.max_early,
                           "loop_rule": d.loop_rule, "early_cost": d.early_cost}
    by_task = loop_thresholds(curves, tasks, *rule) if d.per_task_thresholds else {}
    if by_task:
        out["loop_thresholds"] = by_task
    stops: dict[str, dict] = {}
    for t in sorted(set(tasks)):
        mine = [c for c, k in zip(curves, tasks, strict=True) if k == t]
        stops[t] = loop_stops(mine, by_task.get(t, out["loop_threshold"]), d.consecutive)
    total = {"episodes": 0, "early": 0, "missed": 0, "delays": []}
    for s in stops.values():
        for key in total:
            total[key] += s[key]
    out["loop_validation"] = loop_summary(total)
    out["loop_validation_by_task"] = {t: loop_summary(s) for t, s in stops.items()}
    return out


def loop_summary(stops: dict) -> dict:
    """``monitor.loop_stops``' counts with the stops on time and their mean delay in place of the delays."""
    delays = stops["delays"]
    return {"episodes": stops["episodes"], "early": stops["early"], "missed": stops["missed"],
            "on_time": len(delays), "mean_delay": sum(delays) / len(delays) if delays else None}


def loop_curves(cfg: Any, report: dict, split_dir: str, module: Any = None,
                with_tasks: bool = False) -> Any:
    """Each episode of ``split_dir`` replayed frame by frame through ``CompletionMonitor`` (a query every
    ``monitor_every`` steps, never stopping) as ``detector.data.replays`` says: on its task from its first
    step, with ``detector.loop_resume_units`` also from each of its resume units' first steps, and a harness
    episode's each invocation from its own first step to its last: (query steps, probabilities, the step
    whose check first holds, counted from the replay's start, None when it never does). ``module``: the
    trained detector (else the report's run is restored). ``with_tasks``: (the curves, each one's task id:
    an invocation's atomic task)."""
    from histeve_jax.data import records as R
    from histeve_jax.detector import data as data_lib
    from histeve_jax.detector.inputs import QueryInputs
    from histeve_jax.detector.monitor import CompletionMonitor, MonitorOptions
    from histeve_jax.detector.predict import load_trained
    from histeve_jax.detector.prune import read_config
    from histeve_jax.detector.stage import detector_stage

    policy_config, load_policy, _ = policy_of(cfg)
    det_config = read_config(report["pruned_dir"])
    spec = run_spec(cfg, report["run_dir"])
    if module is None:
        module = load_trained(spec, detector_stage(spec, det_config, policy_config, load_policy=load_policy))
    d = cfg.detector
    opts = MonitorOptions(threshold=2.0, every=d.monitor_every, consecutive=d.consecutive)  # never stops
    monitor = CompletionMonitor(module, QueryInputs(det_config, policy_config), opts)
    episodes: dict[str, list] = {}
    for path in R.shard_paths(split_dir):
        for r in R.read_shard(path):
            episodes.setdefault(r.episode_id, []).append(r)
    out, tasks = [], []
    for eid in sorted(episodes):
        recs = episodes[eid]
        frames = [R.decode_frame(r.frame) for r in recs]
        for rp in data_lib.replays([data_lib.step_of(r, i) for i, r in enumerate(recs)],
                                   resume=bool(d.loop_resume_units)):
            monitor.reset(rp.instruction, int(recs[rp.start].is_gui_open))
            for r, frame in zip(recs[rp.start:rp.end], frames[rp.start:rp.end], strict=True):
                # the record's regime, as the env's info gives it in the loop (the RS-Norm row of the query)
                monitor.observe(frame, {"is_gui_open": r.is_gui_open})
            out.append(([s for s, _ in monitor.curve], [p for _, p in monitor.curve], rp.done))
            tasks.append(rp.task)
    return (out, tasks) if with_tasks else out


def plan(cfg: Any) -> dict:
    """Compile the detector's step (the ``qwen3b`` config: 3B detector beside a frozen 7B policy)."""
    import jax

    if jax.config.jax_num_cpu_devices < cfg.plan.num_devices:
        jax.config.update("jax_num_cpu_devices", cfg.plan.num_devices)
    from histeve_jax.detector.model import parameter_count
    from histeve_jax.detector.plan import describe, plan_step
    from histeve_jax.models import qwen2_5_vl
    from histeve_jax.parallel import mesh as mesh_lib
    from histeve_jax.policy import PolicyConfig, tiny_config

    t = cfg.train
    if cfg.variant == "qwen3b":
        base = qwen2_5_vl.qwen2_5_vl_7b(dtype=jax.numpy.bfloat16, param_dtype=jax.numpy.bfloat16)
        pc = PolicyConfig(base=base, history_frames=3, image_size=tuple(t.data.image_size))
    else:
        pc = tiny_config(history_frames=1, image_size=tuple(t.data.image_size))
    # layer_loop "scan": the TPU program's loop ("auto" unrolls on the CPU backend this compiles on).
    pc = dataclasses.replace(pc, base=pc.base.replace(layer_loop="scan"))
    det = template_of(cfg, pc)
    det = det.replace(base=det.base.replace(dtype=jax.numpy.dtype(t.model.dtype), remat=t.model.remat,
                                            layer_loop="scan"))
    mesh = mesh_lib.make_mesh(dict(cfg.plan.ici), devices=jax.devices()[: cfg.plan.num_devices])
    counts = parameter_count(det)
    fig = plan_step(run_spec(cfg, "/tmp/detector_plan"), det, pc, mesh, cfg.plan.hbm_bytes)
    print(param_line(counts))
    for line in describe(fig, mesh):
        print(line)
    print(f"hbm_fraction_v5p={fig['hbm_fraction']:.3f}")
    return {**fig, "parameters": counts}


def param_line(c: dict) -> str:
    """The parameter count and what it counts."""
    b = lambda k: f"{c[k] / 1e9:.3f}B" if c["total"] > 1e8 else f"{c[k] / 1e3:.1f}K"
    return (f"detector parameters (nnx.eval_shape): backbone {b('backbone')} (embedding {b('embedding')} + "
            f"decoder layers with pruned FFN {b('decoder_layers')}; no vision tower: it is the policy's) "
            f"+ cross-attention {b('cross_attention')} + projections {b('projections')} + head "
            f"= {b('total')}")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cfg = flags.FLAGS.config
    if _PLAN.value:
        plan(cfg)
        return
    report = run(cfg, _WORKDIR.value or f"/tmp/histeve_runs/detector_{cfg.variant}")
    print(param_line(report["parameters"]))
    m = report["test"]
    print(f"threshold {report['threshold']:.3f} (validation F1 {report['validation']['f1']:.3f}); test "
          f"n={int(m['n'])} accuracy={m['accuracy']:.3f} precision={m['precision']:.3f} "
          f"recall={m['recall']:.3f} "
          f"f1={m['f1']:.3f} fpr={m['fpr']:.3f} fnr={m['fnr']:.3f}")


if __name__ == "__main__":
    define_config(os.path.join(_CONFIGS, "detector.py"), "Detector config.")
    _WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
    _PLAN = flags.DEFINE_bool("plan", False, "Compile the detector's step over simulated devices instead.")
    app.run(main)
