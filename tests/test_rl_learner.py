"""The learner: its log-probs are the actors' at equal weights (ratio 1: same prompt, grammar mask and
temperature), the frozen reference is the start run's params sharded like the policy with no optimizer
state, and a killed learner resumes exactly (the shared train loop with the RL stage and its stream)."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.configs import imitation
from experiments.configs.rl import get_config as rl_config
from histeve_jax.data import pipeline, synthetic
from histeve_jax.data.records import StepRecord, encode_frame
from histeve_jax.parallel import axes
from histeve_jax.parallel import mesh as mesh_lib
from histeve_jax.policy import ActionSampler, Policy, policy_processor, tiny_config
from histeve_jax.rl.driver import learner_config
from histeve_jax.rl.learner import Reference, RLBatches, make_rl_batches, rl_stage
from histeve_jax.rl.loss import sampling_log_probs
from histeve_jax.rl.order import DONE_FILE
from histeve_jax.rl.samples import RLFeaturize
from histeve_jax.rl.spec import RLSpec
from histeve_jax.rl.weights import RLPolicyServer, latest_step, load_params
from histeve_jax.train import loop, setup
from histeve_jax.train import optimizer as optimizer_lib
from histeve_jax.train import state as state_lib
from histeve_jax.train.checkpoint import Checkpointer
from histeve_jax.train.specs import RunSpec
from tests import rl_helpers


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    yield
    jax.config.update("jax_compilation_cache_dir", old)


def test_learner_log_probs_are_the_actors_at_equal_weights():
    cfg = tiny_config(history_frames=1)
    policy = Policy(cfg, rngs=nnx.Rngs(3))
    spec = pipeline.FeatureSpec(history=1, stride=4, max_len=80,
                                compact_vocab=pipeline.CompactVocab(action_base=cfg.action_token_base))
    tok, _ = pipeline.load_tokenizer_with_actions(spec)
    rng = np.random.default_rng(0)
    frames = [[rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(2)] for _ in range(4)]
    regimes = [0, 1, 0, 1]
    sampled = ActionSampler(policy).sample(
        policy_processor(cfg, tok), [(f, "mine the dirt") for f in frames], regimes, jax.random.key(1),
        id_map=spec.compact_vocab.table(len(cfg.vocab.ids)), temperature=0.7)
    feat = RLFeaturize(spec)
    rows = []
    for f, r, s in zip(frames, regimes, sampled, strict=True):
        rec = StepRecord(episode_id="e", step=1, task_id="t", kind="rl", instruction="mine the dirt",
                         frame=encode_frame(f[1], "png"), action=s.action, is_gui_open=bool(r),
                         metadata={"action_tokens": s.tokens, "action_logprobs": s.logprobs,
                                   "advantage": 0.5})
        window = {"record": {k: getattr(rec, k) for k in ("instruction", "subtask", "action", "is_gui_open",
                                                           "metadata")},
                  "frames": [encode_frame(f[0], "png"), encode_frame(f[1], "png")]}
        rows.append(feat.map(window))
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    graphdef, params = nnx.split(policy)
    # one compile for every call: the temperature is an argument, the batch keeps its shape
    log_probs = jax.jit(lambda p, b, t: sampling_log_probs(nnx.merge(graphdef, p), b, t))
    logp, _, labels, valid, order = log_probs(params, batch, 0.7)
    for i, s in enumerate(sampled):
        n = len(s.tokens)
        assert np.asarray(labels[i, :n]).tolist() == s.tokens and bool(valid[i, :n].all())
        assert not bool(valid[i, n:].any())
        np.testing.assert_allclose(np.asarray(logp[i, :n]), s.logprobs, atol=2e-4)
        behaviour = np.take_along_axis(batch["behaviour_logp"], np.asarray(order), axis=1)[i, :n]
        np.testing.assert_allclose(behaviour, s.logprobs, rtol=1e-6)
    # JPEG frames (the records' default) would not do: what the actor saw must be stored losslessly
    jpeg = feat.map(dict(window, frames=[encode_frame(f) for f in frames[-1]]))
    mixed = {k: np.concatenate([v[:-1], jpeg[k][None]]) for k, v in batch.items()}
    lp_jpeg = log_probs(params, mixed, 0.7)[0]
    n = len(sampled[-1].tokens)
    assert np.abs(np.asarray(lp_jpeg[-1, :n]) - np.asarray(sampled[-1].logprobs)).max() > 1e-3
    # at temperature 1 the same tokens have other log-probs: the temperature matters
    other = log_probs(params, batch, 1.0)[0]
    assert not np.allclose(np.asarray(other[0, : len(sampled[0].tokens)]), sampled[0].logprobs, atol=1e-3)


@pytest.fixture(scope="module")
def start_run(tmp_path_factory):
    """A tiny imitation run's workdir to start from: its config.json and a checkpoint of its initial state
    (what ``train.loop`` writes; no step is run, so nothing but the init compiles)."""
    root = tmp_path_factory.mktemp("start")
    synthetic.write_demo_dataset(root / "demos", episodes=4, length=8, seed=0)
    c = imitation.get_config("tiny")
    c.data.train_dirs = str(root / "demos")
    c.eval.enabled = False
    spec = RunSpec.from_config(c, str(root / "run"))
    tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
    mesh = mesh_lib.mesh_from_config(spec.mesh)
    state, _ = state_lib.create_train_state(setup.policy_stage(spec).init_model, tx, mesh, axes.RULES)
    os.makedirs(spec.workdir)
    with open(os.path.join(spec.workdir, "config.json"), "w") as f:
        f.write(spec.config_json())
    with Checkpointer(os.path.join(spec.workdir, "checkpoints"), async_save=False) as ck:
        ck.save(1, state, config=spec.config)
    return spec.workdir, str(root / "demos")


def _rl(tmp, start, demos):
    fields = rl_config("tiny").rl.to_dict()
    fields.update(rollout_dir=str(tmp / "rollouts"), reference=start, replay_dirs=demos, rl_rows=2,
                  replay_rows=2, poll_s=0.05, timeout_s=60.0)
    fields["loss"]["dpo_window"] = 2
    return RLSpec.from_config(fields)


def _learner(rl, start, workdir, **over):
    o = {**rl_config("tiny").learner.to_dict(), "num_train_steps": 6, "checkpoint_every": 2, "log_every": 1,
         "warmup_steps": 1, **over}
    return RunSpec.from_config(learner_config(start, o, rl, workdir))


def test_killed_learner_resumes_exactly_and_the_reference_is_frozen(start_run, tmp_path):
    start, demos = start_run
    rl = _rl(tmp_path, start, demos)
    for g in range(2):
        rl_helpers.write_group(rl.rollout_dir, rl_helpers.group("mine_dirt", g, [True, False, False]),
                               f"{g:06d}-t")
    open(os.path.join(rl.rollout_dir, DONE_FILE), "w").close()
    whole_spec = _learner(rl, start, str(tmp_path / "whole"))
    whole = loop.train(whole_spec, rl_stage(whole_spec, rl))
    killed_spec = _learner(rl, start, str(tmp_path / "killed"), stop_at_step=3)
    first = loop.train(killed_spec, rl_stage(killed_spec, rl))
    spec = _learner(rl, start, str(tmp_path / "killed"))
    second = loop.train(spec, rl_stage(spec, rl))
    assert sorted(second) == [3, 4, 5, 6]  # resumed from the step-2 checkpoint
    for s in (1, 2, 3):
        assert first[s]["loss"] == whole[s]["loss"]
    for s in (3, 4, 5, 6):
        assert second[s]["loss"] == whole[s]["loss"] and second[s]["rl/groups"] == whole[s]["rl/groups"]
    m = whole[1]
    assert m["post/kl"] == pytest.approx(0.0, abs=1e-6) and m["dpo/n_pairs"] == 1.0
    assert m["world/n_tokens"] > 0 and m["grpo/n_tokens"] > 0
    assert whole[6]["rl/max_policy_lag"] == 5.0  # the groups' weights are step 0's

    # the actors' server follows the learner: it starts with the newest step (a server restarted after a
    # crash must not act with the start run's weights); an equal step does not load again
    server = RLPolicyServer(start, str(tmp_path / "whole"))
    load_run = __import__("histeve_jax.eval.policy_agent", fromlist=["load_run"]).load_run
    start_params = [np.asarray(x) for x in jax.tree.leaves(nnx.state(load_run(start).policy, nnx.Param))]
    assert server.version() == 6 and latest_step(str(tmp_path / "whole")) == 6
    assert server.reload() == 6 and server.reload() == 6 and server.reload_errors == 0
    learned = jax.tree.leaves(load_params(str(tmp_path / "whole"), 6, server.loaded.policy))
    now = jax.tree.leaves(nnx.state(server.loaded.policy, nnx.Param))
    for a, b in zip(now, learned, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(start_params, now, strict=True))

    # the reference: the start run's params, sharded as the policy's, nothing of an optimizer
    stage = rl_stage(spec, rl)
    it = make_rl_batches(spec, stage, rl)
    assert isinstance(it, RLBatches) and isinstance(it.reference, Reference)
    ref = it.reference
    start_policy = __import__("histeve_jax.eval.policy_agent", fromlist=["load_run"]).load_run(start).policy
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(nnx.state(start_policy, nnx.Param)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not hasattr(ref, "opt_state")
    params, shardings = jax.tree.leaves(ref.params), jax.tree.leaves(ref.shardings)
    assert shardings and all(x.sharding == s for x, s in zip(params, shardings, strict=True))
    batch = next(it)
    assert batch["ref_logp"].shape == (rl.batch_size, spec.model.max_targets)
    assert batch["rl_row"].sum() == 2 and batch["replay_row"].sum() == 2 and (batch["pair"] >= 0).sum() == 4


def test_before_and_after_evaluations_render_at_the_policys_image_size(start_run, tmp_path):
    """The RL run's evaluations play the games at the start run's frame size, as its actors do (they once
    played at EvalSpec's default 56x56, which a 112x196 policy saw upscaled: 1/20 crafts where its own
    evaluation had 16/20)."""
    import json

    from histeve_jax.rl.driver import eval_spec, resolve

    start, _ = start_run
    c = rl_config("tiny")
    c.start_run, c.workdir, c.task = start, str(tmp_path / "rl"), "craft_planks"
    _, task, _, cfg = resolve(c)
    spec = eval_spec(c, start, task, str(tmp_path / "eval_before"), cfg.data.image_size)
    want = tuple(json.load(open(os.path.join(start, "config.json")))["data"]["image_size"])
    assert spec.obs_size == want != (56, 56)
    assert (spec.tasks, spec.policy, spec.max_steps, spec.episodes) == (("craft_planks",), start, 120, 20)
