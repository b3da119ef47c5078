"""A detector run's completion detector, exported beside the policy it reads: ``<out>/detector/``.

A detector run is its own workdir, pointing at the policy run it was trained beside (``experiments.detector``
reads ``--config.detector.policy=<policy run>`` and writes ``<workdir>/run_x<n>``): its ``config.json`` (the
train loop's fields), ``checkpoints/`` (the ``CoupledDetector``: the frozen policy and the detector) and
``detector_report.json`` (``pruned_dir``, the calibrated ``threshold``). The policy run does not hold it, so
the export names it: ``--detector=<detector run>``. Its ``DetectorConfig`` is the run's ``detector.json``
when there is one, else the one in the report's ``pruned_dir`` (as written, else the run's sibling of that
name: a workdir given as a relative path or moved).

The detector must read the exported policy: ``DetectorConfig.check_policy`` (hidden width, image encoder,
frame size), the policy's frame stride, the checkpoint's tree, and the frozen policy in the detector's
checkpoint equal to the exported policy tensor for tensor (the detector learned that policy's hidden states;
another checkpoint's would be other inputs). Any mismatch is one ``ValueError`` line naming both runs.

``detector/``: ``config.json`` (``HiSteveDetectorConfig``: the detector decoder's Qwen2.5-VL config, the
frame slots, ``auto_map`` -> ``modeling_histeve_detector``, a ``histeve`` block with the source run, step,
threshold and the ``DetectorConfig``), the safetensors (``hf_tensors``, tensor by tensor, the torch module
paths), and ``modeling_histeve_detector.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from histeve_jax.detector import prune
from histeve_jax.detector.config import DetectorConfig
from histeve_jax.detector.coupled import Frozen, detail_slots, frame_slots
from histeve_jax.detector.inputs import DETECTOR_QUESTION
from histeve_jax.detector.model import Detector
from histeve_jax.export import hf_tensors
from histeve_jax.models.qwen2_5_vl import weights as hf_weights

SUBDIR = "detector"
MODELING_FILE = "modeling_histeve_detector.py"
REPORT_FILE = "detector_report.json"
_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass
class DetectorRun:
    """A detector run's trained detector (the frozen policy dropped), its config and where it came from."""

    workdir: str
    step: int
    detector: Detector
    threshold: float | None

    @property
    def config(self) -> DetectorConfig:
        return self.detector.config


def _report(workdir: str) -> dict[str, Any]:
    fn = os.path.join(workdir, REPORT_FILE)
    if not os.path.exists(fn):
        return {}
    with open(fn) as f:
        return json.load(f)


def detector_config_of(workdir: str) -> DetectorConfig:
    """The ``DetectorConfig`` of a detector run (module docstring: its ``detector.json``, else the report's
    ``pruned_dir``'s)."""
    if os.path.exists(os.path.join(workdir, prune.CONFIG_FILE)):
        return prune.read_config(workdir)
    pruned = _report(workdir).get("pruned_dir")
    if pruned:
        for d in (pruned, os.path.join(os.path.dirname(os.path.abspath(workdir)), os.path.basename(pruned))):
            if os.path.exists(os.path.join(d, prune.CONFIG_FILE)):
                return prune.read_config(d)
    raise FileNotFoundError(f"{workdir}: no detector config (neither {prune.CONFIG_FILE} nor a {REPORT_FILE} "
                            f"whose pruned_dir holds one)")


def _check_run_dir(workdir: str) -> None:
    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        return
    runs = sorted(d for d in os.listdir(workdir) if os.path.isdir(os.path.join(workdir, d, "checkpoints"))) \
        if os.path.isdir(workdir) else []
    hint = f"; it holds the detector runs {', '.join(runs)}: pass one" if runs else ""
    raise FileNotFoundError(f"--detector={workdir}: not a detector run (no checkpoints/){hint}")


def load_detector_run(workdir: str, policy: Any, *, policy_run: str, policy_step: int, policy_stride: int,
                      step: int | None = None) -> DetectorRun:
    """The detector of ``workdir`` at its latest checkpoint (or ``step``), checked against ``policy`` (the
    ``Policy`` being exported, from ``policy_run`` at ``policy_step``, frames ``policy_stride`` apart)."""
    coupled, step, report = load_coupled_run(workdir, policy, policy_run=policy_run, policy_step=policy_step,
                                             policy_stride=policy_stride, step=step)
    threshold = report.get("threshold")
    return DetectorRun(workdir, int(step), coupled.detector, None if threshold is None else float(threshold))


def load_coupled_run(workdir: str, policy: Any, *, policy_run: str, policy_step: int, policy_stride: int,
                     step: int | None = None) -> tuple[Any, int, dict[str, Any]]:
    """(the ``CoupledDetector`` of ``workdir`` at its latest checkpoint or ``step``, that step, the run's
    ``detector_report.json``), checked against ``policy`` as ``load_detector_run`` says: what the harness
    queries in the loop (``harness.completion.DetectorCompletion``)."""
    from histeve_jax.detector.predict import load_trained
    from histeve_jax.detector.stage import detector_stage
    from histeve_jax.train.checkpoint import Checkpointer
    from histeve_jax.train.specs import RunSpec

    _check_run_dir(workdir)
    config = detector_config_of(workdir)
    both = f"the detector run {workdir} does not read the policy of run {policy_run} step {policy_step}"
    try:
        config.check_policy(policy.config)
    except ValueError as e:
        raise ValueError(f"{both}: {e}") from e
    if config.policy_stride != policy_stride:
        raise ValueError(f"{both}: it was trained on policy frames {config.policy_stride} steps apart, the "
                         f"policy's are {policy_stride}")
    with open(os.path.join(workdir, "config.json")) as f:
        spec = RunSpec.from_config(ml_collections.ConfigDict(json.load(f)), workdir)
    with Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False) as ck:
        steps = ck.all_steps()
    if not steps or (step is not None and step not in steps):
        which = "" if step is None else f" step {step}"
        raise FileNotFoundError(f"--detector={workdir}: no checkpoint{which} (steps on disk: {steps})")
    step = steps[-1] if step is None else step
    stage = detector_stage(spec, config, policy.config)
    try:
        coupled = load_trained(spec, stage, step)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{both}: its checkpoint does not restore beside that policy's config "
                         f"({str(e).splitlines()[0][:300]})") from e
    _check_same_policy(coupled.policy, policy, both)
    return coupled, int(step), _report(workdir)


def _check_same_policy(frozen: nnx.Module, policy: nnx.Module, both: str) -> None:
    """Raise (one line) unless the detector checkpoint's frozen policy equals ``policy`` tensor for tensor."""
    theirs = dict(nnx.to_flat_state(nnx.state(frozen, Frozen)))
    mine = dict(nnx.to_flat_state(nnx.state(policy, nnx.Param)))
    if set(theirs) != set(mine):
        odd = "/".join(map(str, sorted(set(theirs) ^ set(mine))[0]))
        raise ValueError(f"{both}: its frozen policy's tensors differ in name (e.g. {odd})")
    for path, var in mine.items():
        a, b = var.get_value(), theirs[path].get_value()
        if a.shape != b.shape or not bool(jnp.array_equal(a, b)):
            diff = "shape" if a.shape != b.shape else f"max |diff| {float(jnp.max(jnp.abs(a - b))):.3g}"
            name = "/".join(map(str, path))
            raise ValueError(f"{both}: it was trained beside other policy weights ({name} differs, {diff}); "
                             f"export the policy checkpoint it read, or retrain it")


def detector_maps(config: DetectorConfig) -> list[hf_weights.TensorMap]:
    """Every detector tensor, ``hf`` its name in ``HiSteveDetector`` (the torch module paths)."""
    decoder = hf_weights.tensor_maps(config.base.replace(scan_layers=True))
    out = [dataclasses.replace(m, hf="language_model." + m.hf[len("model."):])
           for m in decoder if m.hf.startswith("model.")]
    for g in range(config.num_groups):
        hp = f"cross.{g}."
        out.append(hf_weights.TensorMap(hp + "norm.weight", ("cross", "norm", "scale"), "norm", 1, g))
        for n in ("q", "k", "v"):
            out.append(hf_weights.TensorMap(hp + f"{n}_proj.weight", ("cross", n), "linear", 1, g))
        out.append(hf_weights.TensorMap(hp + "o_proj.weight", ("cross", "o"), "linear", 2, g))
    if config.projects:
        out.append(hf_weights.TensorMap("image_proj.weight", ("image_proj",), "linear"))
        if config.num_groups:
            out.append(hf_weights.TensorMap("context_proj.weight", ("context_proj",), "linear"))
    out.append(hf_weights.TensorMap("head.weight", ("head",), "linear"))
    out.append(hf_weights.TensorMap("head.bias", ("head_bias",), "bias"))
    return out


def detector_hf_config(run: DetectorRun, policy_config: Any, *, dtype: str,
                       source: dict[str, Any]) -> dict[str, Any]:
    """``detector/config.json``'s dict (``HiSteveDetectorConfig``)."""
    config = run.config
    union, det, pol = frame_slots(config, policy_config.num_frames)
    cfg = config.base.to_hf_dict()
    cfg.update({
        "architectures": ["HiSteveDetector"],
        "model_type": "histeve_detector",
        "dtype": dtype,
        "auto_map": {"AutoConfig": "modeling_histeve_detector.HiSteveDetectorConfig",
                     "AutoModel": "modeling_histeve_detector.HiSteveDetector"},
        "policy_hidden_size": config.policy_hidden_size,
        "cross_attention_every": config.cross_attention_every,
        "num_frames": config.num_frames,
        "policy_num_frames": int(policy_config.num_frames),
        "image_size": list(config.image_size),
        "frame_slots": {"offsets": list(union), "detector": list(det), "policy": list(pol),
                        "detail": list(detail_slots(config, policy_config.num_frames))},
        "detail_size": list(config.detail_size) if config.detail is not None else None,
        "histeve": {"source": source, "threshold": run.threshold, "question": DETECTOR_QUESTION,
                    "detector_config": json.loads(json.dumps(prune.config_to_dict(config), default=str))},
    })
    return cfg


def write_detector(run: DetectorRun, policy_config: Any, out: str, *, dtype: str, np_dtype: Any,
                   max_shard_size: int | str) -> str:
    """Writes ``<out>/detector/`` (module docstring) into the export being written at ``out``."""
    path = os.path.join(out, SUBDIR)
    os.makedirs(path)
    hf_tensors.write_weights(run.detector, path, dtype=np.dtype(np_dtype), max_shard_size=max_shard_size,
                             maps=detector_maps(run.config))
    source = {"run": os.path.abspath(run.workdir), "step": run.step}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(detector_hf_config(run, policy_config, dtype=dtype, source=source), f, indent=2)
    shutil.copyfile(os.path.join(_HERE, MODELING_FILE), os.path.join(path, MODELING_FILE))
    return path
