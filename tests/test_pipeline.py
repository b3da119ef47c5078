"""The grain pipeline: shapes and masks, targets that decode back to the recorded actions and answers,
history windows, deterministic order, per-host sharding, exact iterator resume and bad-input accounting."""

import collections

import msgpack
import numpy as np
import pytest

from histeve_jax.actions.agent_format import discrete_to_env, env_to_discrete
from histeve_jax.data import image_processing
from histeve_jax.data import pipeline as P
from histeve_jax.data import records as R
from histeve_jax.data import synthetic as S
from histeve_jax.data.tokenizer import IM_END_ID, PAD_ID

SPEC = P.FeatureSpec(kind="demo", history=2, stride=3, image_size=(56, 56), max_len=96)
SEQ = dict(batch_size=4, shuffle=False, num_epochs=1, shard_count=1, shard_index=0)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    S.write_demo_dataset(d, episodes=4, length=7, gui_fraction=0.5, seed=3, frame_format="png",
                         records_per_shard=10)
    return d


@pytest.fixture(scope="module")
def vocab():
    return P.load_tokenizer_with_actions(SPEC)


def _all(batches):
    out = list(batches)
    return {k: np.concatenate([b[k] for b in out]) for k in out[0]}


def _records(d):
    return [r for p in R.shard_paths(d) for r in R.read_shard(p)]


def test_demo_targets_decode_to_recorded_actions(demo_dir, vocab):
    tok, av = vocab
    recs = _records(demo_dir)
    x = _all(P.make_batches(demo_dir, SPEC, P.LoaderOptions(**SEQ)))
    assert x["input_ids"].shape == (28, 96) and x["pixel_values"].shape == (28, 3 * 16, 1176)
    assert (x["image_grid_thw"] == [1, 4, 4]).all()
    for i, rec in enumerate(recs):
        m = x["loss_mask"][i] > 0
        n = int(x["attention_mask"][i].sum())
        assert x["attention_mask"][i, :n].all() and not x["attention_mask"][i, n:].any()
        assert (x["input_ids"][i, n:] == PAD_ID).all() and not m[n - 1:].any()  # nothing past the end
        np.testing.assert_array_equal(x["targets"][i, : n - 1], x["input_ids"][i, 1:n])
        target = x["targets"][i][m]
        assert target[-1] == IM_END_ID  # the reply ends with <|im_end|>, and only action tokens precede it
        action, regime = av.decode(target[:-1])
        assert int(regime) == int(rec.is_gui_open) == int(x["regime"][i])
        want = discrete_to_env(env_to_discrete(rec.action, "vpt"), "vpt")  # the codebook's quantisation
        assert {k: int(action[k]) for k in R.BINARY_KEYS} == {k: int(want[k]) for k in R.BINARY_KEYS}
        np.testing.assert_allclose(action["camera"], want["camera"])
        assert rec.instruction in tok.decode(x["input_ids"][i, :n])


@pytest.mark.parametrize("dual_mouse", [True, False])
def test_every_target_is_an_action_the_policys_grammar_can_sample(demo_dir, dual_mouse):
    """Train and serve write actions alike: each sample's target action tokens, GUI rows included, are a
    path through the sampler's grammar for the row's regime (``actions.grammar``, built from the same
    ``dual_mouse``), and decode to the recorded action. Without Dual-Mouse (the ablation's rows) no target
    holds a GUI type or cursor token; the pipeline had written them when it added the action tokens to the
    tokenizer itself, which the ablation's no-Dual-Mouse rows then could not sample (2026-12-07)."""
    import dataclasses

    from histeve_jax.actions.codebook import Regime
    from histeve_jax.actions.grammar import DONE, build_grammar, start_state
    from histeve_jax.actions.tokens import ActionVocab

    spec = dataclasses.replace(SPEC, dual_mouse=dual_mouse)
    tok, av = P.load_tokenizer_with_actions(spec)
    assert av.dual_mouse is dual_mouse
    # the sampler's slots and dual_mouse, as PolicyConfig.vocab has them
    served = ActionVocab(av.codebook, av.ids, dual_mouse)
    g = build_grammar(served, len(tok))
    allowed, nxt = np.asarray(g.allowed), np.asarray(g.next_state)
    cursor = np.concatenate(av.slots.mouse[Regime.GUI])
    gui_only = set(av.ids[[av.slots.type[Regime.GUI], *cursor[cursor >= 0]]].tolist())
    x = _all(P.make_batches(demo_dir, spec, P.LoaderOptions(**SEQ)))
    recs = _records(demo_dir)
    assert any(r.is_gui_open for r in recs) and not all(r.is_gui_open for r in recs)
    for i, rec in enumerate(recs):
        target = x["targets"][i][x["loss_mask"][i] > 0][:-1]  # the action, without <|im_end|>
        state = int(start_state(np.asarray([int(rec.is_gui_open)]))[0])
        for t in target.tolist():
            assert allowed[state, t], (rec.episode_id, rec.step, target, t)
            state = int(nxt[state, t])
        assert state == DONE
        assert dual_mouse or not gui_only & set(target.tolist()), (rec.is_gui_open, target)
        action, regime = served.decode(target)
        assert int(regime) == (int(rec.is_gui_open) if dual_mouse else 0)
        want = discrete_to_env(env_to_discrete(rec.action, "vpt"), "vpt")
        assert {k: int(action[k]) for k in R.BINARY_KEYS} == {k: int(want[k]) for k in R.BINARY_KEYS}
        np.testing.assert_allclose(action["camera"], want["camera"])


def test_history_frames_are_stride_apart_and_clamped_to_the_episode_start(demo_dir):
    recs = _records(demo_dir)
    x = _all(P.make_batches(demo_dir, SPEC, P.LoaderOptions(**SEQ)))
    for i in (0, 2, 6, 7 + 4):  # steps 0, 2, 6 of the first episode, step 4 of the second
        s = recs[i].step
        frames = [R.decode_frame(recs[i - min(k * 3, s)].frame) for k in (2, 1, 0)]
        want = image_processing.process_images(frames, SPEC.image_config)["pixel_values"]
        np.testing.assert_array_equal(x["pixel_values"][i], want)


def test_world_knowledge_targets_are_the_answer(tmp_path, vocab):
    tok, av = vocab
    S.write_world_knowledge_dataset(tmp_path, samples=6, seed=1)
    recs = _records(tmp_path)
    spec = P.FeatureSpec(kind="world_knowledge", image_size=(56, 56), max_len=96)
    x = _all(P.make_batches(tmp_path, spec, P.LoaderOptions(**{**SEQ, "batch_size": 3})))
    assert x["pixel_values"].shape == (6, 16, 1176)
    for i, rec in enumerate(recs):
        target = x["targets"][i][x["loss_mask"][i] > 0]
        assert tok.decode(target) == rec.response + "<|im_end|>"
        assert not np.isin(target, av.ids).any()  # answers are text, never action tokens


def test_shuffle_is_deterministic_by_seed(demo_dir):
    def order(seed):
        opts = P.LoaderOptions(batch_size=4, seed=seed, shard_count=1, num_epochs=1)
        b = P.make_batches(demo_dir, SPEC, opts)
        return np.concatenate([x["input_ids"] for x in b])

    a, b, c = order(1), order(1), order(2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert sorted(map(bytes, a)) == sorted(map(bytes, c))  # same samples, other order


def test_hosts_get_disjoint_shards_of_the_data(demo_dir):
    seen = []
    for host in range(2):
        opts = P.LoaderOptions(batch_size=2, seed=5, num_epochs=1, shard_index=host, shard_count=2)
        seen.append({bytes(r) for b in P.make_batches(demo_dir, SPEC, opts) for r in b["pixel_values"]
                     .reshape(2, -1)})
    assert seen[0].isdisjoint(seen[1]) and len(seen[0]) == len(seen[1]) == 14


def test_iterator_state_resumes_exactly(demo_dir):
    opts = P.LoaderOptions(batch_size=3, seed=7, shard_count=1)
    ref = P.make_batches(demo_dir, SPEC, opts)
    first = [next(ref) for _ in range(4)]
    state = ref.get_state()
    rest = [next(ref) for _ in range(12)]  # runs past the end of one epoch
    resumed = P.make_batches(demo_dir, SPEC, opts)
    resumed.set_state(state)
    assert resumed.good == 12
    for a, b in zip(rest, [next(resumed) for _ in range(12)], strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(first[0]["input_ids"], rest[0]["input_ids"])


def test_task_weights_repeat_a_tasks_records_within_an_epoch(demo_dir):
    """data.task_weights: one epoch holds every record of a weighted task that many times, the others once,
    in the sampler's shuffle; a resumed iterator goes on exactly as the first would have."""
    recs = _records(demo_dir)
    tasks = [r.task_id for r in recs]
    heavy = tasks[0]
    weights = {heavy: 3}
    plain = _all(P.make_batches(demo_dir, SPEC, P.LoaderOptions(**{**SEQ, "batch_size": 1})))
    got = _all(P.make_batches(demo_dir, SPEC, P.LoaderOptions(**{**SEQ, "batch_size": 1, "shuffle": True,
                                                                     "task_weights": weights})))
    want = collections.Counter()
    for i, t in enumerate(tasks):
        want[bytes(plain["pixel_values"][i]) + bytes(plain["input_ids"][i])] += 3 if t == heavy else 1
    seen = collections.Counter(bytes(p) + bytes(i) for p, i in zip(got["pixel_values"], got["input_ids"],
                                                                     strict=True))
    assert len(got["input_ids"]) == len(recs) + 2 * tasks.count(heavy) and seen == want

    opts = P.LoaderOptions(batch_size=3, seed=7, shard_count=1, task_weights=weights)
    ref = P.make_batches(demo_dir, SPEC, opts)
    [next(ref) for _ in range(4)]
    state = ref.get_state()
    resumed = P.make_batches(demo_dir, SPEC, opts)
    resumed.set_state(state)
    for a, b in zip([next(ref) for _ in range(5)], [next(resumed) for _ in range(5)], strict=True):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_bad_task_weights_name_the_task(demo_dir):
    tasks = sorted({r.task_id for r in _records(demo_dir)})
    with pytest.raises(ValueError, match=r"data.task_weights: 'craft_planks' is not a task of the training"
                                         r" data \(its tasks: \['approach_"):
        P.make_batches(demo_dir, SPEC, P.LoaderOptions(**SEQ, task_weights={"craft_planks": 2}))
    with pytest.raises(ValueError, match=f"data.task_weights: {tasks[0]}=0 must be a positive"):
        P.make_batches(demo_dir, SPEC, P.LoaderOptions(**SEQ, task_weights={tasks[0]: 0}))


def test_a_runs_task_weights_are_read_from_its_config():
    from experiments.configs import imitation
    from histeve_jax.train.specs import RunSpec

    c = imitation.get_config("tiny")
    assert RunSpec.from_config(c, "/tmp/unused").data.task_weights == ()
    c.data.task_weights = " craft_planks=8, place_dirt=2"
    assert RunSpec.from_config(c, "/tmp/unused").data.task_weights == (("craft_planks", 8), ("place_dirt", 2))
    for bad, why in (("craft_planks=x", "'craft_planks=x' is not task=repeats"),
                     ("craft_planks=0", "craft_planks=0: repeats must be a positive"),
                     ("craft_planks=2,craft_planks=3", "a task is named twice")):
        c.data.task_weights = bad
        with pytest.raises(ValueError, match=f"config.data.task_weights={bad!r}: {why}"):
            RunSpec.from_config(c, "/tmp/unused")


def _write_raw(path, blobs):
    from array_record.python.array_record_module import ArrayRecordWriter

    w = ArrayRecordWriter(str(path), "group_size:1")
    for b in blobs:
        w.write(b)
    w.close()


def _bad_data(tmp_path, n_good_eps=6, n_bad_pairs=1):
    """Good shards plus: one truncated shard, one record missing a field, one frame that does not decode."""
    d = tmp_path / "data"
    S.write_demo_dataset(d, episodes=n_good_eps, length=5, seed=0, records_per_shard=5)
    good = S.ng_episode(np.random.default_rng(0), "x", 2, 56, 56)
    missing = R.dataclasses.asdict(good[0])
    del missing["instruction"]
    broken = R.dataclasses.replace(good[0], episode_id="y", frame=b"\xff\xd8\xff not a jpeg")
    _write_raw(d / "zz-00000.array_record",
               [msgpack.packb(missing, use_bin_type=True), R.serialize(broken)] * n_bad_pairs)
    data = open(R.shard_paths(d)[0], "rb").read()
    (d / "zz-00001.array_record").write_bytes(data[: len(data) // 2])
    return d


def test_bad_input_is_skipped_and_counted(tmp_path):
    d = _bad_data(tmp_path)
    opts = P.LoaderOptions(batch_size=4, shuffle=False, num_epochs=1, shard_count=1, max_bad_fraction=0.2,
                           min_samples_for_check=1)
    b = P.make_batches(d, SPEC, opts)
    x = _all(b)
    assert x["input_ids"].shape[0] == 28  # 30 good records, 2 bad ones skipped, last partial batch dropped
    m = b.metrics()
    assert m["data/bad_samples"] == 2 and m["data/bad_shards"] == 1
    assert dict(b.bad) == {"record missing field": 1, "frame does not decode": 1}
    assert "truncated" in next(iter(b.bad_shards.values()))


def test_too_much_bad_input_stops_with_a_clear_message(tmp_path):
    d = _bad_data(tmp_path, n_good_eps=1, n_bad_pairs=3)  # 5 good records, then 6 bad ones
    opts = P.LoaderOptions(batch_size=2, shuffle=False, num_epochs=1, shard_count=1, max_bad_fraction=0.4,
                           min_samples_for_check=1)
    with pytest.raises(P.DataQualityError, match=r"4 of 9 samples were bad.*record missing field"):
        list(P.make_batches(d, SPEC, opts))
    with pytest.raises(P.DataQualityError, match="1 of 3 shards are unreadable"):
        P.make_batches(d, SPEC, P.LoaderOptions(shard_count=1, max_bad_fraction=0.2))


def _with_null_steps(tmp_path):
    """The synthetic demos with every third step's action made null (and one camera motion below the
    codebook's null bin, which quantises to null too)."""
    from histeve_jax.envs.base import noop_action

    src = tmp_path / "src"
    S.write_demo_dataset(src, episodes=4, length=7, gui_fraction=0.5, seed=3, frame_format="png")
    recs = _records(src)
    eps = [[r for r in recs if r.episode_id == e] for e in dict.fromkeys(r.episode_id for r in recs)]
    out = []
    for ep in eps:
        new = []
        for r in ep:
            if r.step % 3 == 0:
                a = noop_action()
                a["camera"] = np.array([0.01, -0.02], np.float32) if r.step == 3 else a["camera"]
                r = R.dataclasses.replace(r, action={k: (v.tolist() if hasattr(v, "tolist") else v)
                                                     for k, v in a.items()})
            new.append(r)
        out.append(new)
    d = tmp_path / "nulls"
    R.write_episodes(d, out)
    return d


def test_skip_null_actions_leaves_out_exactly_the_null_steps(tmp_path, vocab):
    from histeve_jax.actions import is_null_action

    _, av = vocab
    d = _with_null_steps(tmp_path)
    recs = _records(d)
    kept = [r for r in recs if not is_null_action(r.action)]
    assert 0 < len(kept) < len(recs) and all(r.step % 3 for r in kept)
    spec = P.FeatureSpec(kind="demo", history=2, stride=3, image_size=(56, 56), max_len=96,
                         skip_null_actions=True)
    x = _all(P.make_batches(d, spec, P.LoaderOptions(**{**SEQ, "batch_size": 1})))
    assert len(x["input_ids"]) == len(kept)
    for i, rec in enumerate(kept):
        target = x["targets"][i][x["loss_mask"][i] > 0]
        action, _ = av.decode(target[:-1])
        want = discrete_to_env(env_to_discrete(rec.action, "vpt"), "vpt")
        assert {k: int(action[k]) for k in R.BINARY_KEYS} == {k: int(want[k]) for k in R.BINARY_KEYS}
    # history frames still come from the null steps (only the targets are left out)
    i = next(i for i, r in enumerate(kept) if r.step == 4)
    rec4 = kept[i]
    ep = [r for r in recs if r.episode_id == rec4.episode_id]
    frames = [R.decode_frame(ep[s].frame) for s in (0, 1, 4)]
    want = image_processing.process_images(frames, spec.image_config)["pixel_values"]
    np.testing.assert_array_equal(x["pixel_values"][i], want)


def test_perturbed_steps_are_never_targets_but_stay_history(tmp_path, vocab):
    """A demonstration's perturbed steps (``Expert.aim_off``/``jolt``: subtask "perturb", or "<stage>/perturb"
    in a chain) are left out of the targets, whatever skip_null_actions says, and the steps after them still
    see their frames as history."""
    _, av = vocab
    src = tmp_path / "src"
    S.write_demo_dataset(src, episodes=3, length=7, gui_fraction=0.5, seed=4, frame_format="png")
    recs = _records(src)
    eps = [[r for r in recs if r.episode_id == e] for e in dict.fromkeys(r.episode_id for r in recs)]
    marked = {1: "perturb", 2: "logs/perturb", 5: "perturb"}  # a chain's stage-named one among them
    out = [[R.dataclasses.replace(r, subtask=marked.get(r.step, "dig")) for r in ep] for ep in eps]
    d = tmp_path / "perturbed"
    R.write_episodes(d, out)
    kept = [r for ep in out for r in ep if r.step not in marked]
    for skip_null in (False, True):
        spec = P.FeatureSpec(kind="demo", history=2, stride=1, image_size=(56, 56), max_len=96,
                             skip_null_actions=skip_null)
        x = _all(P.make_batches(d, spec, P.LoaderOptions(**{**SEQ, "batch_size": 1})))
        from histeve_jax.actions import is_null_action

        want_kept = [r for r in kept if not (skip_null and is_null_action(r.action))]
        assert len(x["input_ids"]) == len(want_kept) < sum(map(len, out))
        for i, rec in enumerate(want_kept):
            action, _ = av.decode(x["targets"][i][x["loss_mask"][i] > 0][:-1])
            want = discrete_to_env(env_to_discrete(rec.action, "vpt"), "vpt")
            assert {k: int(action[k]) for k in R.BINARY_KEYS} == {k: int(want[k]) for k in R.BINARY_KEYS}
    # step 3's history is steps 1 and 2, both perturbed: their frames, not a repeat of step 3's
    spec = P.FeatureSpec(kind="demo", history=2, stride=1, image_size=(56, 56), max_len=96)
    x = _all(P.make_batches(d, spec, P.LoaderOptions(**{**SEQ, "batch_size": 1})))
    i = next(i for i, r in enumerate(kept) if r.step == 3)
    ep = [r for r in out[0]]
    frames = [R.decode_frame(ep[s].frame) for s in (1, 2, 3)]
    np.testing.assert_array_equal(x["pixel_values"][i],
                                  image_processing.process_images(frames, spec.image_config)["pixel_values"])


def test_is_null_action_is_the_codebook_null():
    from histeve_jax.actions import is_null_action
    from histeve_jax.envs.base import noop_action

    a = noop_action()
    assert is_null_action(a)
    assert is_null_action({**a, "camera": np.array([0.01, 0.0])})  # inside the null bin
    assert not is_null_action({**a, "camera": np.array([0.0, 3.2])})
    assert not is_null_action({**a, "attack": 1}) and not is_null_action({**a, "inventory": 1})
    with pytest.raises(ValueError, match="one action at a time"):
        is_null_action({**{k: np.zeros(2, np.int64) for k in a if k != "camera"}, "camera": np.zeros((2, 2))})


def test_questions_in_a_demo_run_are_cotrained(tmp_path, vocab, demo_dir):
    """A demo run reading world-knowledge shards too: each question gets the run's frames (its own frame,
    repeated), the answer as its target, and is kept by the null-action filter (it has no action)."""
    tok, av = vocab
    wk = tmp_path / "wk"
    S.write_world_knowledge_dataset(wk, samples=3, seed=1)
    wk_recs = _records(wk)
    spec = P.FeatureSpec(kind="demo", history=2, stride=3, image_size=(56, 56), max_len=96,
                         skip_null_actions=True)
    x = _all(P.make_batches([str(demo_dir), str(wk)], spec, P.LoaderOptions(**{**SEQ, "batch_size": 1})))
    from histeve_jax.actions import is_null_action

    n_demo = sum(not is_null_action(r.action) for r in _records(demo_dir))
    assert len(x["input_ids"]) == n_demo + len(wk_recs)
    for j, rec in enumerate(wk_recs):
        i = n_demo + j
        target = x["targets"][i][x["loss_mask"][i] > 0]
        assert tok.decode(target) == rec.response + "<|im_end|>"
        assert int(x["regime"][i]) == int(rec.is_gui_open)
        frame = R.decode_frame(rec.frame)
        want = image_processing.process_images([frame] * 3, spec.image_config)["pixel_values"]
        np.testing.assert_array_equal(x["pixel_values"][i], want)
