"""Which frames a policy looks at: a diagnostic for a policy that fails although its data looks right.

For windows of demonstration records (the training pipeline's own samples), it measures
- ``black[k]``: how far the policy's distributions over the reply's tokens move (max |dp| over the
  vocabulary and the reply's positions, teacher-forced on the record's action; averaged over windows) when
  frame slot ``k`` (0 the oldest, the last the current one) is replaced by a black frame: 0 means that slot
  reaches the action not at all;
- ``swap[k]``: the same when slot ``k`` is replaced by the same slot of the next window: whether the policy
  tells the windows' frames apart, not just "a frame is there";
- ``feature_spread``: the vision tower's output for the current frame, across the windows, relative to its
  size (mean over tokens of the across-window standard deviation's norm / mean token norm): near 0 means the
  tower gives every frame the same features (collapse), whatever the decoder does with them.

Measured with it (README "The GUI"), craft_planks, 24 inventory windows: the trained policy's ``black`` was
7e-6 for the current frame and 0.08 for the history frame (which tells "the inventory just opened"), its
``feature_spread`` 0.0016 (0.066 for the same config at initialisation).

    python -m experiments.probe --run=<imitation workdir> --records=<records dir> [--task=craft_planks]
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from histeve_jax.data import pipeline as P
from histeve_jax.policy.loss import flat_pixels


@dataclasses.dataclass(frozen=True)
class FrameProbe:
    black: tuple[float, ...]  # per frame slot, oldest first
    swap: tuple[float, ...]
    feature_spread: float
    windows: int

    def summary(self) -> str:
        black = " ".join(f"black_{k}={v:.3g}" for k, v in enumerate(self.black))
        swap = " ".join(f"swap_{k}={v:.3g}" for k, v in enumerate(self.swap))
        return f"windows={self.windows} {black} {swap} feature_spread={self.feature_spread:.3g}"


def _black_jpeg(like: Any) -> bytes:
    from PIL import Image

    from histeve_jax.data import records as R

    h, w = R.decode_frame(like).shape[:2]
    out = io.BytesIO()
    Image.new("RGB", (w, h)).save(out, "JPEG")
    return out.getvalue()


def _arrays(x: Mapping[str, Any]) -> dict[str, np.ndarray]:
    if P.BAD in x:
        raise ValueError(f"frame_probe: a window could not be featurized: {x[P.BAD]}")
    return {k: v[None] for k, v in x.items() if isinstance(v, np.ndarray)}


def reply_distributions(policy: Any, batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """Softmax of the logits at every target position of a one-sample batch's reply [K, V] (teacher-forced
    on the record's action tokens)."""
    cfg = policy.config
    pv, grid = flat_pixels(cfg, batch)
    logits = policy.model(jnp.asarray(batch["input_ids"]),
                          attention_mask=jnp.asarray(batch["attention_mask"]), pixel_values=pv,
                          image_grid_thw=grid, regime=jnp.asarray(batch["regime"]).reshape(-1))
    # loss_mask[t] marks targets[t] = ids[t + 1]: row t predicts the reply's next token.
    rows = np.asarray(logits[0, np.flatnonzero(batch["loss_mask"][0])], np.float64)
    p = np.exp(rows - rows.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def probe(policy: Any, spec: P.FeatureSpec, windows: Sequence[Mapping[str, Any]]) -> FrameProbe:
    """The measures above over ``windows`` (``pipeline.WindowSource`` items, at least two)."""
    if len(windows) < 2:
        raise ValueError(f"frame_probe: need at least 2 windows, got {len(windows)}")
    featurize = P.Featurize(spec)
    n = spec.num_images
    black_frame = _black_jpeg(windows[0]["frames"][-1])

    def dist(window: Mapping[str, Any]) -> np.ndarray:
        return reply_distributions(policy, _arrays(featurize.map(dict(window))))

    def with_frame(window: Mapping[str, Any], k: int, frame: Any) -> dict[str, Any]:
        frames = list(window["frames"][-n:])
        frames[k] = frame
        return {**window, "frames": frames}

    black = np.zeros(n)
    swap = np.zeros(n)
    feats = []
    for i, w in enumerate(windows):
        base = dist(w)
        other = windows[(i + 1) % len(windows)]
        for k in range(n):
            black[k] += np.abs(dist(with_frame(w, k, black_frame)) - base).max()
            swap[k] += np.abs(dist(with_frame(w, k, other["frames"][-n:][k])) - base).max()
        b = _arrays(featurize.map(dict(w)))
        pv, grid = flat_pixels(policy.config, b)
        f = np.asarray(policy.model.get_image_features(pv, grid))
        feats.append(f[-f.shape[0] // n:])  # the current frame's tokens
    F = np.stack(feats)  # [windows, tokens, E]
    spread = float(np.linalg.norm(F.std(0), axis=-1).mean() / max(np.linalg.norm(F, axis=-1).mean(), 1e-12))
    m = len(windows)
    return FrameProbe(tuple(float(v) for v in black / m), tuple(float(v) for v in swap / m), spread, m)


def demo_windows(records: str | Sequence[str], spec: P.FeatureSpec, *, task: str | None = None,
                 gui_only: bool = False, limit: int = 24) -> list[dict[str, Any]]:
    """Up to ``limit`` windows of demonstration steps (of ``task``; in the GUI only), in record order,
    null actions left out when ``spec.skip_null_actions`` and perturbed steps always (as training leaves them
    out)."""
    from histeve_jax.actions import is_null_action
    from histeve_jax.envs.experts.core import is_perturbed

    src = P.WindowSource(P.open_shards(records), history=spec.history, stride=spec.stride,
                         in_regime=spec.history_in_regime)
    out = []
    for i in range(len(src)):
        w = src[i]
        rec = w["record"]
        if rec.get("kind") == "world_knowledge" or (task and rec.get("task_id") != task):
            continue
        if gui_only and not rec.get("is_gui_open"):
            continue
        if spec.skip_null_actions and is_null_action(rec["action"]):
            continue
        if is_perturbed(str(rec.get("subtask") or "")):
            continue
        out.append(w)
        if len(out) == limit:
            break
    if not out:
        raise ValueError(f"frame_probe: no demonstration windows in {records} "
                         f"(task={task}, gui_only={gui_only})")
    return out
