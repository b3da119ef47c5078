"""Can the policy memorise one demonstration? Full-batch (or minibatch) training on one episode's samples.

The check behind README "The GUI": the recorded craft_planks demonstrations are all the same 23 non-null
steps, so a policy that reads its frames can learn them exactly. This trains a fresh tiny policy on the first
``--episodes`` episodes of a records directory (the main job's features: 112x196, null actions left out,
one history frame, here ``--stride`` steps back: 4 by default, as when the figures below were measured; the
main job now takes 1) with the stage configs' optimizer (``train.optimizer.make_optimizer``:
AdamW, clipping, ``vision_lr_factor``; constant learning rate) and prints the loss and the fraction of
samples whose whole action is the argmax, every 50 steps.

    python -m experiments.benchmarks.memorise --records=<dir> [--vision_lr_factor=0.1] [--batch=0 (full)]

``--draw_lines=W`` draws the env's guide lines (``envs.cursor``, ``W`` px wide, no gap, and the 16 px arrow
over them) into every frame at the record's cursor, for records made without them. Measured on 2026-12-04
on craft_planks records made before the env drew them, ``--batch=8``, figures of the step's minibatch:
without, CE 0.47-0.68 from step 200 to 800 (3 of 8 exact at 800); with ``--draw_lines=2``, 0.12 at step 400
and 0.0006-0.04 from step 600 on.
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from histeve_jax.actions import is_null_action
from histeve_jax.data import pipeline as P
from histeve_jax.data import records as R
from histeve_jax.envs.cursor import draw_cursor
from histeve_jax.models import qwen2_5_vl
from histeve_jax.policy import Policy, PolicyConfig
from histeve_jax.train import optimizer as optimizer_lib


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", required=True)
    p.add_argument("--episodes", type=int, default=1)
    p.add_argument("--base", default="tiny", choices=("tiny", "small"))
    p.add_argument("--history", type=int, default=1)
    p.add_argument("--stride", type=int, default=4, help="steps between the frames of a window")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=0, help="0: all samples every step (full batch)")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--vision_lr_factor", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draw_lines", type=int, default=0, help="guide lines this wide at the recorded cursor")
    a = p.parse_args(argv)

    base = {"tiny": qwen2_5_vl.tiny, "small": qwen2_5_vl.small}[a.base]()
    cfg = PolicyConfig(base=base, action_token_base=base.text.vocab_size, history_frames=a.history,
                       image_size=(112, 196), max_targets=16)
    spec = P.FeatureSpec(history=a.history, stride=a.stride, image_size=(112, 196), max_len=112,
                         skip_null_actions=True,
                         compact_vocab=P.CompactVocab(action_base=cfg.action_token_base))
    shards = P.open_shards(a.records)
    src = P.WindowSource(shards, history=spec.history, stride=spec.stride)
    steps = P.WindowSource(shards)  # one record per index: each frame's own cursor, for --draw_lines
    featurize = P.Featurize(spec)
    episodes, rows = [], []
    for i in range(len(src)):
        w = src[i]
        rec = w["record"]
        if rec["episode_id"] not in episodes:
            if len(episodes) == a.episodes:
                break
            episodes.append(rec["episode_id"])
        if rec.get("kind") == "world_knowledge" or is_null_action(rec["action"]):
            continue
        if a.draw_lines:
            w = dict(w, frames=_with_lines(steps, i, w["frames"], a.draw_lines, spec.stride))
        x = featurize.map(w)
        if P.BAD in x:
            raise ValueError(f"{a.records}: {rec['episode_id']} step {rec['step']}: {x[P.BAD]}")
        rows.append({k: v for k, v in x.items() if isinstance(v, np.ndarray)})
    data = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    n = len(rows)
    print(f"{n} samples from {len(episodes)} episode(s); batch {a.batch or n}")

    policy = Policy(cfg, rngs=nnx.Rngs(a.seed))
    tx, _ = optimizer_lib.make_optimizer({"learning_rate": a.learning_rate, "warmup_steps": 0,
                                          "total_steps": a.steps + 1, "end_lr_factor": 1.0,
                                          "weight_decay": 0.0, "vision_lr_factor": a.vision_lr_factor})
    opt = nnx.Optimizer(policy, tx, wrt=nnx.Param)

    @nnx.jit
    def step(policy, opt, batch):
        (loss, metrics), grads = nnx.value_and_grad(lambda m: m.loss(batch), has_aux=True)(policy)
        opt.update(policy, grads)
        return loss, metrics

    rng = np.random.default_rng(a.seed)
    start = time.time()
    for s in range(1, a.steps + 1):
        idx = rng.choice(n, a.batch, replace=False) if a.batch else np.arange(n)
        loss, metrics = step(policy, opt, {k: jnp.asarray(v[idx]) for k, v in data.items()})
        if s == 1 or s % 50 == 0 or s == a.steps:
            print(f"step {s} action_ce {float(loss):.4f} action_exact {float(metrics['action_exact']):.3f} "
                  f"({time.time() - start:.0f} s)", flush=True)


def _with_lines(steps: P.WindowSource, i: int, frames: list[bytes], width: int, stride: int) -> list[bytes]:
    """Window ``i``'s frames (oldest first, as ``WindowSource`` clamps them to the episode's first) with
    guide lines at each frame's own record's cursor."""
    step = steps[i]["record"]["step"]
    out = []
    for k, frame in enumerate(frames):
        cursor = steps[i - min((len(frames) - 1 - k) * stride, step)]["record"]["cursor"]
        if cursor is None:
            out.append(frame)
            continue
        img = R.decode_frame(frame)
        s = img.shape[1] / 640  # the cursor is in 640x360 render pixels
        out.append(R.encode_frame(draw_cursor(img, (cursor[0] * s, cursor[1] * s), lines=width), fmt="png"))
    return out


if __name__ == "__main__":
    main()
