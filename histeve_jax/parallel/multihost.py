"""Multi-host (multi-controller) helpers: distributed start-up and process-local batches to global arrays.

On a pod every host runs the same program; ``initialize`` connects them (``jax.distributed.initialize``),
each host loads only its rows of the global batch (:func:`process_rows`), and :func:`global_batch` assembles
them into one global ``jax.Array`` sharded over the batch axes without moving data between hosts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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


def global_batch(local: Any, sharding: NamedSharding, global_batch_size: int) -> Any:
    """Global arrays [global_batch_size, ...] from this host's rows (numpy leaves [rows, ...])."""

    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (global_batch_size, *x.shape[1:]))

    return jax.tree.map(one, local)
