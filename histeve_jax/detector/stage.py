"""The detector as a stage of the shared train loop (``train.setup.Stage``, ``train.loop.train``).

The module the loop trains is the ``CoupledDetector`` (the frozen policy and the detector: only the
detector's ``nnx.Param``s are trained, the policy's are ``Frozen`` state). Its batches are queries, not
the policy's windows, so the stage brings its own batch iterator (``Stage.batches``): the balanced queries
of the record directories the loop is given (``detector.data``), through grain, with the iterator state a
checkpoint keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from histeve_jax.data import pipeline
from histeve_jax.detector import data as data_lib
from histeve_jax.detector.config import DetectorConfig
from histeve_jax.detector.coupled import CoupledDetector, frame_slots
from histeve_jax.detector.inputs import QueryInputs
from histeve_jax.detector.loss import completion_loss
from histeve_jax.detector.model import Detector
from histeve_jax.detector.prune import load_detector
from histeve_jax.policy import Policy, PolicyConfig
from histeve_jax.train.setup import Stage
from histeve_jax.train.specs import DataSpec, RunSpec

DETECTOR_KEYS = ("pixel_values", "input_ids", "attention_mask", "policy_input_ids", "policy_attention_mask",
                 "regime", "label")


@dataclasses.dataclass(frozen=True)
class QueryOptions:
    """How queries are drawn from episodes (``detector.data.sample_queries``)."""

    per_unit: int = 3
    post_window: int = 4
    subtasks: bool = True
    seed: int = 0
    start_jitter: bool = False
    resume: bool = False  # also the task's resume units (``detector.data.resume_units``)


def loader_options(data: DataSpec, *, train: bool) -> pipeline.LoaderOptions:
    """This host's loader options, as ``train.data.make_iterator`` sets them for the policy's windows."""
    per_host, rem = divmod(data.batch_size, jax.process_count())
    if rem:
        raise ValueError(f"data.batch_size={data.batch_size} is not divisible by {jax.process_count()} hosts")
    return pipeline.LoaderOptions(
        batch_size=per_host, seed=data.seed, shuffle=data.shuffle if train else True,
        num_epochs=None if train or jax.process_count() > 1 else 1, worker_count=data.worker_count,
        worker_buffer_size=data.worker_buffer_size, read_threads=data.read_threads,
        max_bad_fraction=data.max_bad_fraction, min_samples_for_check=data.min_samples_for_check,
        shard_index=jax.process_index(), shard_count=jax.process_count())


def queries_of(dirs: list[str] | tuple[str, ...], config: DetectorConfig, policy_config: PolicyConfig,
               options: QueryOptions) -> tuple[pipeline.ShardSet, list[data_lib.Query]]:
    """(the shard set, its balanced queries) of record directories."""
    shards, episodes = data_lib.read_steps(list(dirs))
    offsets = frame_slots(config, policy_config.num_frames)[0]
    queries = data_lib.sample_queries(episodes, offsets, per_unit=options.per_unit,
                                      post_window=options.post_window, subtasks=options.subtasks,
                                      seed=options.seed, start_jitter=options.start_jitter,
                                      resume=options.resume)
    return shards, queries


def detector_stage(spec: RunSpec, config: DetectorConfig, policy_config: PolicyConfig, *,
                   load_policy: Callable[[], Policy] | None = None, detector_dir: str = "",
                   queries: QueryOptions = QueryOptions()) -> Stage:  # noqa: B008 - a frozen dataclass
    """The detector's stage: ``load_policy()`` gives the trained policy (None: a random one, for tiny runs),
    ``detector_dir`` the pruned detector (``prune.save_detector``; "": a random detector)."""
    config.check_policy(policy_config)
    seed = spec.loop.seed
    tokenizer = spec.data.tokenizer_path or None

    def init_model() -> CoupledDetector:
        return CoupledDetector(Policy(policy_config, rngs=nnx.Rngs(seed)),
                               Detector(config, rngs=nnx.Rngs(seed + 1)))

    def pretrained(mesh: Any, rules: Any) -> CoupledDetector:
        policy = load_policy() if load_policy is not None else Policy(policy_config, rngs=nnx.Rngs(seed))
        if detector_dir:
            detector = load_detector(detector_dir, mesh=mesh, rules=rules, config=config)
        else:
            detector = Detector(config, rngs=nnx.Rngs(seed + 1))
        return CoupledDetector(policy, detector)

    def batches(dirs: list[str], data: DataSpec, train: bool) -> pipeline.Batches:
        shards, qs = queries_of(dirs, config, policy_config, queries)
        inputs = QueryInputs(config, policy_config, tokenizer)
        return data_lib.make_batches(shards, qs, inputs, loader_options(data, train=train))

    features = pipeline.FeatureSpec(kind="demo", history=policy_config.history_frames,
                                    stride=config.policy_stride, image_size=tuple(config.image_size),
                                    max_len=config.policy_max_len, codebook=policy_config.codebook,
                                    tokenizer_path=tokenizer, dual_mouse=policy_config.dual_mouse)
    return Stage(name=spec.stage, init_model=init_model, loss_fn=completion_loss, features=features,
                 device_keys=DETECTOR_KEYS,
                 pretrained=pretrained if (load_policy is not None or detector_dir) else None,
                 batches=batches)
