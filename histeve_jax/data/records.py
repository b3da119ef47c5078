"""The one record schema: demonstrations, RL trajectories, detector labels and world-knowledge samples.

A shard is an ArrayRecord file of msgpack-encoded step records. One record is one control step (50 ms at
20 Hz) of one episode, or one world-knowledge sample (an episode of one step).

Layout rules that readers rely on:
- the steps of an episode are contiguous and in order, and an episode never spans two shards, so the history
  of the record at global index ``j`` with ``step == s`` is the records ``j - s .. j``;
- a shard is written to ``<name>.tmp`` and renamed on close, so a crash never leaves a truncated shard under a
  final name, and shards already closed are never touched again.

Fields (``StepRecord``):
  episode_id   str     unique per episode
  step         int     0-based index within the episode
  task_id      str     task name (``mine_log``...), or the data set name for world knowledge
  kind         str     one of ``KINDS``
  instruction  str     the instruction given to the policy (or the question, for world knowledge)
  subtask      str     the current subtask of a long-horizon episode ("" when none)
  frame        bytes   the observation image, encoded as ``frame_format`` (jpeg or png)
  frame_format str
  action       dict    env-format action: 0/1 for each key of ``BINARY_KEYS``, ``camera = [dpitch, dyaw]`` deg
  is_gui_open  bool    the regime: False = non-GUI play (NG), True = GUI
  cursor       list    [x, y] cursor position in render pixels while a GUI is open, else None
  events       dict    cumulative event counters (``mine_block`` ... -> {item: count})
  reward       float   environment reward of this step (0 for demonstrations)
  done         bool    the episode ended after this step
  completed    int     detector label: 1 when the instruction is complete at this step, 0 if not, -1 unknown
  response     str     target text (world knowledge answer or caption; "" otherwise)
  metadata     dict    free-form, msgpack-serialisable
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from histeve_jax.actions.codebook import BUTTONS

KINDS = ("demo", "rl", "detector", "world_knowledge", "eval")
FRAME_FORMATS = ("jpeg", "png")
BINARY_KEYS = BUTTONS  # the env format's binary keys, defined once in actions.codebook
SHARD_SUFFIX = ".array_record"


class RecordError(ValueError):
    """A record that does not follow the schema; the message names the field."""


@dataclasses.dataclass
class StepRecord:
    episode_id: str
    step: int
    task_id: str
    kind: str
    instruction: str
    frame: bytes
    action: dict[str, Any]
    is_gui_open: bool
    frame_format: str = "jpeg"
    subtask: str = ""
    cursor: list[float] | None = None
    events: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    reward: float = 0.0
    done: bool = False
    completed: int = -1
    response: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


_FIELDS = {f.name: f for f in dataclasses.fields(StepRecord)}
_REQUIRED = tuple(n for n, f in _FIELDS.items()
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def encode_frame(image: np.ndarray, fmt: str = "jpeg", quality: int = 95) -> bytes:
    """Compress an HxWx3 uint8 image."""
    from PIL import Image

    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise RecordError(f"frame must be HxWx3 uint8, got {image.dtype} {image.shape}")
    buf = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    elif fmt == "png":
        Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    else:
        raise RecordError(f"frame_format must be one of {FRAME_FORMATS}, got {fmt!r}")
    return buf.getvalue()


def decode_frame(data: bytes) -> np.ndarray:
    """Decompress a frame to HxWx3 uint8; raises RecordError if the bytes do not decode."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise RecordError(f"frame does not decode: {e}") from e


def _check(rec: Mapping[str, Any]) -> None:
    missing = [n for n in _REQUIRED if n not in rec]
    if missing:
        raise RecordError(f"record missing field(s) {missing}")
    unknown = sorted(set(rec) - set(_FIELDS))
    if unknown:
        raise RecordError(f"record has unknown field(s) {unknown}")
    if rec["kind"] not in KINDS:
        raise RecordError(f"field 'kind' must be one of {KINDS}, got {rec['kind']!r}")
    if rec.get("frame_format", "jpeg") not in FRAME_FORMATS:
        raise RecordError(f"field 'frame_format' must be one of {FRAME_FORMATS}, got {rec['frame_format']!r}")
    if not isinstance(rec["step"], int) or rec["step"] < 0:
        raise RecordError(f"field 'step' must be a non-negative int, got {rec['step']!r}")
    if not isinstance(rec["frame"], bytes | bytearray):
        raise RecordError("field 'frame' must be bytes")
    action = rec["action"]
    if not isinstance(action, Mapping) or "camera" not in action or np.size(action["camera"]) != 2:
        raise RecordError("field 'action' must be an env-format dict with camera = [dpitch, dyaw]")


def serialize(rec: StepRecord | Mapping[str, Any]) -> bytes:
    """Encode one record (validated) as msgpack bytes."""
    d = dataclasses.asdict(rec) if isinstance(rec, StepRecord) else dict(rec)
    _check(d)
    if isinstance(d["action"].get("camera"), np.ndarray):
        d["action"] = {**d["action"], "camera": [float(v) for v in d["action"]["camera"]]}
    return msgpack.packb(d, use_bin_type=True, default=_np_default)


def _np_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot serialise {type(obj).__name__} in a record")


def deserialize(data: bytes) -> StepRecord:
    """Decode msgpack bytes into a StepRecord; raises RecordError naming the problem."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise RecordError(f"record is not valid msgpack: {e}") from e
    if not isinstance(d, dict):
        raise RecordError(f"record must be a map, got {type(d).__name__}")
    _check(d)
    return StepRecord(**d)


class ShardWriter:
    """Writes records to numbered ArrayRecord shards in ``directory``, never splitting an episode.

    ``write_episode`` appends a whole episode; a new shard starts once the current one holds at least
    ``records_per_shard`` records. Shards are named ``{prefix}-{i:05d}.array_record``.
    """

    def __init__(self, directory: str | os.PathLike, prefix: str = "data", records_per_shard: int = 2048):
        self.directory = os.fspath(directory)
        self.prefix = prefix
        self.records_per_shard = records_per_shard
        os.makedirs(self.directory, exist_ok=True)
        # Appending continues after the highest existing index (not the count: a gap left by a deleted
        # shard must not make the next shard replace a closed one).
        pat = re.compile(rf"^{re.escape(prefix)}-(\d+){re.escape(SHARD_SUFFIX)}$")
        indices = [int(m.group(1)) for f in os.listdir(self.directory) if (m := pat.match(f))]
        self._next_index = max(indices) + 1 if indices else 0
        self._writer = None
        self._tmp_path = ""
        self._count = 0
        self.paths: list[str] = []

    def _open(self) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        name = f"{self.prefix}-{self._next_index:05d}{SHARD_SUFFIX}"
        self._next_index += 1
        self._final_path = os.path.join(self.directory, name)
        self._tmp_path = self._final_path + ".tmp"
        # group_size 1: every record is its own chunk, so random access reads one record, not a group.
        self._writer = ArrayRecordWriter(self._tmp_path, "group_size:1")
        self._count = 0

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        os.replace(self._tmp_path, self._final_path)
        self.paths.append(self._final_path)
        self._writer = None

    def write_episode(self, records: Sequence[StepRecord | Mapping[str, Any]]) -> None:
        """Validate and append one episode (steps 0..n-1 of one episode id) to the current shard."""
        blobs = [serialize(r) for r in records]  # validate all before writing any
        eps = {(r.episode_id if isinstance(r, StepRecord) else r["episode_id"]) for r in records}
        steps = [r.step if isinstance(r, StepRecord) else r["step"] for r in records]
        if len(eps) != 1 or steps != list(range(len(steps))):
            raise RecordError(f"write_episode needs steps 0..n-1 of one episode, got episodes {sorted(eps)} "
                              f"and steps {steps[:5]}...")
        if self._writer is None or self._count >= self.records_per_shard:
            self._close_shard()
            self._open()
        for b in blobs:
            self._writer.write(b)
        self._count += len(blobs)

    def close(self) -> list[str]:
        """Close the open shard; returns the paths of all shards this writer wrote."""
        self._close_shard()
        return self.paths

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shard_paths(directory: str | os.PathLike, prefix: str | None = None) -> list[str]:
    """Completed shards in ``directory`` in name order (``.tmp`` files of crashed writers are ignored)."""
    d = os.fspath(directory)
    if not os.path.isdir(d):
        raise FileNotFoundError(f"record directory {d} does not exist")
    names = sorted(f for f in os.listdir(d) if f.endswith(SHARD_SUFFIX)
                   and (prefix is None or f.startswith(prefix + "-")))
    return [os.path.join(d, f) for f in names]


def read_shard(path: str | os.PathLike) -> Iterator[StepRecord]:
    """Sequentially decode every record of one shard (for tools and tests; pipelines use grain)."""
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(os.fspath(path))
    try:
        for i in range(reader.num_records()):
            yield deserialize(reader.read([i])[0])
    finally:
        reader.close()


def write_episodes(directory: str | os.PathLike, episodes: Iterable[Sequence[StepRecord]],
                   prefix: str = "data", records_per_shard: int = 2048) -> list[str]:
    """Write many episodes; returns the shard paths."""
    with ShardWriter(directory, prefix, records_per_shard) as w:
        for ep in episodes:
            w.write_episode(ep)
    return w.paths
