"""Closed-loop rollouts: one episode of an agent in a game env, recorded step by step as ``StepRecord``s.

This module owns the episode loop (reset from ``(seed, task)``, decide, step, stop), the one builder of step
records (demonstrations and evaluation episodes share it; ``experiments/record.py`` records through
``run_episode``), the ``Agent`` protocol, and the agents that need no model: ``ExpertAgent`` (the task's
scripted expert) and ``RandomAgent`` (uniform over the action grammar).

An episode stops when the task's privileged success check holds (``info["success"]``), when the step budget
runs out, or when the agent says ``subtask == "done"`` or gives up (a ``RuntimeError`` from ``act``: a failed
episode). A game that crashes or hangs (``GameError``) interrupts the episode: the result keeps no records
and says ``interrupted=True`` (not a failure of the agent; the caller retries it).

Agents are built where the game runs (see fleet.py) from an ``AgentFactory``: a picklable callable
``make_agent(task_name, seed) -> Agent``, so a policy agent can carry a handle to a policy server instead of
its weights.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from histeve_jax.data.records import StepRecord, encode_frame
from histeve_jax.envs.base import EVENT_KEYS, noop_action
from histeve_jax.envs.experts import expert_for
from histeve_jax.envs.luanti.process import GameError
from histeve_jax.envs.tasks import Task

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Decision:
    """What an agent does at one step."""

    action: dict[str, Any]  # env format (0/1 buttons, camera = [dpitch, dyaw] degrees)
    subtask: str = ""
    tokens: list[int] | None = None  # sampled action token ids (policy agents)
    logprobs: list[float] | None = None  # their log-probabilities under the sampling distribution
    text: str = ""  # the decoded action as text, for the report


class Agent(Protocol):
    """Anything that acts in a game: reset once per episode, then one decision per step."""

    name: str

    def reset(self, task: Task, obs: dict, info: dict, seed: int) -> None: ...

    def act(self, obs: dict, info: dict) -> Decision: ...


AgentFactory = Callable[[str, int], Agent]  # make_agent(task_name, seed), called where the game runs


@dataclasses.dataclass
class EpisodeResult:
    """One finished (or interrupted) episode; ``records`` is empty when ``interrupted``."""

    task: str
    seed: int
    agent: str
    episode_id: str
    success: bool
    steps: int  # actions taken
    interrupted: bool  # the game crashed or hung: no verdict on the agent
    error: str  # why the episode was interrupted, or why the agent gave up ("" otherwise)
    progress: float  # fraction of the task's subgoals verified during the episode; 1.0 on success
    records: list[StepRecord]
    seconds: float


def jsonable_action(action: Mapping[str, Any]) -> dict[str, Any]:
    """An env-format action with plain ints and a [dpitch, dyaw] list of floats (msgpack-ready)."""
    return {k: ([float(x) for x in np.asarray(v).reshape(2)] if k == "camera" else int(v))
            for k, v in action.items()}


def step_record(task: Task, episode_id: str, step: int, obs: dict, info: dict, decision: Decision, *,
                reward: float, done: bool, kind: str, seed: int, backend: str, frame_format: str = "jpeg",
                jpeg_quality: int = 95, instruction: str | None = None) -> StepRecord:
    """The record of one step: the frame the agent saw, what it did, the regime, cursor, events and labels.

    ``completed`` is 1 on frames where the task's success check already holds (the detector's label).
    ``instruction``: what the agent was told where the episode started (``task.instruction`` of its first
    info: the text with the slots it names filled in); None stores ``task.text``.
    Policy agents' sampled tokens go to ``metadata["action_tokens"/"action_logprobs"/"action_text"]``.
    """
    metadata: dict[str, Any] = {
        "backend": backend, "seed": seed, "pos": [float(v) for v in info["pos"]],
        "yaw": float(info["yaw"]), "pitch": float(info["pitch"]), "inventory": dict(info["inventory"]),
        # RL's score reads these (rl.scoring): the death penalty, and a craft's ingredients in the grid
        "health": float(info.get("health", 20.0)),
        "craft_grid": sum(s["type"] != "air" for s in info.get("craft_grid") or ()),
    }
    if decision.tokens is not None:
        metadata["action_tokens"] = [int(t) for t in decision.tokens]
        metadata["action_logprobs"] = [float(p) for p in (decision.logprobs or [])]
        metadata["action_text"] = decision.text
    return StepRecord(
        episode_id=episode_id, step=step, task_id=task.name, kind=kind,
        instruction=task.text if instruction is None else instruction,
        frame=encode_frame(obs["image"], frame_format, jpeg_quality), frame_format=frame_format,
        action=jsonable_action(decision.action), is_gui_open=bool(info["is_gui_open"]),
        cursor=None if info["cursor"] is None else [float(v) for v in info["cursor"]],
        subtask=decision.subtask, events={k: dict(info[k]) for k in EVENT_KEYS},
        reward=float(reward), done=done, completed=int(task.is_success(info)), metadata=metadata,
    )


def run_episode(env: Any, task: Task, seed: int, agent: Agent, *, max_steps: int | None = None,
                kind: str = "eval", frame_format: str = "jpeg", jpeg_quality: int = 95,
                backend: str = "luanti", after_success: int = 0) -> EpisodeResult:
    """Run ``agent`` for one episode of ``task`` from ``env.reset(seed=seed)``; see the module docstring.

    ``after_success``: steps played on after the success check first holds (the agent's own actions; no-ops
    once it says "done" or gives up), so the records show the complete state as an agent that has not been
    stopped yet keeps seeing it: the completion detector's positives. The result's ``success`` is whether
    the check held at any step. The records end with the frame after the last action, stored with a no-op
    action and ``done=True``.
    """
    t0 = time.monotonic()
    budget = task.max_steps if max_steps is None else int(max_steps)
    episode_id = f"{task.name}-{seed}-{uuid.uuid4().hex[:8]}"
    name = getattr(agent, "name", type(agent).__name__)
    records: list[StepRecord] = []
    verified: set[str] = set()
    error = ""
    instruction = task.text

    def record(obs, info, decision, reward, done):
        records.append(step_record(task, episode_id, len(records), obs, info, decision, reward=reward,
                                   done=done, kind=kind, seed=seed, backend=backend,
                                   frame_format=frame_format, jpeg_quality=jpeg_quality,
                                   instruction=instruction))

    try:
        obs, info = env.reset(seed=seed, options={"task": task})
        instruction = task.instruction(info)
        agent.reset(task, obs, info, seed)
        verified.update(task.subgoals_done(info))
        reached = bool(info["success"])
        after, finished = 0, False
        DONE = Decision(action=noop_action(), subtask="done")  # noqa: N806
        for t in range(budget + after_success):
            if reached:
                if after >= after_success:
                    break
                after += 1
            elif t >= budget:
                break
            try:
                decision = DONE if finished else agent.act(obs, info)
            except GameError:
                raise
            except RuntimeError as e:  # the agent gave up (e.g. an expert whose GUI did not open): a failure
                if not reached:
                    error = f"{name} gave up at step {t}: {e}"
                    log.warning("%s seed %d: %s", task.name, seed, error)
                    break
                decision = DONE
            finished = finished or (reached and decision.subtask == "done")
            next_obs, reward, terminated, truncated, next_info = env.step(decision.action)
            record(obs, info, decision, reward, False)
            obs, info = next_obs, next_info
            verified.update(task.subgoals_done(info))
            reached = reached or bool(info["success"])
            if not reached and (terminated or truncated or decision.subtask == "done"):
                break
        record(obs, info, Decision(action=noop_action(), subtask="done"), 0.0, True)
    except GameError as e:
        log.warning("%s seed %d: the game failed after %d steps: %s", task.name, seed, len(records), e)
        return EpisodeResult(task=task.name, seed=seed, agent=name, episode_id=episode_id, success=False,
                             steps=len(records), interrupted=True, error=f"{type(e).__name__}: {e}",
                             progress=0.0, records=[], seconds=time.monotonic() - t0)
    success = reached
    progress = 1.0 if success else (len(verified) / len(task.subgoals) if task.subgoals else 0.0)
    return EpisodeResult(task=task.name, seed=seed, agent=name, episode_id=episode_id, success=success,
                         steps=len(records) - 1, interrupted=False, error=error, progress=progress,
                         records=records, seconds=time.monotonic() - t0)


# ---------------------------------------------------------------------- agents without a model


class ExpertAgent:
    """The task's scripted expert (``envs.experts.expert_for``), as an Agent."""

    name = "expert"

    def __init__(self, perturb: float = 0.0) -> None:
        self._expert = None
        self.perturb = perturb  # Expert.perturb: the chance of aiming off first (recorded, never imitated)

    def reset(self, task: Task, obs: dict, info: dict, seed: int) -> None:
        self._expert = expert_for(task)
        if self.perturb:
            self._expert.set_perturbation(self.perturb, seed)
        self._expert.reset(info)

    def act(self, obs: dict, info: dict) -> Decision:
        action, subtask = self._expert.act(info)
        return Decision(action=action, subtask=subtask)


class RandomAgent:
    """Uniform over the grammar: each token drawn uniformly among those the action automaton allows next.

    The regime (``info["is_gui_open"]``) picks the start state; tokens are ids of ``vocab`` (by default the
    codebook's action tokens at ids 0, 1, ...), each with log-probability ``-log(n_allowed)``. The draws of
    an episode depend only on (seed, episode seed).
    """

    name = "random"

    def __init__(self, codebook: str = "vpt", seed: int = 0, vocab: Any = None):
        from histeve_jax.actions.grammar import DONE, build_grammar
        from histeve_jax.actions.tokens import ActionVocab

        self.vocab = vocab if vocab is not None else ActionVocab.contiguous(codebook, 0)
        grammar = build_grammar(self.vocab, int(self.vocab.ids.max()) + 1)
        self._allowed = np.asarray(grammar.allowed)
        self._next = np.asarray(grammar.next_state)
        self._done = DONE
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    def reset(self, task: Task, obs: dict, info: dict, seed: int) -> None:
        self._rng = np.random.default_rng([self.seed, seed])

    def sample_tokens(self, regime: int) -> tuple[list[int], list[float]]:
        """One action's token ids and their log-probabilities, starting from ``regime`` (0 NG, 1 GUI)."""
        state, tokens, logprobs = int(regime), [], []  # grammar.start_state(regime) == regime
        while state != self._done:
            ok = np.flatnonzero(self._allowed[state])
            token = int(ok[self._rng.integers(len(ok))])
            tokens.append(token)
            logprobs.append(-math.log(len(ok)))
            state = int(self._next[state, token])
        return tokens, logprobs

    def act(self, obs: dict, info: dict) -> Decision:
        tokens, logprobs = self.sample_tokens(int(bool(info["is_gui_open"])))
        action, _ = self.vocab.decode(tokens)
        text = " ".join(self.vocab.strings[self.vocab.slot_of_id[t]] for t in tokens)
        return Decision(action=action, tokens=tokens, logprobs=logprobs, text=text)


def expert_agent(task_name: str, seed: int, perturb: float = 0.0) -> ExpertAgent:
    """AgentFactory of scripted experts (bind ``perturb`` with functools.partial)."""
    return ExpertAgent(perturb)


def random_agent(task_name: str, seed: int, codebook: str = "vpt") -> RandomAgent:
    """AgentFactory of grammar-uniform random agents (bind ``codebook`` with functools.partial)."""
    return RandomAgent(codebook, seed=0)
