"""The game fleet on Ray: N game actors, each owning one game, running episodes dispatched to them.

``GameActor`` is a Ray actor that owns ONE game (``envs.make(backend, **env_kwargs)``: its own process tree,
its own Xvfb display and input) and runs whole episodes in it (rollout.run_episode); after an interrupted
episode it closes the game, and the next episode starts a fresh one. ``Fleet`` starts the actors, hands
``EpisodeSpec``s to idle ones and yields each ``EpisodeResult`` as it finishes (``ray.wait``).

Failures: an interrupted episode (the game crashed or hung) is retried with the same seed, up to
``max_attempts`` tries, then yielded as interrupted. An actor whose process dies (``RayActorError``) is
restarted by Ray (``max_restarts=-1``; ``max_task_retries=0`` so Ray itself never replays an episode) and
the Fleet retries its episode the same way, once the actor answers again (``ping`` waits through the
restart; calls to a restarting actor would fail at once under ``max_task_retries=0``). Only complete
results come back, so a caller writing them with ``ShardWriter.write_episode`` never half-writes an episode.

Ray is the engine: locally ``ray.init(num_cpus=os.cpu_count())`` when Ray is not initialised yet, or
``address=`` of a Ray cluster; the code is the same. Agents are built inside the actor from an
``AgentFactory`` (``make_agent(task_name, seed)``), shipped once through the object store; a factory that
routes games (``rl.serving``: game i to policy server i % replicas) reads the game's place in the fleet with
``game_index()``, which a restarted or replacing actor keeps.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from histeve_jax.eval.rollout import AgentFactory, EpisodeResult, run_episode

log = logging.getLogger(__name__)

GAME_INDEX_ENV = "HISTEVE_GAME_INDEX"  # set in a game actor's worker process: its place in the fleet


def game_index() -> int:
    """This process's game's place in its fleet (0, 1, ...); 0 outside a game actor."""
    return int(os.environ.get(GAME_INDEX_ENV, "0"))


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """One episode to run: a task by name, the reset seed, an optional step budget (default the task's)."""

    task: str
    seed: int
    max_steps: int | None = None


@ray.remote(num_cpus=0.5, max_restarts=-1, max_task_retries=0)
class GameActor:
    """Owns one game (started at the first episode) and runs episodes in it."""

    def __init__(self, backend: str, env_kwargs: Mapping[str, Any], run_kwargs: Mapping[str, Any],
                 slot: str = "", index: int = 0):
        # In the environment, not a module global: Ray ships this class by value, so a global set here would
        # not be the one game_index() reads. This worker process serves only this actor (as tempfile below).
        os.environ[GAME_INDEX_ENV] = str(index)
        # The game's temp world goes under a folder named after the actor's slot, which a restarted actor
        # (same constructor arguments) empties: a killed worker cannot remove its own world.
        if slot:
            scratch = os.path.join(tempfile.gettempdir(), "histeve_fleet", slot)
            shutil.rmtree(scratch, ignore_errors=True)
            os.makedirs(scratch, mode=0o700)
            tempfile.tempdir = scratch  # this worker process serves only this actor
        self.scratch = tempfile.gettempdir() if slot else ""
        self.backend = backend
        self.env_kwargs = dict(env_kwargs)
        self.run_kwargs = dict(run_kwargs)
        self.env = None

    def run(self, spec: EpisodeSpec, make_agent: AgentFactory) -> EpisodeResult:
        """Run one episode of ``spec`` with ``make_agent(spec.task, spec.seed)``."""
        from histeve_jax.envs import load_task, make

        if self.env is None:
            self.env = make(self.backend, **self.env_kwargs)
        task = load_task(spec.task)
        agent = make_agent(spec.task, spec.seed)
        result = run_episode(self.env, task, spec.seed, agent, max_steps=spec.max_steps,
                             backend=self.backend, **self.run_kwargs)
        if result.interrupted:  # restart the game from scratch before the next episode
            self.close()
        return result

    @ray.method(max_task_retries=-1)
    def ping(self) -> int:
        """Returns this worker's pid; unlike ``run``, a call waits through a restart of the actor."""
        return os.getpid()

    def pids(self) -> list[int]:
        """This actor's worker pid, then its game's process pids (none before the first episode)."""
        return [os.getpid()] + (list(self.env.pids()) if self.env is not None else [])

    def close(self, remove_scratch: bool = False) -> None:
        """Stop the game (its processes and temp world); with ``remove_scratch`` also the slot's folder."""
        if self.env is not None:
            self.env.close()
            self.env = None
        if remove_scratch and self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


class Fleet:
    """``num_instances`` game actors on a Ray cluster (a local one by default); see the module docstring.

    ``env_kwargs`` go to ``envs.make(backend, ...)`` in every actor; ``run_kwargs`` to ``run_episode``
    (``kind``, ``frame_format``, ``jpeg_quality``).
    """

    def __init__(self, num_instances: int, env_kwargs: Mapping[str, Any], *, backend: str = "luanti",
                 address: str | None = None, max_attempts: int = 3, num_cpus_per_game: float = 0.5,
                 run_kwargs: Mapping[str, Any] | None = None):
        if num_instances < 1 or max_attempts < 1:
            raise ValueError(f"Fleet: num_instances and max_attempts must be >= 1, got {num_instances}, "
                             f"{max_attempts}")
        self.max_attempts = max_attempts
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if address is None:
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
            else:
                ray.init(address=address, logging_level=logging.WARNING)
        self._actor_args = (backend, dict(env_kwargs), dict(run_kwargs or {}))
        self._num_cpus = num_cpus_per_game
        self.slots: list[str] = []  # every actor's scratch folder name, restarted and replaced ones too
        self.actors = [self._new_actor(i) for i in range(num_instances)]

    def _new_actor(self, index: int) -> Any:
        self.slots.append(uuid.uuid4().hex)
        return GameActor.options(num_cpus=self._num_cpus).remote(*self._actor_args, slot=self.slots[-1],
                                                                 index=index)

    def scratch_dirs(self) -> list[str]:
        """This fleet's actors' scratch folders that exist now (other fleets on the host have their own)."""
        root = os.path.join(tempfile.gettempdir(), "histeve_fleet")
        return [p for p in (os.path.join(root, s) for s in self.slots) if os.path.isdir(p)]

    def run(self, specs: Sequence[EpisodeSpec], make_agent: AgentFactory) -> Iterator[EpisodeResult]:
        """Run every spec on the fleet; yields each complete result as it finishes (any order)."""
        agent_ref = ray.put(make_agent)
        pending = collections.deque((spec, 1) for spec in specs)
        idle = list(self.actors)
        running: dict[ray.ObjectRef, tuple[Any, EpisodeSpec, int]] = {}
        recovering: dict[ray.ObjectRef, Any] = {}  # ping of an actor that died -> the actor
        while pending or running:
            while idle and pending:
                actor = idle.pop()
                spec, attempt = pending.popleft()
                running[actor.run.remote(spec, agent_ref)] = (actor, spec, attempt)
            if not running:  # every actor is restarting
                self._recover(recovering, idle, block=True)
                continue
            (ref,), _ = ray.wait([*running, *recovering], num_returns=1)
            if ref in recovering:
                self._recover(recovering, idle, block=False)
                continue
            actor, spec, attempt = running.pop(ref)
            try:
                result = ray.get(ref)
                idle.append(actor)
            except RayActorError as e:
                recovering[actor.ping.remote()] = actor
                result = EpisodeResult(task=spec.task, seed=spec.seed, agent="", episode_id="",
                                       success=False, steps=0, interrupted=True,
                                       error=f"the game actor died: {type(e).__name__}: {e}", progress=0.0,
                                       records=[], seconds=0.0)
            if result.interrupted and attempt < self.max_attempts:
                log.warning("%s seed %d interrupted (attempt %d of %d), retrying: %s", spec.task, spec.seed,
                            attempt, self.max_attempts, result.error)
                pending.appendleft((spec, attempt + 1))
                continue
            yield result
        self._recover(recovering, idle, block=True)

    def _recover(self, recovering: dict[ray.ObjectRef, Any], idle: list[Any], *, block: bool) -> None:
        """Move actors whose ping answered back to ``idle``; one that cannot come back is replaced."""
        if not recovering:
            return
        ready, _ = ray.wait(list(recovering), num_returns=len(recovering) if block else 1,
                            timeout=None if block else 0)
        for ref in ready:
            actor = recovering.pop(ref)
            try:
                ray.get(ref)
            except RayActorError:  # out of restarts: a fresh actor takes its place
                i = self.actors.index(actor)
                actor = self.actors[i] = self._new_actor(i)
            idle.append(actor)

    def pids(self) -> list[list[int]]:
        """Per actor: its worker pid, then its game's pids."""
        return ray.get([a.pids.remote() for a in self.actors])

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every game, kill the actors, and shut Ray down if this Fleet started it."""
        refs = [a.close.remote(remove_scratch=True) for a in self.actors]
        try:
            ray.get(refs, timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as e:
            # a game left running dies with its worker (PR_SET_PDEATHSIG)
            log.warning("Fleet.close: not every game closed cleanly: %s", e)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
