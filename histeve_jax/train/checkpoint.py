"""Checkpoints of the train state plus the data iterator's state and the config, with orbax.

A checkpoint step holds three items: ``state`` (every array of the :class:`TrainState` as a nested dict keyed
by its tree path, so the files read as ``params/language_model/.../kernel``), ``data_iter`` (JSON, grain's
``DatasetIterator.get_state()``) and ``config`` (JSON). Saving is asynchronous (the device-to-host copy
blocks, the write does not) and orbax makes it atomic: a step is written under a temporary name and renamed
(or, on GCS, marked committed) only when complete, so a crash never leaves a half step that restore would
pick. Restore takes an abstract target whose ``ShapeDtypeStruct``s carry shardings, so a checkpoint written
on one mesh restores onto another, each host reading only its shards. Every host calls save and restore.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

_STATE, _DATA, _CONFIG = "state", "data_iter", "config"


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    raise TypeError(f"checkpoint: unsupported tree key {k!r}")


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _flat(tree: Any) -> tuple[list[tuple[tuple[str, ...], Any]], Any]:
    """[(path names, array or Variable)], treedef; Variables count as leaves so their metadata survives."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_var)
    return [(tuple(_key_name(k) for k in path), x) for path, x in leaves], treedef


def to_nested_dict(tree: Any) -> dict[str, Any]:
    """The arrays of ``tree`` in a nested dict keyed by their path names (Variables unwrapped)."""
    out: dict[str, Any] = {}
    for names, x in _flat(tree)[0]:
        if not names:
            raise ValueError("checkpoint: the state must be a container, not a bare array")
        node = out
        for n in names[:-1]:
            node = node.setdefault(n, {})
        node[names[-1]] = x.get_value() if _is_var(x) else x
    return out


def from_nested_dict(nested: dict[str, Any], like: Any) -> Any:
    """The inverse of :func:`to_nested_dict`: ``like``'s structure and Variable metadata, ``nested``'s
    arrays."""
    flat, treedef = _flat(like)
    leaves = []
    for names, x in flat:
        node: Any = nested
        for n in names:
            if not isinstance(node, dict) or n not in node:
                raise KeyError(f"checkpoint: no array at {'/'.join(names)} in the restored state")
            node = node[n]
        leaves.append(x.replace(node) if _is_var(x) else node)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _config_json(config: Any) -> Any:
    if config is None:
        return None
    if hasattr(config, "to_json_best_effort"):  # ml_collections.ConfigDict
        return json.loads(config.to_json_best_effort())
    return json.loads(json.dumps(config, default=str))


def _iter_json(data_iter_state: Any) -> Any:
    # grain's DataLoader iterators return their state as JSON bytes, dataset iterators as a dict.
    if isinstance(data_iter_state, bytes):
        return {"__bytes_utf8__": data_iter_state.decode("utf-8")}
    return data_iter_state


def _iter_from_json(saved: Any) -> Any:
    if isinstance(saved, dict) and set(saved) == {"__bytes_utf8__"}:
        return saved["__bytes_utf8__"].encode("utf-8")
    return saved


class Checkpointer:
    """An orbax ``CheckpointManager`` keeping the last ``max_to_keep`` steps of a run under ``directory``."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        self.directory = epath.Path(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(_STATE, _DATA, _CONFIG)
        )

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_iter_state: Any = None,
        config: Any = None,
        force: bool = False,
    ) -> bool:
        """Start saving ``state`` (and the iterator state and config) as ``step``; False when the interval
        skips it. Returns once the arrays are copied off the devices."""
        items: dict[str, Any] = {_STATE: ocp.args.StandardSave(to_nested_dict(state))}
        if data_iter_state is not None:
            items[_DATA] = ocp.args.JsonSave(_iter_json(data_iter_state))
        if config is not None:
            items[_CONFIG] = ocp.args.JsonSave(_config_json(config))
        return self._manager.save(int(step), args=ocp.args.Composite(**items), force=force)

    def latest_step(self) -> int | None:
        """The newest complete step, or None for an empty directory."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Complete steps on disk, oldest first."""
        return sorted(self._manager.all_steps())

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, Any, Any]:
        """(state, data iterator state or None, config dict or None) of ``step`` (default: the latest).

        ``abstract_state`` is the target: a TrainState of ``ShapeDtypeStruct``s with shardings (see
        ``train.state.abstract_train_state``); arrays are read straight into those shardings."""
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"checkpoint: no complete step under {self.directory}")
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"checkpoint: step {step} not under {self.directory}")
        present = {p.name for p in (self.directory / str(step)).iterdir()}
        items: dict[str, Any] = {_STATE: ocp.args.StandardRestore(to_nested_dict(abstract_state))}
        for name in (_DATA, _CONFIG):
            if name in present:
                items[name] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        state = from_nested_dict(restored[_STATE], abstract_state)
        data = _iter_from_json(restored[_DATA]) if _DATA in present else None
        config = restored[_CONFIG] if _CONFIG in present else None
        return state, data, config

    def reached_preemption(self, step: int) -> bool:
        """Whether the hosts agreed that a preemption notice arrived (jax's sync), so save at ``step``."""
        return bool(self._manager.reached_preemption(int(step)))

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager's threads."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
