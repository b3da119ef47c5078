"""The device mesh from config: axes ``data``, ``fsdp``, ``tensor`` within a slice (ICI) and across slices
(DCN).

A config gives one size per axis for the inner network (``ici``) and optionally for the outer one (``dcn``,
multi-slice pods); ``-1`` in ``ici`` takes the devices that are left. All axes are ``Auto``: sharding is
decided by ``jit`` in/out shardings and ``with_sharding_constraint`` (``axes.constrain``), as our rules
expect, not by explicit-sharding types (``jax.make_mesh``'s default in jax 0.10).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils

AXES: tuple[str, ...] = ("data", "fsdp", "tensor")


def _named(sizes: Sequence[int]) -> dict[str, int]:
    return dict(zip(AXES, sizes, strict=True))


def resolve_axis_sizes(sizes: Mapping[str, int], n: int, *, what: str = "mesh.ici") -> tuple[int, ...]:
    """Sizes in ``AXES`` order with at most one ``-1`` replaced by what is left of ``n`` devices."""
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"{what}: unknown mesh axes {sorted(unknown)}; expected a subset of {AXES}")
    out = [int(sizes.get(a, 1)) for a in AXES]
    free = [i for i, s in enumerate(out) if s == -1]
    if len(free) > 1:
        raise ValueError(f"{what}: at most one axis may be -1, got {_named(out)}")
    if any(s == 0 or s < -1 for s in out):
        raise ValueError(f"{what}: axis sizes must be positive or -1, got {_named(out)}")
    fixed = math.prod(s for s in out if s != -1)
    if free:
        if n % fixed:
            raise ValueError(f"{what}: {n} devices do not divide by the fixed axes {_named(out)}")
        out[free[0]] = n // fixed
    if math.prod(out) != n:
        raise ValueError(f"{what}: axes {_named(out)} need {math.prod(out)} devices, have {n}")
    return tuple(out)


def device_grid(
    ici: Mapping[str, int],
    dcn: Mapping[str, int] | None = None,
    devices: Sequence[Any] | None = None,
    *,
    allow_split_physical_axes: bool = False,
) -> np.ndarray:
    """Devices arranged [data, fsdp, tensor]; across slices each axis is dcn x ici (slice-major)."""
    devices = list(jax.devices() if devices is None else devices)
    dcn = dict(dcn or {})
    if any(int(v) < 1 for v in dcn.values()):
        raise ValueError(f"mesh.dcn: sizes must be positive (no -1 across slices), got {dcn}")
    dcn_shape = resolve_axis_sizes(dcn, math.prod(int(v) for v in dcn.values()), what="mesh.dcn")
    n_slices = math.prod(dcn_shape)
    if len(devices) % n_slices:
        raise ValueError(f"mesh.dcn: {len(devices)} devices cannot form {n_slices} equal slices")
    ici_shape = resolve_axis_sizes(ici, len(devices) // n_slices)
    if n_slices == 1:
        return mesh_utils.create_device_mesh(
            ici_shape, devices, allow_split_physical_axes=allow_split_physical_axes
        )
    # Slices are units of the outer network; a platform without slice_index (CPU, some GPU setups) uses
    # processes as the units instead.
    process_is_granule = not hasattr(devices[0], "slice_index")
    return mesh_utils.create_hybrid_device_mesh(
        ici_shape,
        dcn_shape,
        devices,
        process_is_granule=process_is_granule,
        allow_split_physical_axes=allow_split_physical_axes,
    )


def make_mesh(
    ici: Mapping[str, int],
    dcn: Mapping[str, int] | None = None,
    devices: Sequence[Any] | None = None,
    *,
    allow_split_physical_axes: bool = False,
) -> jax.sharding.Mesh:
    """A ``Mesh`` over ``AXES`` with Auto axis types from per-axis ICI (and DCN) sizes."""
    grid = device_grid(ici, dcn, devices, allow_split_physical_axes=allow_split_physical_axes)
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def mesh_from_config(cfg: Any, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """``make_mesh`` from a config with ``ici`` and optional ``dcn``, ``allow_split_physical_axes`` fields."""
    ici = dict(cfg["ici"]) if "ici" in cfg else {}
    dcn = dict(cfg["dcn"]) if "dcn" in cfg and cfg["dcn"] is not None else None
    split = bool(cfg["allow_split_physical_axes"]) if "allow_split_physical_axes" in cfg else False
    return make_mesh(ici, dcn, devices, allow_split_physical_axes=split)


def parse_mesh_flag(text: str) -> dict[str, int]:
    """``"data=2,fsdp=-1"`` or ``"2,-1,1"`` (in ``AXES`` order) as a dict of axis sizes."""
    text = text.strip()
    if not text:
        return {}
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if all("=" in p for p in parts):
        return {k.strip(): int(v) for k, v in (p.split("=", 1) for p in parts)}
    if any("=" in p for p in parts):
        raise ValueError(f"--mesh: mix of named and positional sizes in {text!r}")
    if len(parts) > len(AXES):
        raise ValueError(f"--mesh: {text!r} has more than {len(AXES)} sizes")
    return dict(zip(AXES[: len(parts)], (int(p) for p in parts), strict=True))
