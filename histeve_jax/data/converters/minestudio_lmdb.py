"""MineStudio's chunked LMDB data sets into record shards.

Layout (``minestudio/data/minecraft/core.py`` and ``tools/convertion.py``): a data set directory holds one
folder per modality, ``image`` (or ``video``), ``action`` and ``meta_info`` (or ``contractor_info``), each
with LMDB environments ``part-*``. Every environment stores pickled ``__chunk_size__``,
``__chunk_infos__`` (a list of ``{"episode", "episode_idx", "num_frames"}``), ``__num_episodes__`` and
``__num_total_frames__``, and one value per chunk under the key ``str((episode_idx, chunk_start))``:
- image: the mp4 bytes of ``chunk_size`` frames (the GUI cursor is already drawn in);
- action: a pickled dict of arrays, ``camera`` ``[chunk, 2]`` degrees and one ``[chunk]`` array per button;
- meta_info: a pickled list of per-frame dicts (``isGuiOpen``, ``cursor_x``, ``cursor_y``, ``yaw``, ...).
An episode is used when all three modalities have it with the same length, as MineStudio's KernelManager does.
Null actions were already dropped when MineStudio built the LMDB, so nothing is filtered here.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np

from histeve_jax.data import records as R
from histeve_jax.data.converters import ConversionStats

MODALITY_DIRS = {
    "image": ("image", "video"), "action": ("action",), "meta_info": ("meta_info", "contractor_info"),
}


class _Modality:
    """All LMDB environments of one modality, merged into one view of episodes."""

    def __init__(self, dirs: list[str]):
        import lmdb

        self.envs: list[Any] = []
        # name -> (env, episode_idx, num_frames, chunk_size): the chunk size is each environment's own
        # (MineStudio keeps only the last one read, which mis-reads parts written with another size).
        self.episodes: dict[str, tuple[Any, int, int, int]] = {}
        try:
            for d in dirs:
                for part in sorted(os.listdir(d)):
                    env = lmdb.open(os.path.join(d, part), readonly=True, lock=False, max_readers=128)
                    self.envs.append(env)
                    with env.begin() as txn:
                        raw = {k: txn.get(k.encode()) for k in ("__chunk_size__", "__chunk_infos__")}
                        missing = [k for k, v in raw.items() if v is None]
                        if missing:
                            raise R.RecordError(f"{os.path.join(d, part)}: LMDB lacks key(s) {missing}")
                        chunk_size = pickle.loads(raw["__chunk_size__"])
                        for info in pickle.loads(raw["__chunk_infos__"]):
                            self.episodes[info["episode"]] = (env, info["episode_idx"], info["num_frames"],
                                                              chunk_size)
        except BaseException:
            self.close()  # the environments opened before the failure
            raise

    def chunks(self, episode: str) -> Iterator[bytes]:
        env, idx, n, chunk_size = self.episodes[episode]
        with env.begin() as txn:
            for start in range(0, n, chunk_size):
                val = txn.get(str((idx, start)).encode())
                if val is None:
                    raise R.RecordError(f"episode {episode}: chunk key {(idx, start)} missing")
                yield val

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _modality_dirs(dataset_dir: str) -> dict[str, list[str]]:
    subs = sorted(os.listdir(dataset_dir))
    out = {}
    for modality, names in MODALITY_DIRS.items():
        found = [os.path.join(dataset_dir, s) for s in subs if s in names]
        if not found:
            raise FileNotFoundError(f"{dataset_dir}: no {modality} folder (one of {names}) found")
        out[modality] = found
    return out


def decode_video_chunk(data: bytes) -> np.ndarray:
    """mp4 bytes -> [T, H, W, 3] uint8."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def episode_records(episode: str, image: _Modality, action: _Modality, meta: _Modality, *, instruction: str,
                    task_id: str, frame_format: str = "jpeg") -> list[R.StepRecord]:
    """All frames of one MineStudio episode as records; raises RecordError on inconsistent chunks."""
    frames = np.concatenate([decode_video_chunk(c) for c in image.chunks(episode)])
    acts: dict[str, list[np.ndarray]] = {}
    for c in action.chunks(episode):
        for k, v in pickle.loads(c).items():
            acts.setdefault(k, []).append(np.asarray(v))
    acts_np = {k: np.concatenate(v) for k, v in acts.items()}
    infos = [info for c in meta.chunks(episode) for info in pickle.loads(c)]
    missing = [k for k in (*R.BINARY_KEYS, "camera") if k not in acts_np]
    if missing:
        raise R.RecordError(f"episode {episode}: action chunks lack key(s) {missing}")
    n = len(frames)
    if len(acts_np["camera"]) != n or len(infos) != n:
        raise R.RecordError(f"episode {episode}: {n} frames but {len(acts_np['camera'])} actions and "
                            f"{len(infos)} meta_info entries")
    out = []
    for t in range(n):
        info = infos[t]
        if "isGuiOpen" not in info:
            raise R.RecordError(f"episode {episode} frame {t}: meta_info lacks 'isGuiOpen'")
        gui = bool(info["isGuiOpen"])
        action = {k: int(acts_np[k][t]) for k in R.BINARY_KEYS}
        action["camera"] = [float(acts_np["camera"][t][0]), float(acts_np["camera"][t][1])]
        cursor = [float(info.get("cursor_x", 0)), float(info.get("cursor_y", 0))] if gui else None
        extra = {k: info[k] for k in ("yaw", "pitch", "xpos", "ypos", "zpos", "isGuiInventory") if k in info}
        out.append(R.StepRecord(
            episode_id=episode, step=t, task_id=task_id, kind="demo", instruction=instruction,
            frame=R.encode_frame(frames[t], frame_format), frame_format=frame_format, action=action,
            is_gui_open=gui, cursor=cursor, done=t == n - 1,
            metadata={"source": "minestudio_lmdb", **{k: _plain(v) for k, v in extra.items()}}))
    return out


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def convert_dataset(dataset_dir: str | os.PathLike, output_dir: str | os.PathLike, *, instruction: str = "",
                    task_id: str = "minestudio", frame_format: str = "jpeg", records_per_shard: int = 2048,
                    prefix: str = "minestudio", max_episodes: int | None = None) -> ConversionStats:
    """Convert every episode that all three modalities hold; a broken episode is skipped and counted."""
    dirs = _modality_dirs(os.fspath(dataset_dir))
    opened: list[_Modality] = []
    try:
        for m in ("image", "action", "meta_info"):
            opened.append(_Modality(dirs[m]))
    except BaseException:
        for m in opened:  # a later modality failed to open: close the earlier ones
            m.close()
        raise
    image, action, meta = opened
    stats = ConversionStats()
    try:
        names = sorted(set(image.episodes) & set(action.episodes) & set(meta.episodes))
        stats.skip("episode not in all modalities",
                   len(set(image.episodes) | set(action.episodes) | set(meta.episodes)) - len(names))
        with R.ShardWriter(output_dir, prefix=prefix, records_per_shard=records_per_shard) as writer:
            for name in names[:max_episodes]:
                lengths = {m.episodes[name][2] for m in (image, action, meta)}
                if len(lengths) != 1:
                    stats.skip("modalities disagree on episode length")
                    continue
                try:
                    recs = episode_records(name, image, action, meta, instruction=instruction,
                                           task_id=task_id, frame_format=frame_format)
                except R.RecordError as e:
                    stats.skip(str(e))
                    continue
                except Exception as e:  # av / pickle raise their own types on corrupt chunks
                    stats.skip(f"episode {name}: {type(e).__name__}: {e}")
                    continue
                writer.write_episode(recs)
                stats.episodes += 1
                stats.records += len(recs)
        stats.shards = list(writer.paths)
    finally:
        for m in (image, action, meta):
            m.close()
    return stats


def main(argv: list[str] | None = None) -> None:
    """``python -m histeve_jax.data.converters.minestudio_lmdb DATASET_DIR OUTPUT_DIR [--instruction X]``."""
    import argparse

    ap = argparse.ArgumentParser(description="MineStudio LMDB data set -> record shards")
    ap.add_argument("dataset_dir", help="the folder holding image/ (or video/), action/ and meta_info/")
    ap.add_argument("output_dir")
    ap.add_argument("--instruction", default="")
    ap.add_argument("--task-id", default="minestudio")
    ap.add_argument("--max-episodes", type=int, default=None)
    a = ap.parse_args(argv)
    stats = convert_dataset(a.dataset_dir, a.output_dir, instruction=a.instruction, task_id=a.task_id,
                            max_episodes=a.max_episodes)
    print(f"episodes={stats.episodes} records={stats.records} skipped={dict(stats.skipped)} "
          f"shards={len(stats.shards)}")


if __name__ == "__main__":
    main()
