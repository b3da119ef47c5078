"""Branch groups in the real game on a real local Ray: how exactly two resets from the same s0 agree under the
same actions, and groups written whole (informative), skipped (no spread) or dropped (an actor killed
mid-group, never half-written)."""

import dataclasses
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from conftest import require_module

pytestmark = pytest.mark.game

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
ray = require_module("ray", "pip install ray")

from histeve_jax.data.records import shard_paths  # noqa: E402
from histeve_jax.envs.base import noop_action  # noqa: E402
from histeve_jax.eval.fleet import EpisodeSpec, Fleet  # noqa: E402
from histeve_jax.eval.rollout import Decision, ExpertAgent, RandomAgent  # noqa: E402
from histeve_jax.rl.actors import GroupSpec, run_groups  # noqa: E402
from histeve_jax.rl.spec import RLSpec  # noqa: E402
from histeve_jax.rl.stream import read_group  # noqa: E402

ENV_KWARGS = {"obs_size": (56, 56), "randomize_init": True, "hang_timeout_s": 6.0}
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the factories below travel by value


def _act(**kw):
    a = noop_action()
    a.update(kw)
    return a


# turn, look down, walk, jump, open the inventory, move the cursor, close it: pose, regime and cursor change
SCRIPT = ([_act(camera=[0.0, 10.0])] * 4 + [_act(camera=[8.0, 0.0])] * 2 + [_act(forward=1)] * 8
          + [_act(jump=1)] + [noop_action()] * 4 + [_act(inventory=1)] + [noop_action()] * 3
          + [_act(camera=[-5.0, 7.0])] * 3 + [noop_action()] * 2 + [_act(inventory=1)] + [noop_action()] * 3)


class _Replay:
    name = "replay"

    def reset(self, task, obs, info, seed):
        self.t = 0

    def act(self, obs, info):
        self.t += 1
        return Decision(action=SCRIPT[self.t - 1])


def _replay(task_name, seed):
    return _Replay()


@pytest.fixture(scope="module")
def fleet():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    f = Fleet(2, ENV_KWARGS, max_attempts=1)
    yield f
    f.close()
    ray.shutdown()


def _replay_pair(fleet) -> list[str]:
    """Two branches (on two games at once) replay SCRIPT from the s0 of one seed. Asserts what real-time play
    cannot blur (the exact s0, equal inventories at every step); returns how the dynamics, which it can blur,
    were off ([] when they agree)."""
    spec = EpisodeSpec("place_dirt", 3, len(SCRIPT))
    a, b = list(fleet.run([spec, spec], _replay))
    assert not a.interrupted and not b.interrupted and a.steps == b.steps == len(SCRIPT)
    ra, rb = a.records, b.records
    pos = np.array([[r.metadata["pos"] for r in rs] for rs in (ra, rb)])
    look = np.array([[[r.metadata["yaw"], r.metadata["pitch"]] for r in rs] for rs in (ra, rb)])
    # the s0 is exact: same seed -> same randomised start pose, inventory, regime
    np.testing.assert_allclose(pos[0, 0], pos[1, 0], atol=1e-3)
    np.testing.assert_allclose(look[0, 0], look[1, 0], atol=1e-2)
    assert ra[0].metadata["inventory"] == rb[0].metadata["inventory"]
    assert a.seed == b.seed and ra[0].frame and rb[0].frame
    assert all(x.metadata["inventory"] == y.metadata["inventory"] for x, y in zip(ra, rb, strict=True))
    # under the same actions: look and regime agree but for when the client applied an input (real-time play,
    # a frame either way); position drifts by how long each step's keys were held
    dpos = np.abs(pos[0] - pos[1]).max()
    dlook = np.abs(look[0] - look[1]).max(axis=0)
    gui_a, gui_b = [r.is_gui_open for r in ra], [r.is_gui_open for r in rb]
    gui_off = sum(x != y for x, y in zip(gui_a, gui_b, strict=True))
    print(f"s0 branches: max |dpos| {dpos:.3f} blocks, |dyaw| {dlook[0]:.2f}, |dpitch| {dlook[1]:.2f} deg, "
          f"regime differs on {gui_off} of {len(gui_a)} steps, final pos {pos[0, -1]} vs {pos[1, -1]}")
    off = []
    if not (any(gui_a) and any(gui_b) and gui_off <= 4):
        off.append(f"regime differs on {gui_off} steps")
    if np.abs(look[0, -1] - look[1, -1]).max() >= 1.0:  # the same final view direction
        off.append(f"final look {look[0, -1]} vs {look[1, -1]}")
    # The same place at the end; mid-walk a branch whose game drops frames under CPU load lags a few steps
    # (measured: max 1.01 blocks mid-trajectory with the suite on 2 workers, final 0.12 apart).
    if np.abs(pos[0, -1] - pos[1, -1]).max() >= 0.5 or dpos >= 2.0:
        off.append(f"final pos {pos[0, -1]} vs {pos[1, -1]}, max |dpos| {dpos:.2f}")
    return off


def test_same_actions_from_the_same_s0_give_the_same_privileged_state(fleet):
    """Same s0, same actions: the same privileged state. The s0 and the inventories must agree on every try;
    the dynamics within the bounds on one of two tries: with the suite's other worker compiling beside two
    games on 2 cores, how long a key is held drifts with the frame rate, which does not repeat, while a replay
    that is really off is off every time. (Two such causes, found this way, are fixed in LuantiEnv: a reset's
    look that reached the client after the first turn, and turns lost in the client's pointer re-centring;
    CI had lost a 10-degree turn on both tries.)"""
    first = _replay_pair(fleet)
    if first:
        again = _replay_pair(fleet)
        assert not again, f"dynamics off on both tries: {first}; then {again}"


@dataclasses.dataclass(frozen=True)
class _Branches:
    """AgentFactory: alternately the expert and a random agent (a counter shared through files, so the
    branches of a group differ wherever they run); the first branch of seed ``victim`` stops at step 5,
    writes its worker pid to ``marker`` and waits to be killed; seed ``flat`` gets experts that cannot
    finish (identical failures)."""

    counter_dir: str
    marker: str
    victim: int
    flat: int

    def __call__(self, task_name, seed):
        if seed == self.victim and not os.path.exists(self.marker + ".claimed"):
            open(self.marker + ".claimed", "w").close()
            return _Hanging(self.marker)
        if seed == self.flat:
            return ExpertAgent()
        i = 0
        while True:
            try:
                os.close(os.open(os.path.join(self.counter_dir, str(i)), os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                i += 1
        return ExpertAgent() if i % 2 == 0 else RandomAgent(seed=i)


class _Hanging(ExpertAgent):
    def __init__(self, marker):
        super().__init__()
        self.marker, self.t = marker, 0

    def act(self, obs, info):
        self.t += 1
        if self.t == 5:
            with open(self.marker + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(self.marker + ".tmp", self.marker)
            time.sleep(120)
        return super().act(obs, info)


def test_groups_are_written_whole_skipped_without_spread_and_dropped_when_an_actor_dies(fleet, tmp_path):
    rl = RLSpec.from_config({"rollout_dir": str(tmp_path / "rollouts"), "reference": "", "replay_rows": 0,
                             "loss": {"group_size": 2}})
    (tmp_path / "n").mkdir()
    marker = str(tmp_path / "victim")
    groups = [GroupSpec("000000-t", "place_dirt", 7, 2, 30),  # expert + random: one success, one failure
              GroupSpec("000001-t", "place_dirt", 8, 2, 30),  # its first branch's actor is killed
              GroupSpec("000002-t", "mine_dirt", 9, 2, 3)]  # two experts that cannot finish in 3 steps

    def killer():
        deadline = time.monotonic() + 150
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(int(open(marker).read()), signal.SIGKILL)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    out = run_groups(fleet, groups, _Branches(str(tmp_path / "n"), marker, victim=8, flat=9), rl,
                     policy_step=5, writer_dir=rl.rollout_dir)
    thread.join(5)
    assert [o.status for o in out] == ["written", "dropped", "skipped"]
    assert out[0].successes == 1 and len(set(out[0].scores)) == 2 and out[2].scores[0] == out[2].scores[1]
    # exactly one shard, the written group's, complete: both branches, every step, the group fields
    paths = shard_paths(rl.rollout_dir)
    assert paths == [out[0].path] and not [f for f in os.listdir(rl.rollout_dir) if f.endswith(".tmp")]
    eps = read_group(paths[0])
    assert len(eps) == 2 and all([r.step for r in ep] == list(range(len(ep))) and ep[-1].done for ep in eps)
    meta = [ep[0].metadata for ep in eps]
    assert {m["group_id"] for m in meta} == {"000000-t"} and sorted(m["branch"] for m in meta) == [0, 1]
    assert all(m["policy_step"] == 5 and m["seed"] == 7 for m in meta)
    assert sorted(m["success"] for m in meta) == [False, True]
    adv = sorted(m["advantage"] for m in meta)
    assert adv[0] < 0 < adv[1] and adv[0] == pytest.approx(-adv[1])
    assert all(r.kind == "rl" for ep in eps for r in ep)
