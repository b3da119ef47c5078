"""One train loop for the policy's supervised stages (world knowledge, imitation), big_vision-style.

``train(config, workdir)`` builds the grain pipelines, the policy (random tiny, or Qwen2.5-VL from a Hugging
Face directory), AdamW, the mesh and the jitted step, restores the latest checkpoint of ``workdir`` if there
is one (parameters, optimizer, step and the data iterator, so the run continues exactly), or else starts
from ``config.init_from`` (the previous stage's workdir) or from the initial weights, and trains. Metrics
go to TensorBoard and the console (clu), progress to a tqdm bar; every ``eval_every`` steps the held-out
split is evaluated (loss, per-token-group accuracy); checkpoints are asynchronous, the last N kept.
"""

from __future__ import annotations

import itertools
import json
import logging as pylogging
import os
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from histeve_jax.data import pipeline as P
from histeve_jax.data import synthetic
from histeve_jax.models import vla
from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLConfig
from histeve_jax.models.qwen2_5_vl import tiny as tiny_base
from histeve_jax.parallel import axes, multihost
from histeve_jax.parallel import mesh as mesh_lib
from histeve_jax.train import optimizer as optimizer_lib
from histeve_jax.train import state as state_lib
from histeve_jax.train import step as step_lib
from histeve_jax.train.checkpoint import Checkpointer

# Batch keys the policy reads; the rest (image_grid_thw) stay on the host.
DEVICE_KEYS = ("input_ids", "attention_mask", "targets", "loss_mask", "regime", "pixel_values")


# ------------------------------------------------------------------------------------------------ data


def _synthetic_dirs(config: Any, workdir: str) -> tuple[list[str], list[str]]:
    """Generate (once) the small data set the tiny runs use, under ``<workdir>/data``."""
    s, d = config.synthetic, config.data
    h, w = d.image_size
    root = os.path.join(workdir, "data")
    kind = "demo" if d.kind == "demo" else "wk"
    out = []
    for split, size, seed in (("train", s.train_size, 0), ("eval", s.eval_size, 10_000)):
        path = os.path.join(root, split)
        if jax.process_index() == 0:
            if kind == "demo":
                synthetic.ensure_dataset(path, "demo", episodes=size, length=s.length, height=h, width=w,
                                         gui_fraction=s.gui_fraction, seed=seed)
            else:
                synthetic.ensure_dataset(path, "wk", samples=size, height=h, width=w, seed=seed)
        out.append([path])
    return out[0], out[1]


def _dir_list(value: str | Any) -> list[str]:
    """Comma-separated directories (or a list, from Python) as a list."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def _recorded_dirs(config: Any, workdir: str) -> tuple[list[str], list[str]] | None:
    """Record (once) expert demonstrations from the Luanti game, split by episode into train and eval.

    The recorder runs as its own program (``python -m experiments.record``): it owns its flags and the game
    processes. Returns None when the game is not installed.
    """
    import subprocess
    import sys

    from histeve_jax.data import records as R
    from histeve_jax.envs.luanti.process import minetest_available

    root = os.path.join(workdir, "data")
    train, evald = os.path.join(root, "train"), os.path.join(root, "eval")
    if os.path.isdir(train) and R.shard_paths(train):
        return [train], [evald]
    if not minetest_available():
        return None
    if jax.process_index() == 0:
        rec, h, w = config.record, *config.data.image_size
        out = os.path.join(root, "recorded")
        record_config = os.path.join(os.path.dirname(__file__), "configs", "record.py")
        cmd = [sys.executable, "-m", "experiments.record", f"--config={record_config}:{rec.variant}",
               f"--workdir={os.path.join(root, 'record_run')}", f"--config.output_dir={out}",
               f"--config.episodes={rec.episodes}", f"--config.obs_size=({h}, {w})",
               "--config.progress_bar=False"]
        logging.info("data: recording from the game: %s", " ".join(cmd))
        subprocess.run(cmd, check=True, timeout=rec.timeout_s, cwd=os.path.dirname(os.path.dirname(__file__)))
        split_by_task(out, train, evald)
    return [train], [evald]


def split_by_task(source: str, train: str, evald: str) -> tuple[int, int]:
    """Copy the episodes of ``source`` into ``train`` and ``evald``: the last episode of each task (in
    recording order) is held out. Returns (train episodes, eval episodes)."""
    from histeve_jax.data import records as R

    episodes: dict[str, list] = {}
    for p in R.shard_paths(source):
        for r in R.read_shard(p):
            episodes.setdefault(r.episode_id, []).append(r)
    last = {}
    for eid, steps in episodes.items():
        last[steps[0].task_id] = eid
    held = set(last.values())
    R.write_episodes(train, [e for k, e in episodes.items() if k not in held], prefix="recorded")
    R.write_episodes(evald, [episodes[k] for k in last.values()], prefix="recorded")
    return len(episodes) - len(held), len(held)


def data_dirs(config: Any, workdir: str) -> tuple[list[str], list[str]]:
    """(train, eval) shard directories: the configured ones, or data recorded from the game / generated."""
    train, evald = _dir_list(config.data.train_dirs), _dir_list(config.data.eval_dirs)
    if train:
        return train, evald
    got = None
    if config.data.generate == "record":
        got = _recorded_dirs(config, workdir)
        if got is None:
            logging.warning("data: the Luanti game (minetest, Xvfb) is not installed; using synthetic data")
    if got is None:
        got = _synthetic_dirs(config, workdir)
        logging.info("data: no data.train_dirs given; using synthetic data under %s",
                     os.path.dirname(got[0][0]))
    if jax.process_count() > 1:
        # Process 0 writes the data; the other hosts must not open the shards before they are complete.
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("histeve data_dirs")
    return got[0], evald or got[1]


def feature_spec(config: Any, cfg: vla.VLAConfig) -> P.FeatureSpec:
    """The pipeline's FeatureSpec; a model whose table is smaller than the tokenizer (the tiny test models)
    gets the compact id remap (see ``pipeline.CompactVocab``)."""
    from histeve_jax.data.tokenizer import NUM_TOKENIZER_IDS

    d = config.data
    compact = None
    b = cfg.base
    if b.text.vocab_size < NUM_TOKENIZER_IDS:
        compact = P.CompactVocab(image_token_id=b.image_token_id, video_token_id=b.video_token_id,
                                 vision_start_token_id=b.vision_start_token_id,
                                 vision_end_token_id=b.vision_end_token_id, action_base=cfg.action_token_base)
    return P.FeatureSpec(kind=d.kind, history=d.history, stride=d.stride, image_size=tuple(d.image_size),
                         max_len=d.max_len, codebook=d.codebook, tokenizer_path=d.tokenizer_path or None,
                         compact_vocab=compact)


def make_iterator(dirs: list[str], config: Any, cfg: vla.VLAConfig, *, train: bool) -> P.Batches:
    """This host's batch iterator (its share of the global batch, its shard of the data)."""
    d = config.data
    per_host, rem = divmod(d.batch_size, jax.process_count())
    if rem:
        raise ValueError(f"data.batch_size={d.batch_size} is not divisible by {jax.process_count()} hosts")
    opts = P.LoaderOptions(
        # eval: one pass in a fixed shuffled order, so the first eval_batches batches span the whole split.
        # Several hosts repeat it instead: each skips its own bad samples, and a host whose pass ran out a
        # batch early would leave the others waiting in the collective eval step.
        batch_size=per_host, seed=d.seed, shuffle=d.shuffle if train else True,
        num_epochs=None if train or jax.process_count() > 1 else 1,
        worker_count=d.worker_count, worker_buffer_size=d.worker_buffer_size, read_threads=d.read_threads,
        max_bad_fraction=d.max_bad_fraction, min_samples_for_check=d.min_samples_for_check,
        shard_index=jax.process_index(), shard_count=jax.process_count())
    return P.make_batches(dirs, feature_spec(config, cfg), opts)


# ----------------------------------------------------------------------------------------------- model


def _dtype(name: str) -> Any:
    return jnp.dtype(name)


def vla_config(config: Any) -> vla.VLAConfig:
    """The policy's config: tiny random, or the base read from the Hugging Face directory's config.json."""
    m, d = config.model, config.data
    kw = dict(codebook=d.codebook, history_frames=d.history if d.kind == "demo" else 0,
              image_size=tuple(d.image_size), max_targets=m.max_targets)
    over = dict(dtype=_dtype(m.dtype), param_dtype=_dtype(m.param_dtype), remat=m.remat)
    if m.kind == "tiny":
        return vla.tiny_config(base=tiny_base().replace(**over), **kw)
    if m.kind != "hf":
        raise ValueError(f"config.model.kind must be 'tiny' or 'hf', got {m.kind!r}")
    path = os.path.join(m.hf_path, "config.json")
    if not m.hf_path or not os.path.exists(path):
        raise FileNotFoundError(f"config.model.hf_path={m.hf_path!r}: no config.json (a Qwen2.5-VL "
                                "save_pretrained directory is needed; models cannot be downloaded here)")
    with open(path) as f:
        base = Qwen2_5_VLConfig.from_hf_dict(json.load(f), source=path).replace(**over)
    return vla.VLAConfig(base=base, **kw)


def _restore_params(directory: str, abstract: state_lib.TrainState) -> Any:
    """The latest params of another run (its TrainState must have the same parameter tree)."""
    ckpt_dir = os.path.join(directory, "checkpoints")
    with Checkpointer(ckpt_dir, async_save=False) as ck:
        if ck.latest_step() is None:
            raise FileNotFoundError(f"config.init_from={directory!r}: no checkpoint under {ckpt_dir}")
        restored, _, _ = ck.restore(abstract)
        logging.info("init_from: params of %s step %d", directory, ck.latest_step())
        return restored.params


def build_state(config: Any, cfg: vla.VLAConfig, tx: Any, mesh: Any, rules: Any,
                ckpt: Checkpointer) -> tuple[state_lib.TrainState, Any, Any]:
    """(state, its shardings, data iterator state or None): resumed, initialised from init_from, or fresh."""

    def model_fn() -> vla.VLAPolicy:
        return vla.VLAPolicy(cfg, rngs=nnx.Rngs(config.seed))

    abstract, shardings = state_lib.abstract_train_state(model_fn, tx, mesh, rules)
    if ckpt.latest_step() is not None:
        state, data_state, _ = ckpt.restore(abstract)
        logging.info("resuming from %s step %d", ckpt.directory, int(state.step))
        return state, shardings, data_state
    # With init_from the previous stage's params replace the initial ones: a random sharded init is then
    # enough, and no host reads the Hugging Face weights (15 GB for the 7B) only to drop them.
    if config.model.kind == "hf" and not config.init_from:
        m = config.model
        overrides = dict(dtype=_dtype(m.dtype), param_dtype=_dtype(m.param_dtype), remat=m.remat)
        policy = vla.VLAPolicy.from_pretrained(m.hf_path, cfg, seed=config.seed, mesh=mesh, rules=rules,
                                               config_overrides=overrides)
        state, shardings = state_lib.shard_model_state(policy, tx, mesh, rules)
    else:
        state, shardings = state_lib.create_train_state(model_fn, tx, mesh, rules)
    if config.init_from:
        params = _restore_params(config.init_from, abstract)
        state = state.replace(params=params)  # a fresh optimizer and step 0 for the new stage
    return state, shardings, None


# ------------------------------------------------------------------------------------------------ loop


def _device_batch(batch: Mapping[str, np.ndarray], sharding: Any, global_size: int) -> dict[str, jax.Array]:
    return multihost.global_batch({k: batch[k] for k in DEVICE_KEYS}, sharding, global_size)


def _loss_fn(model: vla.VLAPolicy, batch: Any, rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return vla.action_loss(model, batch, rng)


def evaluate(eval_step: Any, state: Any, batches: Iterator[dict[str, np.ndarray]], sharding: Any,
             global_size: int, max_batches: int) -> dict[str, float]:
    """Mean eval metrics over up to ``max_batches`` batches; accuracies weighted by their token counts."""
    sums: dict[str, float] = {}
    n = 0
    for batch in itertools.islice(batches, max_batches):
        m = jax.device_get(eval_step(state, _device_batch(batch, sharding, global_size)))
        n += 1
        for k, v in m.items():
            if k.startswith("acc/"):
                c = float(m["count/" + k[4:]])
                sums[k] = sums.get(k, 0.0) + float(v) * c
            else:
                sums[k] = sums.get(k, 0.0) + float(v)
    out = {}
    for k, v in sums.items():
        if k.startswith("acc/"):
            c = sums.get("count/" + k[4:], 0.0)
            if c > 0:
                out["eval/" + k] = v / c
        elif not k.startswith("count/"):
            out["eval/" + k] = v / max(n, 1)
    out["eval/batches"] = float(n)
    return out


def _scalars(m: Mapping[str, Any]) -> dict[str, float]:
    """Loggable scalars: counts dropped, and accuracies of token groups absent from the batch."""
    out = {}
    for k, v in m.items():
        if k.startswith("count/") or (k.startswith("acc/") and float(m.get("count/" + k[4:], 1)) == 0):
            continue
        out[k] = float(v)
    return out


class _QuietLibraries(pylogging.Filter):
    """Drops INFO chatter of orbax (a dozen lines per save) from the console; warnings still pass."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        return record.levelno >= pylogging.WARNING or "orbax" not in record.pathname


def _data_state_path(workdir: str, step: int) -> str:
    return os.path.join(workdir, "data_state", str(step), f"process_{jax.process_index()}.json")


def _save_data_state(workdir: str, step: int, state: Any, keep: int) -> None:
    """Each host's own iterator state for ``step`` (the checkpoint's ``data_iter`` item is written by one
    host only, and hosts' iterators differ: their shards, and the bad samples each skipped)."""
    path = _data_state_path(workdir, step)
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


def _load_data_state(workdir: str, step: int, fallback: Any) -> Any:
    """This host's iterator state of ``step``; one host alone uses the checkpoint's (``fallback``)."""
    path = _data_state_path(workdir, step)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if jax.process_count() > 1:
        # The checkpoint's copy is process 0's position and counters: another host resuming from it would
        # not continue its own shard exactly (grain's state does not record the shard, so it would not say).
        raise FileNotFoundError(f"{path}: no data iterator state of this host for checkpoint step {step} "
                                "(is the workdir shared by every host?)")
    return fallback


class _Preempted:
    """SIGTERM (a preempted VM, a cluster scheduler) asks a single-process run to save and stop at the next
    step. Multi-process runs install no handler: jax.distributed's preemption notifier owns SIGTERM there
    (a Python handler would replace it), and ``Checkpointer.reached_preemption`` makes all hosts stop at
    the same step, where a host-local flag would send one host into a save the others never join."""

    def __init__(self) -> None:
        self.flag = False
        self._previous: Any = None
        if jax.process_count() > 1:
            return
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread (tests): no handler, nothing to stop
            pass

    def _handle(self, *_: Any) -> None:
        self.flag = True

    def restore(self) -> None:
        """Put back the handler that was there before (the loop returns; SIGTERM should kill again)."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def train(config: Any, workdir: str | None = None) -> dict[int, dict[str, float]]:
    """Run (or resume) one stage; returns the logged metrics by step (for tests and notebooks)."""
    from clu import metric_writers

    multihost.initialize_from_config(config)
    if not any(isinstance(f, _QuietLibraries) for f in logging.get_absl_logger().filters):
        logging.get_absl_logger().addFilter(_QuietLibraries())
    workdir = workdir or config.workdir
    os.makedirs(workdir, exist_ok=True)
    logging.info("workdir: %s", workdir)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    train_dirs, eval_dirs = data_dirs(config, workdir)
    cfg = vla_config(config)
    tx, schedule = optimizer_lib.make_optimizer(config.optimizer)
    mesh = mesh_lib.mesh_from_config(config.mesh)
    rules = axes.RULES
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=config.keep_checkpoints,
                        async_save=config.async_checkpoint)
    state, shardings, data_state = build_state(config, cfg, tx, mesh, rules, ckpt)
    train_it = make_iterator(train_dirs, config, cfg, train=True)
    if int(state.step) > 0:
        data_state = _load_data_state(workdir, int(state.step), data_state)
        if data_state is None:
            raise ValueError(f"{workdir}: checkpoint step {int(state.step)} has no data iterator state")
        train_it.set_state(data_state)

    step_fn = step_lib.make_train_step(_loss_fn, tx, schedule=schedule, microbatches=config.microbatches)
    train_step = step_lib.jit_train_step(step_fn, shardings, mesh, rules)
    batch_sharding = step_lib.batch_sharding(mesh, rules)

    def eval_fn(state: state_lib.TrainState, batch: Any) -> dict[str, jax.Array]:
        # The same activation constraints as the train step, so the forward is laid out as in training.
        with axes.activate(mesh, rules):
            loss, metrics = _loss_fn(state.model(), batch, jax.random.key(0))
        return {**metrics, "loss": loss}

    eval_step = jax.jit(eval_fn, in_shardings=(shardings, batch_sharding))
    writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)
    rng = jax.random.key(config.seed)
    start = int(state.step)
    total = int(config.num_train_steps)
    gbs = int(config.data.batch_size)
    history: dict[int, dict[str, float]] = {}
    preempted = _Preempted()
    bar = None
    if config.progress_bar and jax.process_index() == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc=config.stage, unit="step", dynamic_ncols=True)
    t_last, step_last = time.perf_counter(), start
    try:
        for step in range(start + 1, total + 1):
            batch = _device_batch(next(train_it), batch_sharding, gbs)
            state, metrics = train_step(state, batch, rng)
            if bar is not None:
                bar.update(1)
            if step % config.log_every == 0 or step == total or step == start + 1:
                m = _scalars(jax.device_get(metrics))
                now = time.perf_counter()
                m["steps_per_sec"] = (step - step_last) / max(now - t_last, 1e-9)
                t_last, step_last = now, step
                m.update(train_it.metrics())
                history[step] = m
                writer.write_scalars(step, m)
                if bar is not None:
                    bar.set_postfix(loss=f"{m['loss']:.4f}")
            if config.eval_every > 0 and eval_dirs and (step % config.eval_every == 0 or step == total):
                eval_it = make_iterator(eval_dirs, config, cfg, train=False)
                em = evaluate(eval_step, state, eval_it, batch_sharding, gbs, config.eval_batches)
                history.setdefault(step, {}).update(em)
                writer.write_scalars(step, em)
            if step == config.stop_at_step:
                logging.info("stop_at_step=%d: leaving without a final save (a simulated kill)", step)
                break
            # SIGTERM on this host, or a preemption notice all hosts agreed on (orbax / jax sync)
            preempted.flag = preempted.flag or ckpt.reached_preemption(step)
            if step % config.checkpoint_every == 0 or step == total or preempted.flag:
                data_state = train_it.get_state()
                if jax.process_count() > 1:
                    _save_data_state(workdir, step, data_state, config.keep_checkpoints)
                ckpt.save(step, state, data_iter_state=data_state, config=config, force=preempted.flag)
            if preempted.flag:
                logging.info("preempted: saved step %d, stopping", step)
                break
    finally:
        preempted.restore()
        if bar is not None:
            bar.close()
        ckpt.close()
        writer.close()  # flushes; a second train() in the same process (tests) opens its own event file
    return history
