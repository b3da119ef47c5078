"""The trained completion detector as the harness's completion signal (``controller.CompletionSignal``).

``DetectorCompletion`` wraps ``detector.monitor.CompletionMonitor``: each invocation restarts its frame
history on the subtask's instruction (the atomic task's text with its slots filled in, as the policy was
told it), and every ``every`` steps it queries the coupled detector (frozen policy + detector) on the
frames of its slots; the harness ends the invocation once ``consecutive`` queries in a row are
>= ``threshold``, the paper's rule.
``threshold`` is the detector run's loop threshold (``loop_threshold`` in its ``detector_report.json``:
calibrated on replayed validation episodes to end few invocations early), else its F1 threshold; a
subtask whose atomic task has its own (``loop_thresholds``, calibrated on that task's replays) is held to
that one while it runs.

``load_detector_completion(detector_run, loaded_policy, policy_run)`` refuses, in one line naming both
runs, a detector run that was not trained beside that policy run's weights (``export.detector_export``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from histeve_jax.detector.inputs import QueryInputs
from histeve_jax.detector.monitor import CompletionMonitor, MonitorOptions
from histeve_jax.harness.schemas import Subtask


class DetectorCompletion:
    """The coupled detector queried every ``every`` steps of an invocation (module docstring)."""

    name = "detector"

    def __init__(self, coupled: Any, policy_config: Any, threshold: float, every: int = 2,
                 tokenizer_path: str | None = None, codec: Callable[[np.ndarray], np.ndarray] | None = None,
                 thresholds: Mapping[str, float] | None = None):
        # The monitor never stops by itself (threshold above 1): the harness applies the rule.
        self.monitor = CompletionMonitor(coupled, QueryInputs(coupled.config, policy_config, tokenizer_path),
                                         MonitorOptions(threshold=2.0, every=every, consecutive=1))
        self.default = float(threshold)
        self.thresholds = {k: float(v) for k, v in (thresholds or {}).items()}  # atomic task -> its own
        self.task = ""
        # The frames' codec of the records it was trained on (the policy's: ``LoadedPolicy.through_codec``).
        self.codec = codec or (lambda frame: frame)

    @property
    def threshold(self) -> float:
        """The running subtask's threshold: its atomic task's own, else the run's."""
        return self.thresholds.get(self.task, self.default)

    @threshold.setter
    def threshold(self, value: float) -> None:
        self.default = float(value)

    def reset(self, subtask: Subtask, obs: dict, info: dict) -> None:
        self.task = subtask.task
        self.monitor.reset(subtask.instruction_at(info), int(bool(info.get("is_gui_open", False))))
        self.monitor.observe(self.codec(obs["image"]), info)  # the invocation's first frame (step 0)

    def probability(self, obs: dict, info: dict) -> float | None:
        return self.monitor.observe(self.codec(obs["image"]), info).probability

    def restart(self, obs: dict, info: dict) -> None:
        """The invocation's frames begin again at this step, on the instruction it was reset with (not read
        again from ``info``: a craft's input may be off the slots while the GUI closes)."""
        self.monitor.reset(self.monitor.instruction, int(bool(info.get("is_gui_open", False))))
        self.monitor.observe(self.codec(obs["image"]), info)


def detector_threshold(report: dict[str, Any], path: str) -> float:
    """The loop threshold of a detector run's report, else its F1 threshold; neither: an error naming it."""
    for key in ("loop_threshold", "threshold"):
        if report.get(key) is not None:
            return float(report[key])
    raise ValueError(f"{path}: detector_report.json has neither loop_threshold nor threshold (was the run "
                     f"finished?)")


def load_detector_completion(detector_run: str, loaded: Any, policy_run: str, *, every: int = 2,
                             step: int | None = None) -> DetectorCompletion:
    """The detector of ``detector_run`` beside ``loaded`` (``eval.policy_agent.load_run(policy_run)``)."""
    from histeve_jax.export.detector_export import load_coupled_run

    coupled, _, report = load_coupled_run(detector_run, loaded.policy, policy_run=policy_run,
                                          policy_step=loaded.step, policy_stride=loaded.stride, step=step)
    with open(os.path.join(detector_run, "config.json")) as f:  # the prompts' tokenizer, as it was trained
        tokenizer_path = (json.load(f).get("data") or {}).get("tokenizer_path") or None
    return DetectorCompletion(coupled, loaded.config, detector_threshold(report, detector_run), every,
                              tokenizer_path, codec=loaded.through_codec,
                              thresholds=report.get("loop_thresholds"))
