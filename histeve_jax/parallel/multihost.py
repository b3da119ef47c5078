"""Multi-host (multi-controller) helpers: distributed start-up and process-local batches to global arrays.

On a pod every host runs the same program; ``initialize`` connects them (``jax.distributed.initialize``),
each host loads only its rows of the global batch (:func:`process_rows`; :func:`section_rows` for a batch
laid out as consecutive sections), and :func:`global_batch` assembles them into one global ``jax.Array``
sharded over the batch axes without moving data between hosts. A decision one host makes for all (which
shard comes next) travels through the distributed runtime's key-value store (:func:`publish`,
:func:`published`, :func:`try_published`), not through a collective on the devices.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

# Environment variables that say this process is one of several (Cloud TPU pod workers, multi-slice,
# an explicit coordinator, SLURM/Open MPI launches).
_POD_ENV = (
    "MEGASCALE_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_ADDRESS",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
)


def on_pod(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment describes a multi-process run (e.g. a TPU pod slice with several workers)."""
    env = os.environ if environ is None else environ
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return True
    for name in _POD_ENV:
        value = env.get(name, "")
        if name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
            if value.isdigit() and int(value) > 1:
                return True
        elif value:
            return True
    return False


def initialize(
    mode: str = "auto",
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: list[int] | None = None,
) -> bool:
    """Start jax's distributed runtime: ``mode`` "auto" (when :func:`on_pod`), "on" or "off". Without explicit
    arguments jax detects the coordinator on Cloud TPU / SLURM. Returns whether it was initialised."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"distributed mode must be auto|on|off, got {mode!r}")
    explicit = coordinator_address is not None
    if mode == "off" or (mode == "auto" and not explicit and not on_pod()):
        return False
    if jax.distributed.is_initialized():
        return True
    kwargs: dict[str, Any] = {}
    if coordinator_address is not None:
        kwargs.update(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
        )
    if local_device_ids is not None:
        kwargs["local_device_ids"] = local_device_ids
    jax.distributed.initialize(**kwargs)
    return True


def initialize_from_config(cfg: Any) -> bool:
    """:func:`initialize` from a config's ``distributed`` field: "auto"|"on"|"off", or a dict with ``mode``,
    ``coordinator_address``, ``num_processes``, ``process_id``."""
    d = cfg.get("distributed", "auto") if hasattr(cfg, "get") else "auto"
    if isinstance(d, str):
        return initialize(d)
    d = dict(d)
    return initialize(
        d.pop("mode", "auto"),
        coordinator_address=d.pop("coordinator_address", None),
        num_processes=d.pop("num_processes", None),
        process_id=d.pop("process_id", None),
    )


def process_rows(sharding: NamedSharding, global_batch: int) -> slice:
    """The contiguous rows of a [global_batch, ...] array that this process's devices hold under ``sharding``
    (on its leading axis); this host's data loader reads exactly these."""
    indices = sharding.addressable_devices_indices_map((global_batch,))
    starts = [idx[0].start or 0 for idx in indices.values()]
    stops = [global_batch if idx[0].stop is None else idx[0].stop for idx in indices.values()]
    lo, hi = min(starts), max(stops)
    covered = np.zeros(global_batch, bool)
    for a, b in zip(starts, stops, strict=True):
        covered[a:b] = True
    if not covered[lo:hi].all():
        raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows under {sharding}")
    return slice(lo, hi)


def section_rows(rows: slice, sizes: Sequence[int]) -> list[slice]:
    """For a global batch laid out as consecutive sections of ``sizes`` rows: the part of ``rows`` (this
    host's, :func:`process_rows`) in each section, as a slice of that section's own rows (maybe empty)."""
    out, start = [], 0
    for n in sizes:
        out.append(slice(min(max(rows.start - start, 0), n), min(max(rows.stop - start, 0), n)))
        start += n
    return out


def _kv_client() -> Any:
    # jax's own multihost_utils reaches the coordination service's client the same way.
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialised: there is no key-value store to agree through")
    return distributed.global_state.client


def publish(key: str, value: str) -> None:
    """Store ``value`` under ``key`` in the job's key-value store, for every host to read with
    :func:`published`; a key is set once per job (setting it again raises)."""
    _kv_client().key_value_set(key, value)


def try_published(key: str) -> str | None:
    """The value stored under ``key``, or None if none is yet (no waiting)."""
    try:
        return _kv_client().key_value_try_get(key)
    except jax.errors.JaxRuntimeError as e:
        if "NOT_FOUND" in str(e):
            return None
        raise


def published(key: str, timeout_s: float) -> str:
    """The value stored under ``key``, waiting up to ``timeout_s`` for another host to :func:`publish` it."""
    try:
        return _kv_client().blocking_key_value_get(key, max(int(timeout_s * 1000), 1))
    except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" in str(e):
            raise TimeoutError(f"no value for {key!r} after {timeout_s:.0f} s (is process 0 alive?)") from e
        raise


def global_batch(local: Any, sharding: NamedSharding, global_batch_size: int) -> Any:
    """Global arrays [global_batch_size, ...] from this host's rows (numpy leaves [rows, ...])."""

    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (global_batch_size, *x.shape[1:]))

    return jax.tree.map(one, local)
