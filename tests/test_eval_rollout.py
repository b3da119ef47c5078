"""The rollout loop: expert and random agents in the real game, recorded in the one record schema."""

import math
import os
import signal

import numpy as np
import pytest

from histeve_jax.actions.grammar import accepts, build_grammar
from histeve_jax.data.records import BINARY_KEYS, decode_frame, serialize
from histeve_jax.envs import load_task, make
from histeve_jax.eval.rollout import Decision, ExpertAgent, RandomAgent, run_episode


@pytest.fixture(scope="module")
def env():
    e = make("luanti", obs_size=(64, 64), task="place_dirt", hang_timeout_s=4.0)
    yield e
    e.close()


def test_random_agent_samples_only_grammar_valid_actions_with_uniform_logprobs():
    agent = RandomAgent("vpt", seed=3)
    grammar = build_grammar(agent.vocab, int(agent.vocab.ids.max()) + 1)
    allowed = np.asarray(grammar.allowed)
    for regime in (0, 1, 0, 1) * 50:
        tokens, logprobs = agent.sample_tokens(regime)
        assert accepts(grammar, tokens, regime)
        assert logprobs[0] == 0.0  # the type token is forced by the regime
        assert all(lp <= 0.0 for lp in logprobs)
        _, decoded_regime = agent.vocab.decode(tokens)
        assert int(decoded_regime) == regime
    # log-probabilities are -log(number of tokens the grammar allows at that point)
    tokens, logprobs = agent.sample_tokens(0)
    assert math.isclose(logprobs[1], -math.log(allowed[grammar.next_state[0, tokens[0]]].sum()))


@pytest.mark.game
def test_expert_episode_succeeds_and_its_records_follow_the_schema(env):
    task = load_task("place_dirt")
    res = run_episode(env, task, 0, ExpertAgent())
    assert res.success and not res.interrupted and res.error == "" and res.progress == 1.0
    assert res.agent == "expert" and res.task == "place_dirt" and res.seed == 0
    recs = res.records
    assert res.steps == len(recs) - 1 and 3 < res.steps < 40
    for r in recs:
        serialize(r)  # validates against the schema
    assert [r.step for r in recs] == list(range(len(recs)))
    assert {r.episode_id for r in recs} == {res.episode_id}
    assert all(r.kind == "eval" and r.task_id == "place_dirt" and r.instruction == task.text for r in recs)
    assert recs[-1].done and not any(r.done for r in recs[:-1])
    assert recs[0].completed == 0 and recs[-1].completed == 1
    flips = [i for i in range(1, len(recs)) if recs[i].completed != recs[i - 1].completed]
    assert len(flips) == 1  # completed flips to 1 once, at the end
    assert set(recs[0].action) == set(BINARY_KEYS) | {"camera"}
    assert recs[-1].subtask == "done"
    assert recs[-1].action["camera"] == [0.0, 0.0] and not any(recs[-1].action[k] for k in BINARY_KEYS)
    assert decode_frame(recs[0].frame).shape == (64, 64, 3)
    assert recs[-1].events["place_block"] == {"default:dirt": 1}
    assert "action_tokens" not in recs[0].metadata and recs[0].metadata["seed"] == 0


@pytest.mark.game
def test_every_record_holds_the_instruction_read_from_the_first_state(env):
    """craft_planks names the log's slot: from a cluttered start (leaves on slot 1) every record of the
    episode, the last included (the log crafted away by then), says slot 2, what the agent was told."""
    task = load_task("craft_planks").varied(clutter=1.0)
    env.randomize_init = True
    try:
        res = run_episode(env, task, 3, ExpertAgent())
    finally:
        env.randomize_init = False
    assert res.success
    want = "open the inventory and craft wooden planks from the log in slot 2"
    assert {r.instruction for r in res.records} == {want}
    assert res.records[0].metadata["inventory"]["default:leaves"] >= 1


@pytest.mark.game
def test_after_success_plays_on_with_the_complete_state_recorded(env):
    """after_success=5: the same expert episode, then five more steps (the expert's no-ops once it is done),
    every one of them labelled complete from the game's own check: the detector's task positives."""
    task = load_task("place_dirt")
    res = run_episode(env, task, 0, ExpertAgent(), after_success=5)
    assert res.success and res.error == "" and res.steps == len(res.records) - 1
    completed = [r.completed for r in res.records]
    first = completed.index(1)
    assert completed == [0] * first + [1] * (len(completed) - first)
    assert len(completed) - first == 6  # the frame where it first holds, five steps on (the last one done)
    assert [r.step for r in res.records] == list(range(len(res.records)))
    assert res.records[-1].done and not any(r.done for r in res.records[:-1])
    assert res.records[-1].events["place_block"] == {"default:dirt": 1}  # nothing more was placed


@pytest.mark.game
def test_random_episode_records_grammar_valid_tokens_and_logprobs(env):
    agent = RandomAgent("vpt", seed=1)
    grammar = build_grammar(agent.vocab, int(agent.vocab.ids.max()) + 1)
    res = run_episode(env, load_task("place_dirt"), 5, agent, max_steps=12)
    assert not res.interrupted and res.agent == "random"
    acted = res.records[:-1]
    assert len(acted) == res.steps and res.steps <= 12
    assert res.success or res.steps == 12
    for r in acted:
        tokens, logprobs = r.metadata["action_tokens"], r.metadata["action_logprobs"]
        assert accepts(grammar, tokens, int(r.is_gui_open))
        assert len(logprobs) == len(tokens) and all(lp <= 0.0 for lp in logprobs)
        action, _ = agent.vocab.decode(tokens)
        assert r.action["camera"] == pytest.approx([float(v) for v in action["camera"]])
        assert all(r.action[k] == action[k] for k in BINARY_KEYS)
        assert r.metadata["action_text"].startswith("<|act_")
    assert "action_tokens" not in res.records[-1].metadata


class _KillGameAt(ExpertAgent):
    """An expert that kills the game's minetest process before deciding step `at`."""

    def __init__(self, env, at: int):
        super().__init__()
        self.env, self.at, self.t = env, at, 0

    def act(self, obs, info) -> Decision:
        if self.t == self.at:
            os.kill(self.env.proc.game.pid, signal.SIGKILL)
        self.t += 1
        return super().act(obs, info)


@pytest.mark.game
def test_episode_whose_game_is_killed_is_interrupted_with_no_records(env):
    env.reset(options={"task": load_task("place_dirt")})
    starts = env.starts
    minetest_pid = env.proc.game.pid
    assert minetest_pid in env.pids()
    res = run_episode(env, load_task("place_dirt"), 0, _KillGameAt(env, at=4))
    assert res.interrupted and not res.success and res.records == []
    assert "GameCrashed" in res.error and res.steps >= 4
    assert not os.path.exists(f"/proc/{minetest_pid}") or minetest_pid not in env.pids()
    again = run_episode(env, load_task("place_dirt"), 0, ExpertAgent())  # the next reset restarts the game
    assert again.success and env.starts == starts + 1
