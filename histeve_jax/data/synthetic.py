"""A small generator of learnable data in the real record format, for the tiny default runs and for tests.

Demonstrations: a coloured target block on a sky/grass scene. In non-GUI (NG) episodes the expert turns the
camera toward the target (yaw and pitch proportional to its offset from the centre, clipped to the codebook
range) and walks forward once it is centred, attacking when close; the instruction names the colour, and two
targets of different colours are drawn, so the policy must read the instruction. In GUI episodes an
inventory panel is open and the expert moves the cursor toward the slot of the named colour and clicks
(``use``). The action is a function of the frame and the instruction, so a policy can fit it and the loss
falls within a few hundred steps.

World knowledge: the same scenes with questions about them ("What colour is the block on the left?").
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from histeve_jax.data import records as R

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "blue": (40, 60, 220), "yellow": (230, 210, 40), "white": (240, 240, 240),
}
SKY, GRASS, PANEL = (120, 170, 240), (70, 150, 60), (140, 140, 140)
CAMERA_GAIN = 0.08  # degrees of camera turn per pixel of target offset (before clipping to +-10)


def _noop() -> dict[str, Any]:
    a: dict[str, Any] = {k: 0 for k in R.BINARY_KEYS}
    a["camera"] = [0.0, 0.0]
    return a


def _scene(h: int, w: int, targets: list[tuple[str, float, float]], size: int) -> np.ndarray:
    img = np.empty((h, w, 3), np.uint8)
    img[: h // 2] = SKY
    img[h // 2:] = GRASS
    for colour, x, y in targets:
        x0, y0 = int(round(x)) - size // 2, int(round(y)) - size // 2
        img[max(y0, 0): max(y0 + size, 0), max(x0, 0): max(x0 + size, 0)] = COLOURS[colour]
    return img


def _gui(h: int, w: int, slots: list[str], cursor: tuple[float, float]) -> np.ndarray:
    img = np.full((h, w, 3), 30, np.uint8)
    img[h // 6: 5 * h // 6, w // 8: 7 * w // 8] = PANEL
    for i, colour in enumerate(slots):
        cx, cy = _slot_centre(h, w, i, len(slots))
        img[int(cy) - 4: int(cy) + 4, int(cx) - 4: int(cx) + 4] = COLOURS[colour]
    x, y = int(cursor[0]), int(cursor[1])
    img[max(y, 0): max(y + 5, 0), max(x, 0): max(x + 2, 0)] = 255  # the cursor, as VPT draws it: top-left
    img[max(y, 0): max(y + 2, 0), max(x, 0): max(x + 4, 0)] = 255
    return img


def _slot_centre(h: int, w: int, i: int, n: int) -> tuple[float, float]:
    return w // 8 + (i + 0.5) * (3 * w / 4) / n, h / 2


def ng_episode(rng: np.random.Generator, episode_id: str, length: int, h: int, w: int,
               frame_format: str = "jpeg") -> list[R.StepRecord]:
    """One NG episode: turn toward and walk up to the block of the instructed colour."""
    names = list(COLOURS)
    goal, other = rng.choice(names, 2, replace=False)
    # target positions in "world" pixels relative to the view centre; the camera moves the view
    pos = {goal: np.array([rng.uniform(-w / 2, w / 2), rng.uniform(-h / 4, h / 4)]),
           other: np.array([rng.uniform(-w / 2, w / 2), rng.uniform(-h / 4, h / 4)])}
    dist = float(rng.uniform(4, 8))
    out = []
    for t in range(length):
        size = int(np.clip(24 / dist, 3, h // 3))
        targets = [(c, w / 2 + p[0], h / 2 + p[1]) for c, p in pos.items()]
        frame = _scene(h, w, targets, size)
        action = _noop()
        off = pos[goal]
        dyaw = float(np.clip(CAMERA_GAIN * off[0], -10, 10))
        dpitch = float(np.clip(CAMERA_GAIN * off[1], -10, 10))
        action["camera"] = [dpitch, dyaw]
        if abs(off[0]) < w / 10:
            action["forward"] = 1
            if dist < 2:
                action["attack"] = 1
        out.append(R.StepRecord(
            episode_id=episode_id, step=t, task_id=f"approach_{goal}", kind="demo",
            instruction=f"walk to the {goal} block", frame=R.encode_frame(frame, frame_format),
            frame_format=frame_format, action=action, is_gui_open=False, done=t == length - 1,
            metadata={"generator": "synthetic", "goal": str(goal)}))
        # the world moves opposite to the camera turn (one degree ~ 1/CAMERA_GAIN px would be exact; damp it)
        for p in pos.values():
            p -= 0.6 * np.array([dyaw, dpitch]) / CAMERA_GAIN
        if action["forward"]:
            dist = max(dist - 0.5, 1.0)
    return out


def gui_episode(rng: np.random.Generator, episode_id: str, length: int, h: int, w: int,
                frame_format: str = "jpeg") -> list[R.StepRecord]:
    """One GUI episode: move the cursor onto the slot of the instructed colour and click it."""
    slots = list(rng.permutation(list(COLOURS)))
    goal_i = int(rng.integers(len(slots)))
    goal = slots[goal_i]
    cursor = np.array([rng.uniform(0, w - 1), rng.uniform(0, h - 1)])
    gx, gy = _slot_centre(h, w, goal_i, len(slots))
    out = []
    for t in range(length):
        frame = _gui(h, w, slots, (cursor[0], cursor[1]))
        action = _noop()
        off = np.array([gx, gy]) - cursor
        # cursor motion uses the same camera codebook (degrees), as Dual-Mouse decodes both to one codebook
        action["camera"] = [float(np.clip(CAMERA_GAIN * 4 * off[1], -10, 10)),
                            float(np.clip(CAMERA_GAIN * 4 * off[0], -10, 10))]
        if np.abs(off).max() < 4:
            action["use"] = 1
        out.append(R.StepRecord(
            episode_id=episode_id, step=t, task_id=f"click_{goal}", kind="demo",
            instruction=f"click the {goal} item", frame=R.encode_frame(frame, frame_format),
            frame_format=frame_format, action=action, is_gui_open=True,
            cursor=[float(cursor[0]), float(cursor[1])], done=t == length - 1,
            metadata={"generator": "synthetic", "goal": str(goal)}))
        cursor = np.clip(cursor + 0.5 * np.array(action["camera"][::-1]) / (CAMERA_GAIN * 4) * 1.0, 0,
                         [w - 1, h - 1])
    return out


def wk_sample(rng: np.random.Generator, episode_id: str, h: int, w: int,
              frame_format: str = "jpeg") -> R.StepRecord:
    """One world-knowledge question about a scene (which colour is on which side, how many blocks)."""
    names = list(COLOURS)
    left, right = rng.choice(names, 2, replace=False)
    frame = _scene(h, w, [(left, w * 0.25, h * 0.5), (right, w * 0.75, h * 0.5)], h // 4)
    kind = int(rng.integers(3))
    if kind == 0:
        q, a = "What colour is the block on the left?", f"The block on the left is {left}."
    elif kind == 1:
        q, a = "What colour is the block on the right?", f"The block on the right is {right}."
    else:
        q, a = "Which blocks do you see?", f"A {left} block on the left and a {right} block on the right."
    action = _noop()
    return R.StepRecord(
        episode_id=episode_id, step=0, task_id="synthetic_vqa", kind="world_knowledge", instruction=q,
        frame=R.encode_frame(frame, frame_format), frame_format=frame_format, action=action,
        is_gui_open=False, done=True, response=a, metadata={"generator": "synthetic"})


def write_demo_dataset(directory: str | os.PathLike, *, episodes: int, length: int = 16, height: int = 56,
                       width: int = 56, gui_fraction: float = 0.3, seed: int = 0, frame_format: str = "jpeg",
                       records_per_shard: int = 512) -> list[str]:
    """Write ``episodes`` demonstration episodes (NG and GUI mixed); returns the shard paths."""
    rng = np.random.default_rng(seed)

    def gen():
        for i in range(episodes):
            fn = gui_episode if rng.random() < gui_fraction else ng_episode
            yield fn(rng, f"syn{seed}-{i:05d}", length, height, width, frame_format)

    return R.write_episodes(directory, gen(), prefix="synthetic", records_per_shard=records_per_shard)


def write_world_knowledge_dataset(directory: str | os.PathLike, *, samples: int, height: int = 56,
                                  width: int = 56, seed: int = 0, frame_format: str = "jpeg",
                                  records_per_shard: int = 1024) -> list[str]:
    """Write ``samples`` world-knowledge records; returns the shard paths."""
    rng = np.random.default_rng(seed)
    return R.write_episodes(
        directory,
        ([wk_sample(rng, f"wk{seed}-{i:05d}", height, width, frame_format)] for i in range(samples)),
        prefix="synthetic_wk", records_per_shard=records_per_shard)


def ensure_dataset(directory: str | os.PathLike, kind: str, **kwargs: Any) -> list[str]:
    """The shards in ``directory``, generating them first if the directory holds none (``kind``: demo|wk)."""
    d = os.fspath(directory)
    if os.path.isdir(d) and R.shard_paths(d):
        return R.shard_paths(d)
    if kind == "demo":
        return write_demo_dataset(d, **kwargs)
    if kind == "wk":
        return write_world_knowledge_dataset(d, **kwargs)
    raise ValueError(f"ensure_dataset: kind must be 'demo' or 'wk', got {kind!r}")
