"""DAgger: the policy plays, the expert takes over from the state it left, its part becomes a demonstration,
and the run trains on it (one real round on the game)."""

from __future__ import annotations

import json
import os

import pytest

from experiments.configs import imitation
from histeve_jax.data import records as records_lib
from histeve_jax.data import synthetic
from histeve_jax.envs.base import noop_action
from histeve_jax.eval.rollout import Decision, EpisodeResult, jsonable_action
from histeve_jax.eval.takeover import POLICY_SUBTASK, TakeoverAgent, TakeoverFactory, expert_part, switch_of
from histeve_jax.train.loop import train
from histeve_jax.train.specs import RunSpec


def _result(subtasks: list[str]) -> EpisodeResult:
    recs = [records_lib.StepRecord(episode_id="e", step=i, task_id="craft_planks", kind="eval",
                                   instruction="x", frame=b"", action=jsonable_action(noop_action()),
                                   is_gui_open=False, subtask=s) for i, s in enumerate([*subtasks, "done"])]
    return EpisodeResult(task="craft_planks", seed=3, agent="takeover", episode_id="e", success=True,
                         steps=len(subtasks), interrupted=False, error="", progress=1.0, records=recs,
                         seconds=1.0)


def test_the_expert_part_is_an_episode_of_its_own_from_the_takeover():
    res = _result([POLICY_SUBTASK] * 3 + ["pick", "pick", "place"])
    part = expert_part(res)
    assert switch_of(res) == 3
    assert [r.step for r in part] == list(range(4)) and [r.subtask for r in part] == ["pick", "pick", "place",
                                                                                      "done"]
    assert {r.kind for r in part} == {"demo"} and len({r.episode_id for r in part}) == 1
    assert {r.metadata["takeover_at"] for r in part} == {3}
    assert part[0].episode_id != "e" and res.records[3].step == 3  # the result itself is left as it was
    assert expert_part(_result([POLICY_SUBTASK] * 4)) == []  # the policy finished: nothing to relabel


class _Fixed:
    name = "fixed"

    def reset(self, task, obs, info, seed):
        self.n = 0

    def act(self, obs, info):
        self.n += 1
        return Decision(action={**noop_action(), "jump": 1}, subtask="mine")


def test_the_switch_is_drawn_per_episode_and_the_expert_starts_there():
    from histeve_jax.envs import load_task

    factory = TakeoverFactory(lambda task, seed: _Fixed(), min_switch=2, max_switch=9, seed=0)
    switches = [factory("craft_planks", s).switch for s in range(40)]
    assert switches == [factory("craft_planks", s).switch for s in range(40)]  # fixed by the seeds
    assert min(switches) >= 2 and max(switches) <= 9 and len(set(switches)) > 4
    agent = TakeoverAgent(_Fixed(), switch=2)
    info = {"is_gui_open": False, "inventory": {"default:tree": 1}, "yaw": 0.0, "pitch": 0.0,
            "pos": (0.0, 8.5, 0.0), "cursor": None, "inventory_slots": [], "craft_grid": None}
    agent.reset(load_task("craft_planks"), {}, info, 0)
    got = [agent.act({}, info) for _ in range(3)]
    assert [d.subtask for d in got[:2]] == [POLICY_SUBTASK] * 2 and got[0].action["jump"] == 1
    assert got[2].subtask == "open_inventory" and got[2].action["inventory"] == 1  # the expert's first step


@pytest.mark.game
def test_a_dagger_round_relabels_the_policys_states_and_trains_on_them(tmp_path):
    """One round on the game: a (barely trained, so nearly random) policy acts for a step or two (longer, it
    may drop or place the only log), the craft expert takes over and finishes; the kept episodes start in the
    policy's state, are written as records, and the round's run trains from the start run's weights on the
    demonstrations plus them."""
    from experiments.dagger import train_round
    from histeve_jax.train.dagger import DaggerSpec, run_dagger

    root = tmp_path
    synthetic.write_demo_dataset(root / "demos", episodes=4, length=8, seed=0)
    c = imitation.get_config("tiny")
    c.data.train_dirs = str(root / "demos")
    c.data.batch_size = 2
    c.num_train_steps = 2
    c.optimizer.warmup_steps = 1
    c.eval_every = 0
    c.checkpoint_every = 2
    c.progress_bar = False
    c.async_checkpoint = False
    start = str(root / "start")
    train(RunSpec.from_config(c, start))
    spec = DaggerSpec(start_run=start, workdir=str(root / "dagger"), tasks=("craft_planks",), rounds=1,
                      episodes=3, min_switch=1, max_switch=2, train_steps=2, instances=1, max_steps=200,
                      env={"randomize_init": True})
    last = run_dagger(spec, train_round, log=lambda s: None)
    assert last == os.path.join(spec.workdir, "round_0")
    counts = json.load(open(os.path.join(last, "collect.json")))["tasks"]["craft_planks"]
    assert counts["episodes"] == 3 and counts["kept"] == counts["successes"] >= 1, counts["errors"]
    assert 1 <= counts["mean_switch"] <= 2
    eps: dict[str, list] = {}
    for p in records_lib.shard_paths(os.path.join(last, "records")):
        for r in records_lib.read_shard(p):
            eps.setdefault(r.episode_id, []).append(r)
    assert len(eps) == counts["kept"]
    for recs in eps.values():
        assert [r.step for r in recs] == list(range(len(recs))) and recs[0].kind == "demo"
        assert 1 <= recs[0].metadata["takeover_at"] <= 2
        assert POLICY_SUBTASK not in {r.subtask for r in recs} and recs[-1].done
        assert recs[-1].metadata["inventory"].get("default:wood", 0) >= 4  # the expert finished the craft
    cfg = json.load(open(os.path.join(last, "config.json")))
    assert cfg["init_from"] == start
    assert cfg["data"]["train_dirs"].split(",") == [str(root / "demos"), os.path.join(last, "records")]
    # a rerun finds the round done and changes nothing
    assert run_dagger(spec, train_round, log=lambda s: None) == last
