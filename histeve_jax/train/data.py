"""A run's data: its shard directories (given, recorded from the game, or generated), this host's batch
iterators, and each host's data-iterator state beside the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
from absl import logging

from histeve_jax.data import pipeline, synthetic
from histeve_jax.data import records as records_lib
from histeve_jax.train.specs import DataSpec, RunSpec

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _synthetic_dirs(spec: RunSpec) -> tuple[list[str], list[str]]:
    """Generate (once) the small data set the tiny runs use, under ``<workdir>/data``."""
    s, d = spec.synthetic, spec.data
    h, w = d.image_size
    root = os.path.join(spec.workdir, "data")
    out = []
    for split, size, seed in (("train", s.train_size, 0), ("eval", s.eval_size, 10_000)):
        path = os.path.join(root, split)
        if jax.process_index() == 0:
            if d.kind == "demo":
                synthetic.ensure_dataset(path, "demo", episodes=size, length=s.length, height=h, width=w,
                                         gui_fraction=s.gui_fraction, seed=seed)
            else:
                synthetic.ensure_dataset(path, "wk", samples=size, height=h, width=w, seed=seed)
        out.append([path])
    return out[0], out[1]


def _recorded_dirs(spec: RunSpec) -> tuple[list[str], list[str]] | None:
    """Record (once) expert demonstrations from the Luanti game, split by episode into train and eval.

    The recorder runs as its own program (``python -m experiments.record``): it owns its flags and the game
    processes. Returns None when the game is not installed.
    """
    from histeve_jax.envs.luanti.process import minetest_available

    root = os.path.join(spec.workdir, "data")
    train, evald = os.path.join(root, "train"), os.path.join(root, "eval")
    if os.path.isdir(train) and records_lib.shard_paths(train):
        return [train], [evald]
    if not minetest_available():
        return None
    if jax.process_index() == 0:
        rec, (h, w) = spec.record, spec.data.image_size
        out = os.path.join(root, "recorded")
        record_config = os.path.join(_REPO, "experiments", "configs", "record.py")
        cmd = [sys.executable, "-m", "experiments.record", f"--config={record_config}:{rec.variant}",
               f"--workdir={os.path.join(root, 'record_run')}", f"--config.output_dir={out}",
               f"--config.episodes={rec.episodes}", f"--config.task_episodes={rec.task_episodes}",
               f"--config.perturb={rec.perturb}",
               f"--config.obs_size=({h}, {w})",
               f"--config.instances={rec.instances}",
               f"--config.frame_format={spec.data.frame_format}",
               f"--config.jpeg_quality={spec.data.jpeg_quality}",
               "--config.progress_bar=False"]
        logging.info("data: recording from the game: %s", " ".join(cmd))
        subprocess.run(cmd, check=True, timeout=rec.timeout_s, cwd=_REPO)
        split_by_task(out, train, evald)
    return [train], [evald]


def split_by_task(source: str, train: str, evald: str) -> tuple[int, int]:
    """Copy the episodes of ``source`` into ``train`` and ``evald``: the last episode of each task (in
    recording order) is held out. Returns (train episodes, eval episodes)."""
    episodes: dict[str, list] = {}
    for p in records_lib.shard_paths(source):
        for r in records_lib.read_shard(p):
            episodes.setdefault(r.episode_id, []).append(r)
    last = {}
    for eid, steps in episodes.items():
        last[steps[0].task_id] = eid
    held = set(last.values())
    records_lib.write_episodes(train, [e for k, e in episodes.items() if k not in held], prefix="recorded")
    records_lib.write_episodes(evald, [episodes[k] for k in last.values()], prefix="recorded")
    return len(episodes) - len(held), len(held)


def data_dirs(spec: RunSpec) -> tuple[list[str], list[str]]:
    """(train, eval) shard directories: the configured ones, or data recorded from the game / generated."""
    train, evald = list(spec.data.train_dirs), list(spec.data.eval_dirs)
    if train:
        return train, evald
    got = None
    if spec.data.generate == "record":
        got = _recorded_dirs(spec)
        if got is None:
            logging.warning("data: the Luanti game (minetest, Xvfb) is not installed; using synthetic data")
    if got is None:
        got = _synthetic_dirs(spec)
        logging.info("data: no data.train_dirs given; using synthetic data under %s",
                     os.path.dirname(got[0][0]))
    if jax.process_count() > 1:
        # Process 0 writes the data; the other hosts must not open the shards before they are complete.
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("histeve data_dirs")
    return got[0], evald or got[1]


def make_iterator(dirs: list[str], data: DataSpec, features: pipeline.FeatureSpec, *,
                  train: bool) -> pipeline.Batches:
    """This host's batch iterator (its share of the global batch, its shard of the data)."""
    per_host, rem = divmod(data.batch_size, jax.process_count())
    if rem:
        raise ValueError(f"data.batch_size={data.batch_size} is not divisible by {jax.process_count()} hosts")
    opts = pipeline.LoaderOptions(
        # eval: one pass in a fixed shuffled order, so the first eval_batches batches span the whole split.
        # Several hosts repeat it instead: each skips its own bad samples, and a host whose pass ran out a
        # batch early would leave the others waiting in the collective eval step.
        batch_size=per_host, seed=data.seed, shuffle=data.shuffle if train else True,
        num_epochs=None if train or jax.process_count() > 1 else 1,
        worker_count=data.worker_count, worker_buffer_size=data.worker_buffer_size,
        read_threads=data.read_threads, max_bad_fraction=data.max_bad_fraction,
        min_samples_for_check=data.min_samples_for_check,
        shard_index=jax.process_index(), shard_count=jax.process_count(),
        task_weights=dict(data.task_weights) if train else None)
    return pipeline.make_batches(dirs, features, opts)


def _host_state_path(workdir: str, step: int) -> str:
    return os.path.join(workdir, "data_state", str(step), f"process_{jax.process_index()}.json")


def save_host_iterator_state(workdir: str, step: int, state: object, keep: int) -> None:
    """Each host's own iterator state for ``step`` (the checkpoint's ``data_iter`` item is written by one
    host only, and hosts' iterators differ: their shards, and the bad samples each skipped)."""
    path = _host_state_path(workdir, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)
    root = os.path.join(workdir, "data_state")
    steps = sorted(int(d) for d in os.listdir(root) if d.isdigit())
    for old in steps[: max(len(steps) - max(keep, 1) - 1, 0)]:  # one extra: a save may still be in flight
        stale = os.path.join(root, str(old), os.path.basename(path))
        if os.path.exists(stale):
            os.remove(stale)


def load_host_iterator_state(workdir: str, step: int, fallback: object) -> object:
    """This host's iterator state of ``step``; one host alone uses the checkpoint's (``fallback``)."""
    path = _host_state_path(workdir, step)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if jax.process_count() > 1:
        # The checkpoint's copy is process 0's position and counters: another host resuming from it would
        # not continue its own shard exactly (grain's state does not record the shard, so it would not say).
        raise FileNotFoundError(f"{path}: no data iterator state of this host for checkpoint step {step} "
                                "(is the workdir shared by every host?)")
    return fallback
