"""Env format <-> discrete action <-> MineStudio's agent format (joint ``buttons`` and ``camera`` indices).

The env format is MineRL/MineStudio's dict of binary keys plus ``camera = [dpitch, dyaw]`` in degrees; a
leading batch shape is allowed (``camera`` of shape [..., 2], each key of shape [...]). The agent format is
``{"buttons": int in 0..8640, "camera": int in 0..n_bins**2-1}``, as ``MinecraftSim(action_type="agent")``
takes it. Both directions reproduce vpt_lib's ``ActionTransformer`` + ``CameraHierarchicalMapping`` exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from histeve_jax.actions.codebook import (
    BUTTON_GROUPS,
    BUTTONS,
    CAMERA,
    ENV_KEYS,
    GROUP_NAMES,
    INVENTORY,
    INVENTORY_JOINT_INDEX,
    N_JOINT_BUTTONS,
    Codebook,
    get_codebook,
    joint_buttons_index,
    joint_buttons_table,
)

_JOINT_TABLE = joint_buttons_table()  # [8641, n_groups + 2]


@dataclasses.dataclass(frozen=True)
class DiscreteAction:
    """A quantised action: one choice per button group, the inventory key, and the two camera bins.

    choices: int64 [..., n_groups] (index into each group's choices, 0 = none); inventory: bool [...];
    camera: int64 [..., 2] bins (pitch, yaw), ``codebook.null_bin`` = no motion.
    """

    choices: np.ndarray
    inventory: np.ndarray
    camera: np.ndarray

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.inventory.shape)

    def canonical(self, codebook: str | Codebook) -> DiscreteAction:
        """VPT's canonical form: the inventory key excludes every other button and the camera."""
        cb = get_codebook(codebook)
        inv = self.inventory.astype(bool)
        return DiscreteAction(
            choices=np.where(inv[..., None], 0, self.choices),
            inventory=inv,
            camera=np.where(inv[..., None], cb.null_bin, self.camera),
        )


def _batch_camera(action: Mapping[str, Any]) -> np.ndarray:
    if CAMERA not in action:
        raise ValueError("env action: missing key 'camera'")
    cam = np.asarray(action[CAMERA])
    if cam.ndim < 1 or cam.shape[-1] != 2:
        raise ValueError(f"env action: 'camera' must have shape [..., 2], got {cam.shape}")
    if cam.dtype.kind not in "biuf":
        raise ValueError(f"env action: 'camera' must be numeric, got dtype {cam.dtype}")
    if not np.all(np.isfinite(cam)):
        raise ValueError(f"env action: 'camera' is not finite: {cam}")
    return cam


def _buttons_matrix(action: Mapping[str, Any], batch_shape: tuple[int, ...]) -> np.ndarray:
    """[..., len(BUTTONS)] int64 of 0/1; missing keys are 0 (as vpt_lib's env2policy does)."""
    unknown = sorted(set(action) - set(ENV_KEYS))
    if unknown:
        raise ValueError(f"env action: unknown key {unknown[0]!r} (known: {', '.join(ENV_KEYS)})")
    cols = []
    for key in BUTTONS:
        v = np.asarray(action.get(key, 0))
        if v.dtype.kind not in "biuf":
            raise ValueError(f"env action: key {key!r} must be 0/1, got dtype {v.dtype}")
        if v.shape not in ((), batch_shape):
            raise ValueError(f"env action: key {key!r} has shape {v.shape}, camera implies {batch_shape}")
        v = np.broadcast_to(v, batch_shape)
        if not np.all((v == 0) | (v == 1)):
            raise ValueError(f"env action: key {key!r} must be 0 or 1, got {v}")
        cols.append(v.astype(np.int64))
    return np.stack(cols, axis=-1) if cols else np.zeros(batch_shape + (0,), np.int64)


def _group_choices(buttons: np.ndarray) -> np.ndarray:
    """[..., len(BUTTONS)] -> [..., n_groups] choices, with vpt_lib's tie rules."""
    out = []
    for _, group in BUTTON_GROUPS:
        cols = buttons[..., [BUTTONS.index(b) for b in group[1:]]].copy()
        if group[1:] in (("forward", "back"), ("left", "right")):
            # vpt_lib: pressing both opposite keys means neither.
            both = np.all(cols == 1, axis=-1)
            cols[both] = 0
        # vpt_lib: when several in a group are pressed, the later one in the group wins.
        rank = np.where(cols == 1, np.arange(1, cols.shape[-1] + 1), 0)
        out.append(rank.max(axis=-1, initial=0))
    return np.stack(out, axis=-1).astype(np.int64)


def env_to_discrete(action: Mapping[str, Any], codebook: str | Codebook = "vpt") -> DiscreteAction:
    """Quantise an env-format action (batched or not) into its canonical discrete form."""
    cb = get_codebook(codebook)
    cam = _batch_camera(action)
    if cam.dtype.kind != "f":
        cam = cam.astype(np.float64)
    batch_shape = tuple(cam.shape[:-1])
    buttons = _buttons_matrix(action, batch_shape)
    return DiscreteAction(
        choices=_group_choices(buttons),
        inventory=buttons[..., BUTTONS.index(INVENTORY)] == 1,
        camera=cb.discretize(cam),
    ).canonical(cb)


def is_null_action(action: Mapping[str, Any], codebook: str | Codebook = "vpt") -> bool:
    """True if an env-format action does nothing once quantised: no button and the camera in its null bin.

    VPT's behavioural cloning drops such steps from its training data (openai/Video-Pre-Training,
    data_loader.py: "Skip null actions as done in the VPT paper"); ``FeatureSpec.skip_null_actions``.
    """
    cb = get_codebook(codebook)
    d = env_to_discrete(action, cb)
    if d.batch_shape != ():
        raise ValueError(f"is_null_action: one action at a time, got batch shape {d.batch_shape}")
    return not (bool(d.inventory) or bool(np.any(d.choices)) or bool(np.any(d.camera != cb.null_bin)))


def discrete_to_env(action: DiscreteAction, codebook: str | Codebook = "vpt") -> dict[str, Any]:
    """Discrete action -> env dict; unbatched input gives int keys and a [2] float camera."""
    cb = get_codebook(codebook)
    out: dict[str, Any] = {key: np.zeros(action.batch_shape, np.int64) for key in BUTTONS}
    for g, (_, group) in enumerate(BUTTON_GROUPS):
        for c, name in enumerate(group[1:], start=1):
            out[name] = out[name] | (action.choices[..., g] == c).astype(np.int64)
    out[INVENTORY] = action.inventory.astype(np.int64)
    out[CAMERA] = cb.undiscretize(action.camera)
    if action.batch_shape == ():
        out = {k: (v if k == CAMERA else int(v)) for k, v in out.items()}
    return out


def discrete_to_agent(action: DiscreteAction, codebook: str | Codebook = "vpt") -> dict[str, Any]:
    """Discrete action -> MineStudio's agent format (ints when unbatched, int64 arrays otherwise)."""
    cb = get_codebook(codebook)
    camera_on = np.any(action.camera != cb.null_bin, axis=-1)
    buttons = joint_buttons_index(action.choices, camera_on)
    buttons = np.where(action.inventory, INVENTORY_JOINT_INDEX, buttons)
    camera = action.camera[..., 0] * cb.n_bins + action.camera[..., 1]
    if action.batch_shape == ():
        return {"buttons": int(buttons), "camera": int(camera)}
    return {"buttons": buttons.astype(np.int64), "camera": camera.astype(np.int64)}


def agent_to_discrete(action: Mapping[str, Any], codebook: str | Codebook = "vpt") -> DiscreteAction:
    """MineStudio agent format -> discrete action, as vpt_lib's ``to_factored`` reads it (not canonical)."""
    cb = get_codebook(codebook)
    unknown = sorted(set(action) - {"buttons", "camera"})
    if unknown:
        raise ValueError(f"agent action: unknown key {unknown[0]!r} (known: buttons, camera)")
    for key in ("buttons", "camera"):
        if key not in action:
            raise ValueError(f"agent action: missing key {key!r}")
    buttons, camera = np.asarray(action["buttons"]), np.asarray(action["camera"])
    for key, v, n in (("buttons", buttons, N_JOINT_BUTTONS), ("camera", camera, cb.n_joint_camera)):
        if v.dtype.kind not in "iu":
            raise ValueError(f"agent action: {key!r} must be integer, got dtype {v.dtype}")
        if np.any((v < 0) | (v >= n)):
            raise ValueError(f"agent action: {key!r} must lie in 0..{n - 1} (codebook {cb.name!r}), got {v}")
    if buttons.shape != camera.shape:
        raise ValueError(f"agent action: 'buttons' shape {buttons.shape} != 'camera' shape {camera.shape}")
    row = _JOINT_TABLE[buttons]
    n_groups = len(GROUP_NAMES)
    camera_on, inventory = row[..., n_groups], row[..., n_groups + 1] == 1
    bins = np.stack([camera // cb.n_bins, camera % cb.n_bins], axis=-1).astype(np.int64)
    # vpt_lib: the camera meta-off button combinations null the camera; the inventory index does not.
    off = (camera_on == 0) & ~inventory
    bins = np.where(off[..., None], cb.null_bin, bins)
    return DiscreteAction(choices=row[..., :n_groups], inventory=inventory, camera=bins)


def env_to_agent(action: Mapping[str, Any], codebook: str | Codebook = "vpt") -> dict[str, Any]:
    """Env action -> MineStudio agent format, equal to MinecraftSim's ``env_action_to_agent_action``."""
    return discrete_to_agent(env_to_discrete(action, codebook), codebook)


def agent_to_env(action: Mapping[str, Any], codebook: str | Codebook = "vpt") -> dict[str, Any]:
    """MineStudio agent format -> env action, equal to MinecraftSim's ``agent_action_to_env_action``."""
    return discrete_to_env(agent_to_discrete(action, codebook), codebook)
