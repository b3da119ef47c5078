"""One train loop for every stage, big_vision-style: ``train(spec, stage)``.

It builds the mesh, the optimizer and the jitted step around the stage's module and loss, restores the
latest checkpoint of the workdir if there is one (parameters, optimizer, step and the data iterator, so
the run continues exactly), or else starts from ``init_from`` (the previous stage's workdir) or the
initial weights, and trains. Metrics go to TensorBoard and the console (clu), progress to a tqdm bar;
every ``eval_every`` steps the held-out split is evaluated (loss, per-token-group accuracy); checkpoints
are asynchronous, the last N kept. SIGTERM saves and stops (``Preemption``); so does a batch source that
ends (``StopIteration``: RL's stream once its actors are done).
"""

from __future__ import annotations

import itertools
import logging as pylogging
import os
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from histeve_jax.parallel import axes, multihost
from histeve_jax.parallel import mesh as mesh_lib
from histeve_jax.train import data as data_lib
from histeve_jax.train import optimizer as optimizer_lib
from histeve_jax.train import step as step_lib
from histeve_jax.train.checkpoint import Checkpointer
from histeve_jax.train.setup import Stage, build_state, policy_stage
from histeve_jax.train.specs import RunSpec
from histeve_jax.train.state import TrainState


def _device_batch(batch: Mapping[str, np.ndarray], keys: tuple[str, ...], sharding: Any,
                  global_size: int) -> dict[str, jax.Array]:
    return multihost.global_batch({k: batch[k] for k in keys if k in batch}, sharding, global_size)


def evaluate(eval_step: Any, state: Any, batches: Iterator[dict[str, np.ndarray]], keys: tuple[str, ...],
             sharding: Any, global_size: int, max_batches: int) -> dict[str, float]:
    """Mean eval metrics over up to ``max_batches`` batches; accuracies weighted by their token counts."""
    sums: dict[str, float] = {}
    n = 0
    for batch in itertools.islice(batches, max_batches):
        m = jax.device_get(eval_step(state, _device_batch(batch, keys, sharding, global_size)))
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


class Preemption:
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


def train(spec: RunSpec, stage: Stage | None = None) -> dict[int, dict[str, float]]:
    """Run (or resume) one stage (default: the policy stage of ``spec``); returns the logged metrics by
    step (for tests and notebooks)."""
    from clu import metric_writers

    multihost.initialize_from_config({"distributed": spec.distributed})
    if not any(isinstance(f, _QuietLibraries) for f in logging.get_absl_logger().filters):
        logging.get_absl_logger().addFilter(_QuietLibraries())
    workdir, loop = spec.workdir, spec.loop
    os.makedirs(workdir, exist_ok=True)
    logging.info("workdir: %s", workdir)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(spec.config_json())

    train_dirs, eval_dirs = data_lib.data_dirs(spec)
    stage = stage or policy_stage(spec)
    tx, schedule = optimizer_lib.make_optimizer(spec.optimizer)
    mesh = mesh_lib.mesh_from_config(spec.mesh)
    rules = axes.RULES
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=loop.keep_checkpoints,
                        async_save=loop.async_checkpoint)
    state, shardings, data_state = build_state(spec, stage, tx, mesh, rules, ckpt)
    train_it = stage.make_iterator(train_dirs, spec.data, train=True)
    if int(state.step) > 0:
        data_state = data_lib.load_host_iterator_state(workdir, int(state.step), data_state)
        if data_state is None:
            raise ValueError(f"{workdir}: checkpoint step {int(state.step)} has no data iterator state")
        train_it.set_state(data_state)

    step_fn = step_lib.make_train_step(stage.loss_fn, tx, schedule=schedule, microbatches=loop.microbatches)
    train_step = step_lib.jit_train_step(step_fn, shardings, mesh, rules)
    batch_sharding = step_lib.batch_sharding(mesh, rules)
    keys = stage.device_keys

    def eval_fn(state: TrainState, batch: Any) -> dict[str, jax.Array]:
        # The same activation constraints as the train step, so the forward is laid out as in training.
        with axes.activate(mesh, rules):
            loss, metrics = stage.loss_fn(state.model(), batch, jax.random.key(0))
        return {**metrics, "loss": loss}

    eval_step = jax.jit(eval_fn, in_shardings=(shardings, batch_sharding))
    writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)
    rng = jax.random.key(loop.seed)
    start, total, gbs = int(state.step), loop.num_train_steps, spec.data.batch_size
    history: dict[int, dict[str, float]] = {}
    preempted = Preemption()
    bar = None
    if loop.progress_bar and jax.process_index() == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc=spec.stage, unit="step", dynamic_ncols=True)
    t_last, step_last = time.perf_counter(), start
    try:
        for step in range(start + 1, total + 1):
            try:
                host_batch = next(train_it)
            except StopIteration:  # a finite source (RL's stream once its actors are done): keep what trained
                logging.info("the data ended before step %d: saving step %d and stopping", step, step - 1)
                if step - 1 > start and (step - 1) % loop.checkpoint_every:
                    ckpt.save(step - 1, state, data_iter_state=train_it.get_state(), config=spec.config)
                break
            batch = _device_batch(host_batch, keys, batch_sharding, gbs)
            state, metrics = train_step(state, batch, rng)
            if bar is not None:
                bar.update(1)
            if step % loop.log_every == 0 or step == total or step == start + 1:
                m = _scalars(jax.device_get(metrics))
                now = time.perf_counter()
                m["steps_per_sec"] = (step - step_last) / max(now - t_last, 1e-9)
                t_last, step_last = now, step
                m.update(train_it.metrics())
                history[step] = m
                writer.write_scalars(step, m)
                if bar is not None:
                    bar.set_postfix(loss=f"{m['loss']:.4f}")
            if loop.eval_every > 0 and eval_dirs and (step % loop.eval_every == 0 or step == total):
                eval_it = stage.make_iterator(eval_dirs, spec.data, train=False)
                em = evaluate(eval_step, state, eval_it, keys, batch_sharding, gbs, loop.eval_batches)
                history.setdefault(step, {}).update(em)
                writer.write_scalars(step, em)
            if step == loop.stop_at_step:
                logging.info("stop_at_step=%d: leaving without a final save (a simulated kill)", step)
                break
            # SIGTERM on this host, or a preemption notice all hosts agreed on (orbax / jax sync)
            preempted.flag = preempted.flag or ckpt.reached_preemption(step)
            if step % loop.checkpoint_every == 0 or step == total or preempted.flag:
                data_state = train_it.get_state()
                if jax.process_count() > 1:
                    data_lib.save_host_iterator_state(workdir, step, data_state, loop.keep_checkpoints)
                ckpt.save(step, state, data_iter_state=data_state, config=spec.config, force=preempted.flag)
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
