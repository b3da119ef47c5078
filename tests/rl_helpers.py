"""Branch groups in the record schema without a game: real JPEG frames, actions sampled token by token from
the action grammar (``eval.rollout.RandomAgent`` over the tiny policy's compact action ids), real scores."""

from __future__ import annotations

import numpy as np

from histeve_jax.actions.tokens import ActionVocab
from histeve_jax.data.records import ShardWriter, StepRecord, encode_frame
from histeve_jax.envs.tasks import load_task
from histeve_jax.eval.rollout import EpisodeResult, RandomAgent, jsonable_action
from histeve_jax.rl import scoring
from histeve_jax.rl.order import GROUP_PREFIX
from histeve_jax.rl.samples import group_records

TINY_ACTION_BASE = 320  # qwen2_5_vl.tiny's table: the action rows follow its 320 rows


def episode(task: str, seed: int, branch: int, length: int, success: bool, diverge: int = 0,
            gui_from: int | None = None) -> EpisodeResult:
    """``length`` steps (+ the final frame): the same tokens for every branch before ``diverge``."""
    agent = RandomAgent(vocab=ActionVocab.contiguous("vpt", TINY_ACTION_BASE), seed=seed)
    shared = np.random.default_rng([seed, 99])
    own = np.random.default_rng([seed, branch])
    recs = []
    for t in range(length + 1):
        gui = gui_from is not None and t >= gui_from
        agent._rng = shared if t < diverge else own
        tokens, logprobs = agent.sample_tokens(int(gui))
        action, _ = agent.vocab.decode(tokens)
        img = (own if t >= diverge else shared).integers(0, 256, (56, 56, 3), dtype=np.uint8)
        meta = {"seed": seed, "health": 20.0}
        if t < length:
            meta.update(action_tokens=tokens, action_logprobs=logprobs, action_text="")
        recs.append(StepRecord(
            episode_id=f"{task}-{seed}-{branch}", step=t, task_id=task, kind="eval", instruction="do it",
            frame=encode_frame(img), action=jsonable_action(action), is_gui_open=gui,
            completed=int(success and t == length), done=t == length, metadata=meta))
    return EpisodeResult(task=task, seed=seed, agent="policy", episode_id=recs[0].episode_id, success=success,
                         steps=length, interrupted=False, error="", progress=1.0 if success else 0.0,
                         records=recs, seconds=0.0)


def group(task: str, seed: int, successes: list[bool], length: int = 6, diverge: int = 2,
          policy_step: int = 0, gid: str | None = None) -> list[list[StepRecord]]:
    """One group's episodes as ``rl.actors.run_groups`` writes them."""
    results = [episode(task, seed, b, length, s, diverge) for b, s in enumerate(successes)]
    t = load_task(task)
    scores = [scoring.trajectory_score(r, t, 120) for r in results]
    verdict = scoring.group_verdict([s.total for s in scores])
    return group_records(results, gid or f"{seed:06d}", scores, verdict.advantages, policy_step)


def write_group(directory: str, episodes: list[list[StepRecord]], name: str) -> str:
    """Write one group as its one shard (``.tmp``, then renamed); returns the path."""
    with ShardWriter(directory, prefix=f"{GROUP_PREFIX}-{name}", records_per_shard=1 << 30) as w:
        for ep in episodes:
            w.write_episode(ep)
    return w.paths[0]
