"""The game fleet on a real local Ray: parallel games give the single-game results; a killed actor's episode
is retried; closing leaves no game processes."""

import dataclasses
import os
import signal
import sys
import threading
import time

import pytest
from conftest import require_module

pytestmark = pytest.mark.game

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
ray = require_module("ray", "pip install ray")

from histeve_jax.envs import load_task, make  # noqa: E402
from histeve_jax.eval.fleet import EpisodeSpec, Fleet  # noqa: E402
from histeve_jax.eval.rollout import ExpertAgent, expert_agent, run_episode  # noqa: E402

ENV_KWARGS = {"obs_size": (64, 64), "randomize_init": True, "hang_timeout_s": 6.0}
SPECS = [EpisodeSpec(task, seed) for task in ("place_dirt", "craft_planks") for seed in (0, 1)]

# The factories below live in this (test) module, which Ray's workers cannot import: ship them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def fleet():
    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    print(f"ray.init: {time.monotonic() - t0:.1f} s")
    f = Fleet(2, ENV_KWARGS)
    yield f
    f.close()
    ray.shutdown()


def _complete(res) -> bool:
    recs = res.records
    steps = [r.step for r in recs]
    return (not res.interrupted and recs and recs[-1].done and steps == list(range(len(recs)))
            and {r.episode_id for r in recs} == {res.episode_id})


def test_two_games_give_the_single_game_results(fleet):
    t0 = time.monotonic()
    results = list(fleet.run(SPECS, expert_agent))
    print(f"fleet: {len(results)} episodes in {time.monotonic() - t0:.1f} s "
          f"({', '.join(f'{r.task}/{r.seed} {r.seconds:.1f} s' for r in results)})")
    assert sorted((r.task, r.seed) for r in results) == sorted((s.task, s.seed) for s in SPECS)
    assert all(_complete(r) for r in results)
    workers = [p[0] for p in fleet.pids()]
    assert len(set(workers)) == 2  # two actors, two processes, two games
    env = make("luanti", **ENV_KWARGS)
    try:
        t0 = time.monotonic()
        single = {(s.task, s.seed): run_episode(env, load_task(s.task), s.seed, ExpertAgent()) for s in SPECS}
        print(f"one game: {len(single)} episodes in {time.monotonic() - t0:.1f} s")
    finally:
        env.close()
    assert {(r.task, r.seed): r.success for r in results} == {k: r.success for k, r in single.items()}
    assert all(r.success for r in results)


@dataclasses.dataclass(frozen=True)
class _HangOnce:
    """AgentFactory: experts, except that the first (task, seed) == victim episode stops at step 5, writes
    its worker pid to ``marker`` and waits to be killed."""

    marker: str
    victim: tuple[str, int]

    def __call__(self, task_name: str, seed: int):
        return _HangingExpert(self.marker) if (task_name, seed) == self.victim else ExpertAgent()


class _HangingExpert(ExpertAgent):
    def __init__(self, marker: str):
        super().__init__()
        self.marker, self.t = marker, 0

    def act(self, obs, info):
        self.t += 1
        if self.t == 5 and not os.path.exists(self.marker):
            with open(self.marker + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(self.marker + ".tmp", self.marker)
            time.sleep(120)
        return super().act(obs, info)


def test_killed_actor_is_restarted_and_its_episode_retried(fleet, tmp_path):
    marker = str(tmp_path / "victim_pid")
    before = {p[0]: p[1:] for p in fleet.pids()}
    killed = {}

    def killer():
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(open(marker).read())
        killed[pid] = before[pid]
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    results = list(fleet.run(SPECS[:3], _HangOnce(marker, ("place_dirt", 1))))
    thread.join(5)
    assert killed, "the victim episode never reached step 5"
    assert sorted((r.task, r.seed) for r in results) == sorted((s.task, s.seed) for s in SPECS[:3])
    assert all(_complete(r) and r.success for r in results)
    (dead_worker, dead_games), = killed.items()
    assert not _alive(dead_worker)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in dead_games) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in dead_games)  # the killed worker's game died with it
    pids = fleet.pids()
    workers = [p[0] for p in pids]
    assert dead_worker not in workers and len(workers) == 2  # Ray restarted the actor
    # This fleet's own folders only: other fleets on the machine, or ones killed earlier, have theirs.
    worlds = [d for w in fleet.scratch_dirs() for d in os.listdir(w)]
    assert len(worlds) == sum(len(p) > 1 for p in pids)  # one per live game: the dead game's is gone


@dataclasses.dataclass(frozen=True)
class _CrashGameOnce:
    """AgentFactory: experts, except that the first victim episode kills its own game at step 3."""

    marker: str
    victim: tuple[str, int]

    def __call__(self, task_name: str, seed: int):
        return _GameKiller(self.marker) if (task_name, seed) == self.victim else ExpertAgent()


class _GameKiller(ExpertAgent):
    def __init__(self, marker: str):
        super().__init__()
        self.marker, self.t = marker, 0

    def act(self, obs, info):
        self.t += 1
        if self.t == 3 and not os.path.exists(self.marker):
            import psutil

            games = [p for p in psutil.Process().children() if p.name() == "minetest"]
            open(self.marker, "w").write(str(games[0].pid))
            games[0].kill()
        return super().act(obs, info)


def test_interrupted_episode_is_retried_with_the_same_seed_on_a_fresh_game(fleet, tmp_path):
    marker = str(tmp_path / "killed_game")
    results = list(fleet.run(SPECS[:2], _CrashGameOnce(marker, ("place_dirt", 0))))
    assert os.path.exists(marker)
    assert not _alive(int(open(marker).read()))
    assert sorted((r.task, r.seed) for r in results) == [("place_dirt", 0), ("place_dirt", 1)]
    assert all(_complete(r) and r.success for r in results)
    assert all(r.records[0].metadata["seed"] == r.seed for r in results)


def test_close_leaves_no_game_processes(fleet):
    pids = [p for ps in fleet.pids() for p in ps]
    assert len(pids) >= 4  # two workers, and minetest + Xvfb of at least one game
    fleet.close()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert not fleet.scratch_dirs()  # and no temp worlds
