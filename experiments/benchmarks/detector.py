"""The completion detector on a balanced atomic-subtask completion set from held-out Luanti episodes.

    python -m experiments.benchmarks.detector --config.detector.policy=<imitation run> \
        --config.detector.record_episodes=72 --config.train.num_train_steps=1500 [--workdir=...]
    (or --config.detector.records=<record dirs> for expert episodes already recorded)

Trains the tiny detector (``experiments.detector.run``) with and without the cross-attention to the policy
(the ablation), calibrates each threshold on the validation episodes and scores the test episodes:
accuracy, precision, recall, F1, false positive and false negative rates, on the task units (the atomic
subtasks; beside them, the test with the expert's phases as units too). A prompted VLM is scored on the
same queries when an OpenAI-compatible endpoint is configured (``--config.vlm.*``, or $OPENAI_BASE_URL
and $OPENAI_API_KEY), and skipped, saying so, when none is. Then the detector replays each held-out
episode in the loop (``detector.monitor``: a query every k steps, two consecutive over threshold) and
counts invocations that end before the privileged check holds (in a failed episode: any stop), at the F1
threshold and at the loop's own threshold, calibrated on the validation episodes' replays (the lowest
that ends at most ``detector.max_early`` of them early, or with ``detector.loop_rule="balanced"`` the
one that ends the fewest early or missed; written to the run's ``detector_report.json`` as
``loop_threshold``). Prints
the 3B detector's parameter count by abstract evaluation. Last line: ``accuracy=<a> f1=<f> fpr=<p>
fnr=<n> f1_no_xattn=<g>``.
"""

from __future__ import annotations

import os
from typing import Any

from absl import app, flags

from experiments.config_cli import define_config

_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


def _row(name: str, m: dict) -> str:
    return (f"{name:28s} n={int(m['n']):4d} accuracy={m['accuracy']:.3f} precision={m['precision']:.3f} "
            f"recall={m['recall']:.3f} f1={m['f1']:.3f} fpr={m['fpr']:.3f} fnr={m['fnr']:.3f}")


def vlm_scores(cfg: Any, test_dir: str, det_config: Any, policy_config: Any) -> dict | None:
    """The prompted VLM's metrics on the test queries, or None (and why) when no endpoint is configured."""
    from experiments.detector import eval_options
    from histeve_jax.data import records as R
    from histeve_jax.detector.loss import binary_metrics
    from histeve_jax.detector.stage import queries_of
    from histeve_jax.detector.vlm_baseline import PromptedVLM
    from histeve_jax.eval.suites.vlm_judge import JudgeSpec

    spec = JudgeSpec(base_url=cfg.vlm.base_url, model=cfg.vlm.model, api_key=cfg.vlm.api_key)
    if spec.missing():
        print("prompted VLM baseline: skipped (no OpenAI-compatible endpoint configured: set "
              "--config.vlm.api_key or $OPENAI_API_KEY, and --config.vlm.base_url or $OPENAI_BASE_URL)")
        return None
    import numpy as np
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    options = eval_options(cfg, cfg.train.data.seed)
    shards, queries = queries_of([test_dir], det_config, policy_config, options)
    source = ArrayRecordDataSource(shards.paths)
    vlm, probs, labels, unusable = PromptedVLM(spec), [], [], 0
    for q in queries:
        frames = [R.deserialize(source[j]).frame for j in q.frames]
        p = vlm(frames, q.instruction)
        unusable += p is None
        probs.append(0.0 if p is None else p)
        labels.append(q.label)
    print(f"prompted VLM {spec.resolved().model} at {spec.resolved().base_url or 'the OpenAI API'}: "
          f"{unusable} answers neither yes nor no (counted as no)")
    return binary_metrics(np.asarray(probs), np.asarray(labels), 0.5)


def _loop_line(name: str, threshold: float, m: dict) -> str:
    n, d = max(m["episodes"], 1), m["delays"]
    late = f"median {sorted(d)[len(d) // 2]} steps after the check holds" if d else "no stop after it holds"
    return (f"  {name} {threshold:.3f}: {m['early']} of {m['episodes']} invocations end before the "
            f"privileged check holds ({m['early'] / n:.0%}); {m['missed']} never stopped by the detector; "
            f"{late}")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from experiments.detector import loop_curves, param_line, policy_of, run, template_of
    from histeve_jax.detector.config import qwen3b_config
    from histeve_jax.detector.model import parameter_count

    cfg = flags.FLAGS.config
    workdir = _WORKDIR.value
    print("3B " + param_line(parameter_count(qwen3b_config())) + " (paper: 1.4B)")
    full = run(cfg, workdir, log=print)
    ablation = run(cfg, workdir, cross_attention_every=0, log=print)
    print(f"queries: {full['queries']}")
    print(f"thresholds (validation, best F1): with cross-attention {full['threshold']:.3f}, "
          f"without {ablation['threshold']:.3f}")
    print(_row("detector", full["test"]))
    print(_row("detector, no cross-attention", ablation["test"]))
    print(_row("detector, + expert phases", full["test_phases"]))
    print(_row("no cross-attn, + phases", ablation["test_phases"]))
    test_dir = os.path.join(workdir, "data", "test")
    policy_config, _, stride = policy_of(cfg)
    det = template_of(cfg, policy_config).replace(policy_stride=stride)
    vlm = vlm_scores(cfg, test_dir, det, policy_config)
    if vlm is not None:
        print(_row("prompted VLM", vlm))
    from histeve_jax.detector.monitor import loop_stops

    consecutive = cfg.detector.consecutive
    test_curves = loop_curves(cfg, full, test_dir)
    at_loop = full["loop_threshold"]  # experiments.detector.run calibrated it on the validation replays
    print(f"in the loop (held-out test episodes replayed, a query every {cfg.detector.monitor_every} steps, "
          f"{consecutive} consecutive over threshold; goal: <= 5% end early):")
    print(_loop_line("at the F1 threshold", full["threshold"], loop_stops(test_curves, full["threshold"],
                                                                          consecutive)))
    rule = full.get("loop_rule", "max_early")
    how = (f"lowest with <= {full['max_early']:.0%} early" if rule == "max_early"
           else f"fewest {full['early_cost']:g} x early + missed")
    print(_loop_line(f"at the loop threshold (validation: {how})", at_loop,
                     loop_stops(test_curves, at_loop, consecutive)))
    m = full["test"]
    print(f"accuracy={m['accuracy']:.3f} f1={m['f1']:.3f} fpr={m['fpr']:.3f} fnr={m['fnr']:.3f} "
          f"f1_no_xattn={ablation['test']['f1']:.3f}")


if __name__ == "__main__":
    define_config(os.path.join(_CONFIGS, "detector.py"), "Detector config.")
    _WORKDIR = flags.DEFINE_string("workdir", "/tmp/histeve_runs/detector_benchmark", "Output directory.")
    app.run(main)
