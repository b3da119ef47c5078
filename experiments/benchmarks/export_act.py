"""Per-step latency of the exported PyTorch ``act`` vs ours on the tiny policy, observation to env action.

The tiny random HiSTEVE policy (the tests' shape: 1 history frame + the current one, 56x56, vocab 320
plus the action rows, with random action rows in lm_head so greedy actions vary) is exported with
``histeve_jax.export.export_policy`` to a temporary directory. Ours: ``ActionSampler.sample`` (prompt
building, jitted prefill + KV-cached ``while_loop`` decode under the grammar, decode). Theirs: the exported
``histeve_action.HiSteveActor.act`` (the same prompt through the directory's tokenizer and image processor,
``generate`` with the grammar as a ``LogitsProcessor``, the numpy decode). One observation per step,
greedy; the script checks both give the same action, then reports median milliseconds (torch on one
thread, see ``main``).

    python -m experiments.benchmarks.export_act
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from experiments.benchmarks.timing import median_ms

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 20


def main() -> None:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from histeve_jax.data.pipeline import CompactVocab, FeatureSpec, load_tokenizer_with_actions
    from histeve_jax.export import export_policy
    from histeve_jax.policy import ActionSampler, Policy, policy_processor, tiny_config

    # One intra-op thread: the tiny model's ops are too small to split, and on a shared 2-core machine two
    # OpenMP workers contend with any other load (a forward took 556 ms with 2 threads vs 29 ms with 1).
    torch.set_num_threads(1)
    config = tiny_config(history_frames=1)
    policy = Policy(config, rngs=nnx.Rngs(0))
    w = np.asarray(policy.model.lm_head[...]).copy()
    w[:, config.vocab.ids] = np.random.default_rng(0).standard_normal((w.shape[0], len(config.vocab.ids)))
    policy.model.lm_head.set_value(jnp.asarray(w))
    tok, _ = load_tokenizer_with_actions(FeatureSpec())
    id_map = CompactVocab().table(len(config.vocab.ids))

    rng = np.random.default_rng(0)
    obs = [([rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(2)], "chop the tree")]
    regimes = [0]
    sampler = ActionSampler(policy)
    processor = policy_processor(config, tok)
    key = jax.random.key(0)
    ours = lambda: sampler.sample(processor, obs, regimes, key, id_map=id_map, greedy=True)[0].action

    with tempfile.TemporaryDirectory() as d:
        out = export_policy(policy, tok, os.path.join(d, "policy"), frame_format="png", id_map=id_map,
                            stride=4)
        sys.path.insert(0, out)  # as a deployment imports it (README, Deployment)
        from histeve_action import HiSteveActor

        actor = HiSteveActor(out)
    theirs = lambda: actor.act(obs, regimes)[0]

    a, b = ours(), theirs()
    if set(a) != set(b) or any(not np.array_equal(a[k], b[k]) for k in a):
        raise SystemExit(f"actions differ: ours {a} torch {b}")
    jax_ms = median_ms(ours, STEPS)
    torch_ms = median_ms(theirs, STEPS)
    shown = {k: v for k, v in a.items() if k == "camera" or v}
    print(f"frames=2x56x56 regime=NG steps={STEPS} action={shown}")
    print(f"torch_act_ms={torch_ms:.2f} jax_act_ms={jax_ms:.2f} ratio={torch_ms / jax_ms:.2f}")


if __name__ == "__main__":
    main()
