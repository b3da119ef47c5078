"""The action space's constants: env keys, VPT button groups, mu-law camera quantisation, both codebooks.

This is the one module that defines them; the agent format, the Dual-Mouse tokens and the decoding grammar
derive everything from here. Semantics follow MineStudio's ``vpt_lib`` (``actions.CameraQuantizer`` and
``action_mapping.CameraHierarchicalMapping``), which the tests use as the oracle.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np

# Binary env keys in MineRL/MineStudio's order (vpt_lib's ``Buttons.ALL``); the env action adds ``camera``.
BUTTONS: tuple[str, ...] = (
    "attack", "back", "forward", "jump", "left", "right", "sneak", "sprint", "use", "drop", "inventory",
) + tuple(f"hotbar.{i}" for i in range(1, 10))
CAMERA = "camera"
ENV_KEYS: tuple[str, ...] = BUTTONS + (CAMERA,)

# VPT's mutually exclusive button groups, in VPT's order; choice 0 of each group is "none". ``inventory`` is
# not a group: VPT makes it exclusive with every other button and with the camera.
BUTTON_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hotbar", ("none",) + tuple(f"hotbar.{i}" for i in range(1, 10))),
    ("fore_back", ("none", "forward", "back")),
    ("left_right", ("none", "left", "right")),
    ("sprint_sneak", ("none", "sprint", "sneak")),
    ("use", ("none", "use")),
    ("drop", ("none", "drop")),
    ("attack", ("none", "attack")),
    ("jump", ("none", "jump")),
)
GROUP_NAMES: tuple[str, ...] = tuple(name for name, _ in BUTTON_GROUPS)
INVENTORY = "inventory"

# The joint "buttons" index of MineStudio's agent format: the product of the groups and a camera on/off meta
# group, in itertools.product order, then one extra index for the exclusive inventory key.
_JOINT_RADICES: tuple[int, ...] = tuple(len(c) for _, c in BUTTON_GROUPS) + (2,)
N_JOINT_BUTTONS: int = int(np.prod(_JOINT_RADICES)) + 1  # 8641: indices 0..8640
INVENTORY_JOINT_INDEX: int = N_JOINT_BUTTONS - 1


class Regime(enum.IntEnum):
    """Interaction type: non-GUI play (mouse turns the camera) or a GUI open (mouse moves the cursor)."""

    NG = 0
    GUI = 1


def regime_of(source: Any) -> Regime:
    """Normalise MineStudio's/our backends' ``is_gui_open``, VPT's ``isGuiOpen``, a bool, 0/1 or a name."""
    if isinstance(source, Mapping):
        for key in ("is_gui_open", "isGuiOpen"):
            if key in source:
                return regime_of(source[key])
        raise ValueError(f"regime: mapping has neither 'is_gui_open' nor 'isGuiOpen' (keys {sorted(source)})")
    if isinstance(source, str):
        try:
            return Regime[source.upper()]
        except KeyError:
            raise ValueError(f"regime: unknown name {source!r}; expected 'NG' or 'GUI'") from None
    arr = np.asarray(source)
    if arr.shape != () or arr.dtype.kind not in "biu" or int(arr) not in (0, 1):
        raise ValueError(f"regime: expected a bool or 0/1, got {source!r}")
    return Regime(int(arr))


@dataclasses.dataclass(frozen=True)
class Codebook:
    """A camera codebook: mu-law (or linear) quantisation of each camera axis into ``n_bins`` bins."""

    name: str
    mu: float
    maxval: int  # degrees; larger displacements are clipped
    binsize: int  # average bin width in the (mu-law encoded) degree domain
    scheme: str = "mu_law"  # or "linear"

    def __post_init__(self):
        if self.scheme not in ("mu_law", "linear"):
            raise ValueError(f"codebook {self.name!r}: unknown scheme {self.scheme!r} (mu_law, linear)")
        if (2 * self.maxval) % self.binsize:
            raise ValueError(f"codebook {self.name!r}: 2*maxval must be a multiple of binsize")

    @property
    def n_bins(self) -> int:
        """Bins per camera axis (odd; the middle one is zero motion)."""
        return 2 * self.maxval // self.binsize + 1

    @property
    def null_bin(self) -> int:
        return self.n_bins // 2

    @property
    def n_joint_camera(self) -> int:
        """Size of MineStudio's joint camera index (pitch bin * n_bins + yaw bin)."""
        return self.n_bins * self.n_bins

    def discretize(self, xy: np.ndarray) -> np.ndarray:
        """Degrees -> bin indices (int64), elementwise; the same float ops as vpt_lib's CameraQuantizer."""
        xy = np.clip(np.asarray(xy, dtype=np.float64), -self.maxval, self.maxval)
        if self.scheme == "mu_law":
            xy = xy / self.maxval
            xy = np.sign(xy) * (np.log(1.0 + self.mu * np.abs(xy)) / np.log(1.0 + self.mu))
            xy = xy * self.maxval
        return np.round((xy + self.maxval) / self.binsize).astype(np.int64)

    def undiscretize(self, bins: np.ndarray) -> np.ndarray:
        """Bin indices -> degrees (float64), the bin centres vpt_lib decodes to."""
        xy = np.asarray(bins) * self.binsize - self.maxval
        if self.scheme == "mu_law":
            xy = xy / self.maxval
            xy = np.sign(xy) * (1.0 / self.mu) * ((1.0 + self.mu) ** np.abs(xy) - 1.0)
            xy = xy * self.maxval
        return np.asarray(xy, dtype=np.float64)


# VPT (and MineStudio's default CameraConfig): 11 bins per axis. OpenHA / JARVIS-VLA: 21 bins per axis.
CODEBOOKS: dict[str, Codebook] = {
    "vpt": Codebook(name="vpt", mu=10.0, maxval=10, binsize=2),
    "openha": Codebook(name="openha", mu=20.0, maxval=10, binsize=1),
}


def get_codebook(codebook: str | Codebook) -> Codebook:
    """A codebook by name (``vpt`` or ``openha``), or the codebook itself."""
    if isinstance(codebook, Codebook):
        return codebook
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; known: {sorted(CODEBOOKS)}")
    return CODEBOOKS[codebook]


def joint_buttons_table() -> np.ndarray:
    """[N_JOINT_BUTTONS, n_groups + 2] int: each joint index's group choices, camera meta, inventory."""
    rows = [list(c) + [0] for c in itertools.product(*(range(r) for r in _JOINT_RADICES))]
    rows.append([0] * len(GROUP_NAMES) + [0, 1])
    return np.asarray(rows, dtype=np.int64)


def joint_buttons_index(choices: np.ndarray, camera_on: np.ndarray) -> np.ndarray:
    """Group choices [..., n_groups] and camera meta [...] -> joint buttons index [...] (no inventory)."""
    idx = np.zeros(np.shape(camera_on), dtype=np.int64)
    digits = [choices[..., g] for g in range(len(GROUP_NAMES))] + [np.asarray(camera_on, dtype=np.int64)]
    for digit, radix in zip(digits, _JOINT_RADICES, strict=True):
        idx = idx * radix + digit
    return idx
