"""The run config as typed specs: a stage's ``ConfigDict`` is read once, here, at the loop's edge.

``RunSpec.from_config(config)`` checks every field the library reads (a missing one is an error naming
``config.<group>.<field>``; one the specs do not know is an error too, so a typo'd config field cannot be
silently ignored) and converts it (directory lists, image sizes as tuples, dtypes by name). The builders
(``train.setup``), the data (``train.data``) and the loop (``train.loop``) take specs, never the config.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any


def dir_list(value: str | Any) -> tuple[str, ...]:
    """Comma-separated directories (or a list, from Python) as a tuple."""
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple(str(v) for v in value)


def task_number_pairs(text: str, unit: str) -> list[tuple[str, int]]:
    """``"craft_planks=8,mine_log[against=1]=48"`` as (task, n) pairs in order: a task may carry a variant's
    ``[k=v,...]`` (commas inside brackets kept; the number is after the last "="). A bad item is a ValueError
    "'<item>' is not task=<unit>". Per-task episode counts (``experiments.config_cli.task_counts``) and
    sampling weights (``task_weights``) are written so."""
    pairs = []
    for item in filter(None, (p.strip() for p in re.split(r",(?![^\[\]]*\])", str(text or "")))):
        name, eq, n = item.rpartition("=")
        if not eq or not name.strip() or not n.strip().isdigit():
            raise ValueError(f"{item!r} is not task={unit}")
        pairs.append((name.strip(), int(n)))
    return pairs


def task_weights(value: str | Mapping[str, int] | Any) -> tuple[tuple[str, int], ...]:
    """``"craft_planks=8,craft_sticks=8"`` (or a mapping) as sorted (task, repeats) pairs; repeats are
    positive whole numbers."""
    if isinstance(value, str):
        items = task_number_pairs(value, "repeats (a positive whole number)")
    else:
        items = [(str(k), v) for k, v in dict(value or {}).items()]
    names = [k for k, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"a task is named twice in {value!r}")
    for name, n in items:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}={n!r}: repeats must be a positive whole number")
    return tuple(sorted(items))


def _int_pair(value: Any) -> tuple[int, int]:
    h, w = value
    return int(h), int(w)


def _plain(value: Any) -> Any:
    """ConfigDicts and FieldReferences as plain Python values."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "get") and callable(value.get) and not isinstance(value, Mapping):
        return value.get()
    return value


def _read(cls: type, group: Mapping[str, Any], where: str, convert: Mapping[str, Any] = {}) -> Any:  # noqa: B006
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    given = set(group.keys())
    # A field with a default was added after runs had been written: their config.json may lack it.
    missing = [f.name for f in fields if f.name not in given and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: missing field(s) {[f'{where}.{n}' for n in missing]}")
    unknown = sorted(given - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {[f'{where}.{n}' for n in unknown]}; known: {names}")
    values = {}
    for n in names:
        if n not in given:
            continue
        v = _plain(group[n])
        try:
            values[n] = convert[n](v) if n in convert else v
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}.{n}={v!r}: {e}") from e
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    kind: str  # "tiny": random qwen2_5_vl.tiny; "hf": the Hugging Face directory hf_path
    hf_path: str
    base: str  # the base shape by name (train.setup.NAMED_BASES) where no hf_path config.json is at hand
    dtype: str  # compute dtype
    param_dtype: str
    remat: str
    max_targets: int  # target positions per sample at which the loss computes logits
    # added after runs had been written (defaults: what those runs were)
    rs_norm: bool = True  # RS-Norm's two pre-norm scales (False: one shared, the ablation's row)
    dual_mouse: bool = True  # disjoint camera/cursor tokens after a type token (False: one mouse token set)
    # A random (kind "tiny") model's M-RoPE base; 0: the base shape's (Qwen's 1e6). See experiments/configs.
    rope_theta: float = 0.0

    def __post_init__(self):
        if self.kind not in ("tiny", "hf"):
            raise ValueError(f"config.model.kind must be 'tiny' or 'hf', got {self.kind!r}")
        if self.rope_theta < 0 or (self.rope_theta and self.kind != "tiny"):
            raise ValueError(f"config.model.rope_theta={self.rope_theta}: a positive value sets a random "
                             "(kind 'tiny') model's M-RoPE base; a pretrained model's is fixed by its "
                             "weights (0)")


@dataclasses.dataclass(frozen=True)
class DataSpec:
    train_dirs: tuple[str, ...]  # empty: the run makes its data under the workdir (``generate``)
    eval_dirs: tuple[str, ...]
    kind: str  # "demo" or "world_knowledge"
    history: int
    stride: int
    image_size: tuple[int, int]
    max_len: int
    codebook: str
    tokenizer_path: str
    batch_size: int  # global, over all hosts
    seed: int
    shuffle: bool
    worker_count: int
    worker_buffer_size: int
    read_threads: int
    max_bad_fraction: float
    min_samples_for_check: int
    generate: str  # "record" (the Luanti experts) or "synthetic"
    skip_null_actions: bool = False  # leave no-op steps out of the demonstrations (pipeline.FeatureSpec)
    # The codec the run's training frames go through (the recorder writes them so); the policy acts on live
    # frames passed through it too (eval.policy_agent.LoadedPolicy), so it sees what it was trained on.
    frame_format: str = "jpeg"
    jpeg_quality: int = 95
    # History frames stay within the current GUI-open or GUI-closed run (``pipeline.FeatureSpec``); the
    # policy acts with the same windows (``eval.policy_agent.FrameHistory``). Off for runs saved before it.
    history_in_regime: bool = False
    # Each training record of a task repeated this many times an epoch ("craft_planks=8,..."; empty: every
    # record once): ``pipeline.LoaderOptions.task_weights``. The evaluation split is never weighted.
    task_weights: tuple[tuple[str, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class RecordSpec:
    variant: str  # experiments/configs/record.py:<variant>
    episodes: int  # per task
    instances: int  # games recording in parallel
    timeout_s: float
    task_episodes: str = ""  # per-task exceptions to `episodes` ("mine_log=48"; record.py's field)
    perturb: float = 0.0  # the experts' chance of aiming off first (record.py's field; never imitated)


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    train_size: int
    eval_size: int
    length: int
    gui_fraction: float


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    num_train_steps: int
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    keep_checkpoints: int
    async_checkpoint: bool
    init_from: str  # a previous stage's workdir: its latest params initialise this run
    stop_at_step: int  # > 0: leave after this step without a final save (a simulated kill)
    progress_bar: bool
    microbatches: int
    seed: int


_LOOP_FIELDS = tuple(f.name for f in dataclasses.fields(LoopSpec))
_GROUPS = ("data", "record", "synthetic", "model", "optimizer", "mesh")
_OPTIONAL = ("eval",)  # read by the entry point, not the loop (``histeve_jax.eval.evaluate.EvalSpec``)
_TOP = ("stage", "variant", "workdir", "distributed")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One stage's run: what to train, on what data, how, where."""

    stage: str
    variant: str
    workdir: str
    loop: LoopSpec
    data: DataSpec
    model: ModelSpec
    record: RecordSpec
    synthetic: SyntheticSpec
    optimizer: dict[str, Any]  # ``train.optimizer``'s fields (it checks them)
    mesh: dict[str, Any]  # ``parallel.mesh.mesh_from_config``'s fields
    distributed: Any  # ``parallel.multihost.initialize_from_config``'s field
    closed_loop: dict[str, Any] = dataclasses.field(default_factory=dict)  # the ``eval`` group, if any
    config: Any = dataclasses.field(default=None, compare=False, repr=False)  # the source, saved with runs

    @classmethod
    def from_config(cls, config: Any, workdir: str | None = None) -> RunSpec:
        """The specs of a stage config (``experiments/configs/*.py``); ``workdir`` overrides its own."""
        known = set(_LOOP_FIELDS) | set(_GROUPS) | set(_TOP) | set(_OPTIONAL)
        unknown = sorted(set(config.keys()) - known)
        if unknown:
            raise ValueError(f"config: unknown field(s) {unknown}; the train loop reads {sorted(known)}")
        for name in (*_TOP, *_GROUPS):
            if name not in config:
                raise ValueError(f"config: missing field config.{name}")
        loop = _read(LoopSpec, {k: config[k] for k in _LOOP_FIELDS if k in config}, "config")
        data = _read(DataSpec, config.data, "config.data", {
            "train_dirs": dir_list, "eval_dirs": dir_list, "image_size": _int_pair,
            "task_weights": task_weights})
        return cls(
            stage=str(config.stage), variant=str(config.variant), workdir=workdir or str(config.workdir),
            loop=loop, data=data, model=_read(ModelSpec, config.model, "config.model"),
            record=_read(RecordSpec, config.record, "config.record"),
            synthetic=_read(SyntheticSpec, config.synthetic, "config.synthetic"),
            optimizer=dict(_plain(config.optimizer)), mesh=dict(_plain(config.mesh)),
            distributed=_plain(config.distributed),
            closed_loop=dict(_plain(config.eval)) if "eval" in config else {}, config=config,
        )

    def config_json(self) -> str:
        """The source config as JSON (what ``config.json`` in the workdir holds)."""
        if self.config is not None and hasattr(self.config, "to_json_best_effort"):
            return self.config.to_json_best_effort(indent=2)
        import json

        return json.dumps(dataclasses.asdict(dataclasses.replace(self, config=None)), indent=2, default=str)
