"""The agent we train, end to end: planner + harness + our policy + our detector on the long-horizon tasks.

    python -m experiments.agent                                 # tiny default: CPU, Luanti, from nothing
    python -m experiments.agent --config.reuse=/tmp/histeve_runs/agent   # skip what that workdir finished
    python -m experiments.agent --config.policy=<run> --config.detector=<detector run> \
        --config.planner=endpoint --config.endpoint.base_url=http://localhost:8000/v1

Stages (each skipped when ``--config.reuse`` names a workdir where it finished, or given as a run):
1. the policy: ``experiments.imitation --config=...:pickaxe`` (record, train, evaluate) under ``policy/``;
2. the detector: ``experiments.detector`` beside that policy (expert episodes of the long-horizon tasks'
   subtasks recorded past success, and the policy's own rollouts of them on training seeds, played on past
   success; with ``detector_harness_episodes``, also its own invocations through the harness), with its
   loop threshold, under ``detector/``;
3. the long-horizon suite (``harness.suite``) with injected failures, four rows: (1) ``agent``: planner +
   harness + policy, invocations ended by the detector; (2) ``privileged``: the same, ended by the
   privileged check; (3) ``goal_only``: the policy given only the final goal; (4) ``expert``: the scripted
   experts through the harness. Episodes, reports and ``summary.json`` under ``longhorizon/``.

Prints the table (goal success with Wilson interval, diagnostic progress, invocations, replans, early
handoffs and the handoff delay, planner seconds and tokens per episode) per row and task, writes
``agent_report.json``, and ends with ``goal_success=<x> progress=<y> goal_success_privileged=<z>
goal_success_goal_only=<w>`` (row 1, 2, 3 over all tasks). A detector run that does not read the policy run
is refused in one line; a workdir that holds a finished run is refused unless it is ``--config.reuse``'d.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from absl import app, flags

from experiments.config_cli import define_config

_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = {"policy": "agent", "policy_privileged": "privileged", "policy_goal_only": "goal_only",
        "expert": "expert"}


def _say(msg: str) -> None:
    print(f"[agent {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def workdir_of(c: Any) -> str:
    """The agent's workdir: ``reuse`` when given (work continues there), else ``workdir``, which must not
    hold an earlier agent run (its results would be mixed with this one's)."""
    if c.reuse:
        if not os.path.isdir(c.reuse):
            raise FileNotFoundError(f"--config.reuse={c.reuse}: no such directory")
        return c.reuse
    if os.path.exists(os.path.join(c.workdir, "agent_config.json")):
        raise FileExistsError(f"{c.workdir} holds an earlier agent run: pass --config.reuse={c.workdir} to "
                              f"go on with it, or another --config.workdir")
    return c.workdir


def policy_run(c: Any, workdir: str) -> str:
    """The policy run: given, or trained (and evaluated) under ``workdir/policy`` unless it finished."""
    if c.policy:
        if not os.path.exists(os.path.join(c.policy, "config.json")):
            raise FileNotFoundError(f"--config.policy={c.policy}: not a run's workdir (no config.json)")
        return c.policy
    out = os.path.join(workdir, "policy")
    if os.path.exists(os.path.join(out, "eval", "summary.json")):
        _say(f"policy: {out} (finished; reused)")
        return out
    cmd = [sys.executable, "-m", "experiments.imitation", f"--config={_CONFIGS}/{c.policy_config}",
           f"--workdir={out}", "--config.progress_bar=False"]
    _say(f"policy: training {out}: {' '.join(cmd[1:])}")
    with open(os.path.join(workdir, "policy.log"), "a") as log:
        rc = subprocess.run(cmd, cwd=_REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise RuntimeError(f"the policy run failed (exit {rc}); see {os.path.join(workdir, 'policy.log')}")
    return out


def detector_config(c: Any, policy: str) -> Any:
    """``experiments/configs/detector.py:tiny`` beside ``policy``: the subtasks' expert episodes."""
    from experiments.configs.detector import get_config
    from histeve_jax.data.image_processing import parse_crop

    d = get_config("tiny")
    with open(os.path.join(policy, "config.json")) as f:
        image_size = tuple(json.load(f)["data"]["image_size"])
    d.train.data.image_size = image_size
    d.train.num_train_steps = c.detector_steps
    d.train.checkpoint_every = c.detector_steps
    d.train.progress_bar = False
    d.detector.policy = policy
    d.detector.record_tasks = tuple(c.detector_record_tasks)
    d.detector.record_episodes = c.detector_record_episodes
    d.detector.monitor_every = c.play.detector_every
    # an anchored detector's prompt holds one more frame: a frame's tokens more (28 at 112x196) and its
    # vision start and end; a detail crop's likewise, for the query's frame (and the anchor's)
    frame_tokens = (image_size[0] // 28) * (image_size[1] // 28) + 2
    d.detector.max_len = c.detector_max_len + frame_tokens * bool(c.detector_anchor)
    d.detector.detail, d.detector.detail_scale = c.detector_detail, c.detector_detail_scale
    crop = parse_crop(c.detector_detail, "detector_detail")
    if crop is not None:
        t, b, l, r = crop
        s = c.detector_detail_scale
        crop_tokens = ((b - t) * s // 28) * ((r - l) * s // 28) + 2
        d.detector.max_len += crop_tokens * (1 + bool(c.detector_anchor))
    d.detector.per_unit = c.detector_per_unit
    d.detector.subtasks = bool(c.detector_subtasks)
    d.detector.anchor, d.detector.resume_units = bool(c.detector_anchor), bool(c.detector_resume_units)
    d.detector.loop_resume_units = bool(c.detector_loop_resume_units)
    d.detector.per_task_thresholds = bool(c.detector_per_task_thresholds)
    # the policy's own episodes (rollouts, harness invocations) are drawn as the loop draws its actions
    d.detector.rollout_temperature, d.detector.rollout_top_p = c.play.temperature, c.play.top_p
    if c.detector_rollout_episodes or c.detector_rollout_task_episodes:  # in place of the held-out eval's
        d.detector.rollout_episodes = c.detector_rollout_episodes
        d.detector.rollout_task_episodes = c.detector_rollout_task_episodes
        d.detector.eval_records = ""
    d.detector.harness_episodes = c.detector_harness_episodes
    d.detector.harness_tasks = tuple(c.play.tasks)
    d.detector.harness_max_steps = c.play.policy_max_steps
    return d


def detector_run(c: Any, workdir: str, policy: str) -> str:
    """The detector run (``run_x<n>``): given, or trained beside ``policy`` under ``workdir/detector``."""
    if c.detector:
        return c.detector
    from experiments.detector import run

    cfg = detector_config(c, policy)
    out = os.path.join(workdir, "detector")
    run_dir = os.path.join(out, f"run_x{cfg.detector.cross_attention_every}")
    report = os.path.join(run_dir, "detector_report.json")
    if os.path.exists(report):
        with open(report) as f:
            if "loop_threshold" in json.load(f):  # written last: the run finished
                _say(f"detector: {run_dir} (finished; reused)")
                return run_dir
    _say(f"detector: training beside {policy} under {out}")
    rep = run(cfg, out, log=_say)
    _say(f"detector: threshold {rep['threshold']:.3f} (validation F1 {rep['validation']['f1']:.3f}), test F1 "
         f"{rep['test']['f1']:.3f}, loop threshold {rep['loop_threshold']:.3f}")
    return rep["run_dir"]


def play(c: Any, workdir: str, policy: str, detector: str, planner: Any) -> dict:
    """The four rows on the long-horizon tasks (module docstring); episodes already played are read back."""
    from tqdm import tqdm

    from histeve_jax.harness.controller import HarnessSpec
    from histeve_jax.harness.suite import SuiteSpec, run_suite

    p = c.play
    spec = SuiteSpec(tasks=tuple(p.tasks), episodes=p.episodes, seed=p.seed, executors=("policy", "expert"),
                     policy=policy, greedy=p.greedy, temperature=p.temperature, top_p=p.top_p,
                     inject=p.inject, policy_max_steps=p.policy_max_steps,
                     out_dir=os.path.join(workdir, "longhorizon"),
                     reports=p.reports, env=dict(p.env), harness=HarnessSpec(**dict(p.harness)),
                     detector=detector, detector_every=p.detector_every, completion="both", goal_only=True,
                     resume=True)
    bar = tqdm(total=len(spec.tasks) * spec.episodes * len(ROWS), desc="long-horizon", unit="ep",
               disable=not c.progress_bar, file=sys.stdout)

    def done(r: dict) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{ROWS[r['executor']]} {r['task']} seed {r['seed']}: "
                            f"{'success' if r['success'] else 'fail'}")
        if not c.progress_bar:
            _say(f"{ROWS[r['executor']]:10s} {r['task']:15s} seed {r['seed']}: success={r['success']} "
                 f"progress={r['progress']:.2f} steps={r['steps']} ({r['seconds']:.0f} s) "
                 f"{r['error'][:120]}")

    try:
        return run_suite(spec, planner, on_episode=done)
    finally:
        bar.close()


def table(summary: dict) -> list[str]:
    """The rows (and each row per task) as aligned text lines."""
    head = (f"{'row':24s} {'n':>3s} {'goal success':>22s} {'progress':>8s} {'invoc':>6s} {'replans':>7s} "
            f"{'early':>6s} {'delay':>6s} {'plan s':>7s} {'tokens':>7s}")
    lines = [head, "-" * len(head)]
    order = [k for k in ROWS if k in summary["by_executor"]]
    for ex in order:
        for key, s in [(ex, summary["by_executor"][ex])] + sorted(
                (k, v) for k, v in summary["by_task"].items() if k.split("/")[0] == ex):
            name = ROWS[ex] if key == ex else f"  {key.split('/', 1)[1]}"
            lo, hi = s["wilson"]
            f = lambda k, fmt="{:.1f}", s=s: fmt.format(s[k]) if k in s else "-"
            tokens = s.get("planner_prompt_tokens", 0) + s.get("planner_completion_tokens", 0)
            lines.append(f"{name:24s} {s['episodes']:3d} {s['successes']:3d} = {s['goal_success']:.2f} "
                         f"[{lo:.2f}, {hi:.2f}] {s['progress']:8.2f} {f('invocations'):>6s} "
                         f"{f('replans'):>7s} {f('early_handoffs', '{:.2f}'):>6s} {f('handoff_delay'):>6s} "
                         f"{f('planner_seconds', '{:.3f}'):>7s} {tokens:7.0f}")
    return lines


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    c = flags.FLAGS.config
    t0 = time.monotonic()
    try:
        workdir = workdir_of(c)
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "agent_config.json"), "w") as f:
            f.write(c.to_json_best_effort(indent=1))
        from histeve_jax.harness.planners import make_planner

        planner = make_planner(c)  # built once, before an hour of training: a bad one fails first
        policy = policy_run(c, workdir)
        detector = detector_run(c, workdir, policy)
        _say(f"playing {tuple(c.play.tasks)} x {c.play.episodes} episodes x {len(ROWS)} rows "
             f"(policy {policy}, detector {detector})")
        summary = play(c, workdir, policy, detector, planner)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # bad input: one line naming it
        raise SystemExit(f"error: {e}") from None
    lines = table(summary)
    report = {"policy": policy, "detector": detector, "minutes": round((time.monotonic() - t0) / 60, 1),
              "by_row": {ROWS[k]: v for k, v in summary["by_executor"].items()},
              "by_row_task": {f"{ROWS[k.split('/')[0]]}/{k.split('/', 1)[1]}": v
                              for k, v in summary["by_task"].items()},
              "table": lines}
    with open(os.path.join(workdir, "agent_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(lines))
    print(f"episodes, reports: {summary['out_dir']}; report: {os.path.join(workdir, 'agent_report.json')}; "
          f"{report['minutes']} min")
    g = lambda row, k: summary["by_executor"].get(row, {}).get(k, float("nan"))
    print(f"goal_success={g('policy', 'goal_success'):.2f} progress={g('policy', 'progress'):.2f} "
          f"goal_success_privileged={g('policy_privileged', 'goal_success'):.2f} "
          f"goal_success_goal_only={g('policy_goal_only', 'goal_success'):.2f}")


if __name__ == "__main__":
    define_config(os.path.join(_CONFIGS, "agent.py"), "Agent config.")
    app.run(main)
