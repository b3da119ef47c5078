"""The completion detector: pruning keeps the top channels and restricts the FFN exactly, the 3B count by
abstract evaluation, cross-attention only through the policy's states, labels and balanced queries from
records, the shared train loop with the policy frozen, the in-loop signal rule and the monitor."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
from conftest import qwen_tiny_hf
from flax import nnx
from run_helpers import filled

from experiments.configs import detector as detector_configs
from experiments.detector import loop_calibration
from histeve_jax.data import records as R
from histeve_jax.detector import data as data_lib
from histeve_jax.detector import prune
from histeve_jax.detector.config import ANCHOR_OFFSET, qwen3b_config, tiny_base, tiny_config
from histeve_jax.detector.coupled import CoupledDetector, Frozen, frame_slots
from histeve_jax.detector.inputs import QueryInputs
from histeve_jax.detector.loss import binary_metrics, calibrate_threshold
from histeve_jax.detector.model import Detector, parameter_count
from histeve_jax.detector.monitor import (
    CompletionMonitor,
    MonitorOptions,
    first_signal,
    loop_stops,
    loop_threshold,
    loop_thresholds,
)
from histeve_jax.detector.predict import load_trained
from histeve_jax.detector.stage import detector_stage
from histeve_jax.parallel import sharding
from histeve_jax.policy import Policy
from histeve_jax.policy import tiny_config as policy_tiny
from histeve_jax.train.loop import train
from histeve_jax.train.specs import RunSpec

POLICY = policy_tiny(history_frames=1)


@pytest.fixture(scope="module")
def hf_3b_style(tmp_path_factory):
    """A tiny random transformers Qwen2.5-VL (width 32, FFN 96) saved as a Hugging Face directory."""
    hf = qwen_tiny_hf(tiny_base(intermediate_size=96), seed=3)
    d = str(tmp_path_factory.mktemp("hf_3b_style"))
    hf.save_pretrained(d)
    return hf, d


@pytest.fixture(scope="module")
def pruned(hf_3b_style, tmp_path_factory):
    _, d = hf_3b_style
    det, kept = prune.prune_hf(d, tiny_config(POLICY), keep=1 / 3)
    out = str(tmp_path_factory.mktemp("pruned"))
    prune.save_detector(det, out, kept)
    return det, kept, out


@pytest.fixture(scope="module")
def coupled(pruned):
    return CoupledDetector(Policy(POLICY, rngs=nnx.Rngs(0)), pruned[0])


def test_pruning_keeps_the_top_channels_and_restricts_the_ffn_exactly(hf_3b_style, pruned):
    hf, _ = hf_3b_style
    det, kept, _ = pruned
    assert kept.shape == (4, 32) and det.config.base.text.intermediate_size == 32
    for i, layer in enumerate(hf.model.language_model.layers):
        mlp, gamma = layer.mlp, layer.post_attention_layernorm.weight.detach().double()
        gate, up, down = (getattr(mlp, f"{n}_proj").weight.detach().double() for n in ("gate", "up", "down"))
        # The score by hand from the HF tensors: ||down[:, j]|| * ||gamma * gate[j]|| * ||gamma * up[j]||.
        score = (gate * gamma).norm(dim=1) * (up * gamma).norm(dim=1) * down.norm(dim=0)
        want = np.sort(torch.topk(score, 32).indices.numpy())
        np.testing.assert_array_equal(kept[i], want)
        ours = det.language_model.layers.mlp
        hf_w = lambda n, mlp=mlp: getattr(mlp, f"{n}_proj").weight.detach().numpy().T
        np.testing.assert_array_equal(np.asarray(ours.gate[i]), hf_w("gate")[:, want])
        np.testing.assert_array_equal(np.asarray(ours.up[i]), hf_w("up")[:, want])
        np.testing.assert_array_equal(np.asarray(ours.down[i]), hf_w("down")[want])
        # The pruned FFN equals the original one with the other channels' activations zeroed.
        x = torch.randn(5, 32, dtype=torch.float64)
        h = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
        keep = torch.zeros(96, dtype=torch.float64)
        keep[want] = 1.0
        ref = (h * keep) @ down.T
        sub = jax.tree.map(lambda a, i=i: a[i], nnx.state(det.language_model.layers.mlp))
        m = nnx.merge(nnx.graphdef(det.language_model.layers.mlp), sub)
        np.testing.assert_allclose(np.asarray(m(jnp.asarray(x.numpy(), jnp.float32))), ref.numpy(), atol=2e-5)


def test_pruned_detector_roundtrips_and_copies_the_rest_of_the_decoder(hf_3b_style, pruned):
    hf, _ = hf_3b_style
    det, kept, out = pruned
    back = prune.load_detector(out)
    for a, b in zip(jax.tree.leaves(nnx.state(det, nnx.Param)), jax.tree.leaves(nnx.state(back, nnx.Param)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(prune.kept_channels(out), kept)
    np.testing.assert_array_equal(np.asarray(det.language_model.embed[...]),
                                  hf.model.language_model.embed_tokens.weight.detach().numpy())
    q = hf.model.language_model.layers[2].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(det.language_model.layers.attn.q[2]).reshape(32, 32), q.T)


def test_3b_count_by_abstract_evaluation_matches_the_hand_count():
    c = qwen3b_config()
    t, n = c.base.text, parameter_count(c)
    E, F, L, V = t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.vocab_size
    K, D = t.num_key_value_heads, t.head_dim
    layer = E * E + E + 2 * (E * K * D + K * D) + E * E + 3 * E * F + 2 * E
    assert F == 3712 and n["embedding"] == V * E and n["decoder_layers"] == L * layer
    assert n["cross_attention"] == (L // 4) * (4 * E * E + E) and n["projections"] == 2 * 3584 * E
    assert 1.4e9 < n["backbone"] < 1.5e9  # the paper's 1.4B: embedding + pruned decoder, no vision tower
    abstract = nnx.eval_shape(lambda: Detector(c, rngs=nnx.Rngs(0)))
    assert sharding.unannotated_params(nnx.state(abstract, nnx.Param)) == []


def test_cross_attention_reads_the_policy_only_through_its_blocks(pruned):
    det = pruned[0]
    assert det.config.projects and det.image_proj.shape == (64, 32) and det.context_proj.shape == (64, 32)
    rng = np.random.default_rng(0)
    base = det.config.base
    ids = np.full((2, 12), 5, np.int32)
    ids[:, 1], ids[:, 6] = base.vision_start_token_id, base.vision_end_token_id
    ids[:, 2:6] = base.image_token_id
    cfg = dataclasses.replace(det.config, history_frames=0)
    d = nnx.merge(nnx.graphdef(det), nnx.state(det))
    d.config = cfg
    mask = np.ones((2, 12), np.int32)
    img = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
    ctx = lambda s: jnp.asarray(np.random.default_rng(s).normal(size=(2, 7, 64)), jnp.float32)
    cm = jnp.ones((2, 7), bool)
    # Zero-initialised output projections: at initialisation the policy's states change nothing.
    run = lambda s: np.asarray(d(ids, mask, img, ctx(s), cm))
    np.testing.assert_array_equal(run(1), run(2))
    d.cross.o.set_value(jnp.asarray(rng.normal(size=d.cross.o.shape) * 0.1, jnp.float32))
    assert not np.allclose(run(1), run(2))
    ablation = dataclasses.replace(cfg, cross_attention_every=0)
    assert not hasattr(nnx.eval_shape(lambda: Detector(ablation, rngs=nnx.Rngs(0))), "cross")
    full, none = parameter_count(cfg), parameter_count(ablation)
    assert full["total"] - none["total"] == full["cross_attention"] + 64 * 32  # and its context projection


def test_a_mismatched_policy_is_one_line_naming_both(pruned):
    other = policy_tiny(base=tiny_base(intermediate_size=96), history_frames=1)
    with pytest.raises(ValueError) as e:
        pruned[0].config.check_policy(other)
    msg = str(e.value)
    assert "\n" not in msg and "hidden width 32" in msg and "hidden width 64" in msg and "out=32" in msg


def _step(eid, i, instruction="dig", subtask="", completed=0, kind="demo"):
    return data_lib.Step(100 + i, eid, i, "mine_dirt", kind, instruction, subtask, completed, 0)


def test_labels_from_subtask_boundaries_and_the_privileged_check():
    names = ["aim", "aim", "dig", "dig", "dig", "done"]
    steps = [_step("e", i, subtask=s, completed=int(i == 5)) for i, s in enumerate(names)]
    units = data_lib.episode_units(steps, post_window=2)
    assert [(u.instruction, u.negatives, u.positives) for u in units] == [
        ("dig", (0, 1, 2, 3, 4), (5,)), ("dig; subtask: aim", (0, 1), (2, 3)),
        ("dig; subtask: dig", (2, 3, 4), (5,))]
    failed = [_step("f", i, kind="eval") for i in range(6)]  # a policy episode that never completes
    assert [(u.negatives, u.positives) for u in data_lib.episode_units(failed)] == [(tuple(range(6)), ())]
    qs = data_lib.sample_queries({"e": steps, "f": failed}, (8, 4, 0), per_unit=2, post_window=2)
    counts = data_lib.label_counts(qs)
    assert counts["positives"] == counts["negatives"] == 4
    q = next(q for q in qs if q.episode_id == "e" and q.step == 5)
    assert q.frames == (100, 101, 105)  # offset 8 clamps to step 0; offset 4 is step 1


def test_start_jitter_clamps_each_query_at_its_own_invocation_start():
    names = ["aim"] * 20 + ["dig"] * 20 + ["done"]
    steps = [_step("e", i, subtask=s, completed=int(i == 40)) for i, s in enumerate(names)]
    draw = lambda **kw: data_lib.sample_queries({"e": steps}, (12, 8, 4, 0), per_unit=4, seed=3, **kw)
    plain, jittered = draw(), draw(start_jitter=True)
    assert draw(start_jitter=True) == jittered  # seeded
    for q in plain:  # from the first step: slot o is step max(p - o, 0)
        assert q.frames == tuple(100 + max(q.step - o, 0) for o in (12, 8, 4, 0))
    later = 0
    for q in jittered:  # from some start s <= p: slot o is step max(p - o, s), the newest the query's own
        start = q.frames[0] - 100 if q.frames[0] - 100 > q.step - 12 else 0
        assert q.frames == tuple(100 + max(q.step - o, start) for o in (12, 8, 4, 0))
        later += start > 0
    assert later >= len(jittered) // 3  # most invocations begin after the episode's first step


def _held(eid, i, dirt):
    """A step of a rollout played on past success: ``dirt`` in the inventory (a tree too, never the
    product), the check holding from the first dirt on."""
    inventory = ((("default:dirt", dirt),) if dirt else ()) + (("default:tree", 1),)
    return dataclasses.replace(_step(eid, i, completed=int(dirt >= 1)), inventory=inventory)


def test_resume_units_begin_at_each_rise_of_the_product_and_their_frames_clamp_there():
    dirt = [0, 0, 1, 1, 1, 2, 2, 3]
    steps = [_held("e", i, d) for i, d in enumerate(dirt)]
    assert data_lib.products(steps) == ("default:dirt",)
    units = data_lib.episode_units(steps, post_window=2, subtasks=False, resume=True)
    assert [(u.start, u.negatives, u.positives) for u in units] == [
        (0, (0, 1), tuple(range(2, 8))),  # the task from the episode's start
        (2, (2, 3, 4), (5, 6)), (5, (5, 6), (7,))]  # begun with 1 and with 2 held: done at the next rise
    # (none from the last rise, 7: the recording ends there, not the play)
    plain = [_step("f", i, completed=int(i >= 2)) for i in range(8)]  # no inventory in the records
    assert data_lib.episode_units(plain, resume=True) == data_lib.episode_units(plain)
    # Every negative is kept (7 against 9 positives); a resume unit's frames clamp at its own start,
    # the anchor slot (ANCHOR_OFFSET back) included.
    qs = data_lib.sample_queries({"e": steps}, (ANCHOR_OFFSET, 4, 0), per_unit=8, post_window=2,
                                 subtasks=False, resume=True)
    neg = sorted((q.step, q.frames) for q in qs if q.label == 0)
    assert neg == [(0, (100, 100, 100)), (1, (100, 100, 101)), (2, (102, 102, 102)), (3, (102, 102, 103)),
                   (4, (102, 102, 104)), (5, (105, 105, 105)), (6, (105, 105, 106))]


def test_the_anchor_slot_reads_the_invocations_first_frame_after_the_history_has_moved_on(pruned):
    config = pruned[0].config.replace(anchor=True)
    assert config.frame_offsets() == (ANCHOR_OFFSET, 12, 8, 4, 0) and config.num_frames == 5
    detector = filled(lambda: Detector(config, rngs=nnx.Rngs(0)), 5)
    coupled = CoupledDetector(Policy(POLICY, rngs=nnx.Rngs(0)), detector)
    inputs = QueryInputs(config, POLICY)
    frames = [np.full((56, 56, 3), 10 * i, np.uint8) for i in range(20)]
    monitor = CompletionMonitor(coupled, inputs, MonitorOptions(threshold=2.0, every=20))
    monitor.reset("dig the ground")
    for f in frames:
        monitor.observe(f)
    (step, p), = monitor.curve
    assert step == 19 and len(monitor._frames) == 13  # frame 0 has left the rolling history

    def batch_p(anchor):
        rows = [frames[anchor]] + [frames[19 - o] for o in (12, 8, 4, 0)]
        chosen = [rows[[ANCHOR_OFFSET, 12, 8, 4, 0].index(o)] for o in inputs.slots[0]]
        batch = {k: jnp.asarray(v)[None] for k, v in inputs(chosen, "dig the ground", 0).items()}
        return float(jax.nn.softmax(coupled.logits(batch), -1)[0, 1])

    assert p == pytest.approx(batch_p(0), abs=1e-5)
    assert abs(batch_p(0) - batch_p(7)) > 1e-4  # the slot matters: the oldest frame still held differs


def test_a_detail_crop_is_the_towers_view_of_the_crop_read_after_the_frames(pruned):
    import json

    from histeve_jax.data.image_processing import resize_image
    from histeve_jax.eval.inventory_probe import crop_frames, tower_features

    config = pruned[0].config.replace(anchor=True, detail=(28, 56, 0, 56), detail_scale=2)
    assert config.detail_size == (56, 112) and config.detail_tokens == 8
    assert config.detail_offsets() == (ANCHOR_OFFSET, 0)
    assert config.image_grids() == ((1, 4, 4),) * 5 + ((1, 4, 8),) * 2
    assert prune.config_from_dict(json.loads(json.dumps(prune.config_to_dict(config)))) == config
    for bad in ((28, 60, 0, 56), (0, 20, 0, 56)):  # outside the 56x56 frame; 40 rows, not a multiple of 28
        with pytest.raises(ValueError, match=r"DetectorConfig.detail"):
            config.replace(detail=bad)
    detector = filled(lambda: Detector(config, rngs=nnx.Rngs(0)), 5)
    coupled = CoupledDetector(Policy(POLICY, rngs=nnx.Rngs(0)), detector)
    inputs = QueryInputs(config, POLICY)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(20)]
    # The crop's embeddings are the policy's tower on the crop resized twice (the inventory probe's path).
    (crop,) = crop_frames(frames[:1], (28, 56, 0, 56), 2)
    np.testing.assert_array_equal(crop, resize_image(np.ascontiguousarray(frames[0][28:]), 56, 112))
    want = tower_features(coupled.policy, [crop])[0]
    got = coupled.frame_embeds(jnp.asarray(inputs.detail_pixels(frames[:1])), 1, detail=True)[0]
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # The prompt holds 5 frames of 4 tokens, then 2 crops of 8; pixel_values the crops' patches after.
    arrays = inputs([frames[0]] * len(inputs.slots[0]), "dig the ground", 0)
    assert int((arrays["input_ids"] == config.base.image_token_id).sum()) == 5 * 4 + 2 * 8
    assert arrays["pixel_values"].shape[0] == config.query_patches(len(inputs.slots[0])) == 5 * 16 + 2 * 32
    monitor = CompletionMonitor(coupled, inputs, MonitorOptions(threshold=2.0, every=20))
    monitor.reset("dig the ground")
    for f in frames:
        monitor.observe(f)
    (_, p), = monitor.curve

    def batch_p(query):
        rows = {ANCHOR_OFFSET: frames[0], **{o: frames[19 - o] for o in (12, 8, 4)}, 0: query}
        batch = {k: jnp.asarray(v)[None] for k, v in
                 inputs([rows[o] for o in inputs.slots[0]], "dig the ground", 0).items()}
        return float(jax.nn.softmax(coupled.logits(batch), -1)[0, 1])

    assert p == pytest.approx(batch_p(frames[19]), abs=1e-5)
    # The crops are read: the same frames with other crops' embeddings give another probability.
    embeds = jnp.stack([monitor._embeds(o) for o in monitor.offsets])[None]
    batch = {k: jnp.asarray(v)[None] for k, v in inputs.prompts("dig the ground", 0).items()}
    crops = jnp.stack([monitor._embeds(monitor.offsets[i], detail=True) for i in inputs.detail_slots])[None]
    prob = lambda c: float(jax.nn.softmax(coupled.logits_from_embeds(embeds, batch, c), -1)[0, 1])
    assert prob(crops) == pytest.approx(p, abs=1e-6) and abs(prob(crops[:, ::-1]) - p) > 1e-4
    bad = {k: jnp.asarray(v)[None] for k, v in inputs.prompts("dig the ground", 0).items()}
    bad["pixel_values"] = jnp.zeros((1, 5 * 16, 1176))
    with pytest.raises(ValueError, match=r"pixel_values has 80 patches per query.*2 detail crops have 144"):
        coupled.logits(bad)


def test_the_agents_detail_crop_grows_the_prompt_by_exactly_its_tokens_and_its_keys_reach_the_run(tmp_path):
    import json

    from experiments import agent
    from experiments.configs.agent import get_config
    from experiments.detector import template_of
    from histeve_jax.data.image_processing import parse_crop

    (tmp_path / "config.json").write_text(json.dumps({"data": {"image_size": [112, 196]}}))
    pc = policy_tiny(history_frames=1, image_size=(112, 196))
    c = get_config()
    plain = template_of(agent.detector_config(c, str(tmp_path)), pc)
    assert agent.detector_config(c, str(tmp_path)).detector.subtasks  # the expert's phases as units
    c.detector_anchor, c.detector_detail, c.detector_subtasks = True, "84,112,14,154", False
    d = agent.detector_config(c, str(tmp_path))
    assert not d.detector.subtasks
    config = template_of(d, pc)
    assert config.detail == (84, 112, 14, 154) and config.detail_size == (56, 280)
    # each image with its vision start and end tokens
    assert config.detail_tokens == 20 and config.max_len == plain.max_len + (28 + 2) + 2 * (20 + 2)
    # The same text around more images: whatever instruction fitted the plain prompt fits this one.
    text = "mine 3 dirt blocks; subtask: dig"
    a, b = (QueryInputs(x, pc).prompts(text, 0) for x in (plain, config))
    images = lambda arr, x: int((arr["input_ids"] == x.base.image_token_id).sum())
    assert images(a, plain) == 4 * 28 and images(b, config) == 5 * 28 + 2 * 20
    assert b["attention_mask"].sum() - a["attention_mask"].sum() == config.max_len - plain.max_len
    assert d.detector.harness_episodes == 0  # the harness's own invocations: off unless asked
    c.detector_harness_episodes, c.play.temperature, c.play.policy_max_steps = 6, 0.5, 900
    d = agent.detector_config(c, str(tmp_path)).detector
    assert (d.harness_episodes, d.harness_tasks, d.harness_max_steps, d.rollout_temperature) == (
        6, tuple(c.play.tasks), 900, 0.5)
    assert parse_crop("") is None
    with pytest.raises(ValueError, match=r"detector.detail='84,112,14'"):
        parse_crop("84,112,14", "detector.detail")


def test_the_loop_replays_begin_again_at_each_resume_unit(coupled, pruned, tmp_path):
    from experiments import detector as detector_exp

    dirt = [0, 0, 1, 1, 1, 2, 2, 2, 3]
    R.write_episodes(tmp_path / "val", [[R.StepRecord(
        episode_id="e", step=i, task_id="mine_dirt", kind="eval", instruction="dig the ground",
        frame=R.encode_frame(np.full((56, 56, 3), 25 * i, np.uint8)), action={"camera": [0.0, 0.0]},
        is_gui_open=False, completed=int(d >= 1), metadata={"inventory": {"default:dirt": d} if d else {}})
        for i, d in enumerate(dirt)]])
    cfg = detector_configs.get_config("tiny")
    cfg.train.data.image_size, cfg.detector.monitor_every = (56, 56), 2
    report = {"pruned_dir": pruned[2], "run_dir": str(tmp_path / "run")}
    curves = lambda: detector_exp.loop_curves(cfg, report, str(tmp_path / "val"), coupled)
    assert [(steps, done) for steps, _, done in curves()] == [([1, 3, 5, 7], 2)]
    cfg.detector.loop_resume_units = True
    got = curves()
    # from 0 (done at 2), from the rises at 2 and 5 (done 3 steps on); none from the last rise, 8
    assert [(steps, done) for steps, _, done in got] == [([1, 3, 5, 7], 2), ([1, 3, 5], 3), ([1, 3], 3)]
    monitor = CompletionMonitor(coupled, QueryInputs(coupled.config, POLICY),
                                MonitorOptions(threshold=2.0, every=2))
    monitor.reset("dig the ground")
    for i in range(5, 9):
        monitor.observe(R.decode_frame(R.encode_frame(np.full((56, 56, 3), 25 * i, np.uint8))))
    assert got[2][1] == pytest.approx([p for _, p in monitor.curve], abs=1e-6)
    assert got[2][1] != pytest.approx(got[0][1][:2], abs=1e-4)  # not the replay from the episode's start


def test_a_harness_episode_is_one_unit_per_invocation_replayed_from_its_own_start(coupled, pruned, tmp_path):
    """Records labelled by ``HarnessAgent.label_records``: each invocation is a unit on the instruction its
    executor was told, negative where its check did not hold and positive where it did, its frames clamped
    to its own first step; the loop replays each from its first step to its last, held to its atomic task;
    no unit of the episode's goal; the suite writes an episode's records as their own shard, replacing
    those of an earlier play of the same episode."""
    from experiments import detector as detector_exp
    from histeve_jax.harness.suite import write_records

    # invocations: 0 mine_log (steps 0-3, the log at 2, played on), 1 craft_planks (4-6, never done), the
    # last record (7) has no harness label (the frame after the last action)
    spans = [(0, "chop a tree", "mine_log", [0, 0, 1, 1]), (1, "craft planks", "craft_planks", [0, 0, 0])]
    labels = [dict(invocation=k, instruction=text, task=task, subtask=f"{task}()", check=c)
              for k, text, task, checks in spans for c in checks]

    def episode(eid, shift=0):
        return [R.StepRecord(
            episode_id=eid, step=i, task_id="wooden_pickaxe", kind="eval", instruction="make a pickaxe",
            frame=R.encode_frame(np.full((56, 56, 3), 25 * i + shift, np.uint8)), action={"camera": [0, 0]},
            is_gui_open=i >= 5, completed=0, metadata={"harness": labels[i]} if i < len(labels) else {})
            for i in range(8)]

    first = write_records(str(tmp_path), "policy", "wooden_pickaxe-6000", episode("old", 3))
    path = write_records(str(tmp_path), "policy", "wooden_pickaxe-6000", episode("e"))  # played again
    assert path == first and R.shard_paths(tmp_path / "records" / "policy") == [path]
    shards, episodes = data_lib.read_steps(str(tmp_path / "records" / "policy"))
    assert list(episodes) == ["e"]
    steps = episodes["e"]
    units = data_lib.episode_units(steps, post_window=2, resume=True)
    assert [(u.instruction, u.start, u.negatives, u.positives) for u in units] == [
        ("chop a tree", 0, (0, 1), (2, 3)), ("craft planks", 4, (4, 5, 6), ())]
    qs = data_lib.sample_queries(episodes, (ANCHOR_OFFSET, 2, 0), per_unit=8)
    # both positives (steps 2, 3), two of the five negatives; slots clamped to the invocation's first step
    assert sorted((q.step, q.instruction) for q in qs if q.label) == [(2, "chop a tree"), (3, "chop a tree")]
    assert len(qs) == 4
    for q in qs:
        start, text = (0, "chop a tree") if q.step < 4 else (4, "craft planks")
        assert q.instruction == text and q.frames == (start, max(q.step - 2, start), q.step), q
    cfg = detector_configs.get_config("tiny")
    cfg.train.data.image_size, cfg.detector.monitor_every = (56, 56), 2
    report = {"pruned_dir": pruned[2], "run_dir": str(tmp_path / "run")}
    got, tasks = detector_exp.loop_curves(cfg, report, str(tmp_path / "records" / "policy"), coupled,
                                          with_tasks=True)
    assert tasks == ["mine_log", "craft_planks"]
    assert [(q, done) for q, _, done in got] == [([1, 3], 2), ([1], None)]
    monitor = CompletionMonitor(coupled, QueryInputs(coupled.config, POLICY),
                                MonitorOptions(threshold=2.0, every=2))
    monitor.reset("craft planks", 0)
    for i in range(4, 7):
        monitor.observe(R.decode_frame(R.encode_frame(np.full((56, 56, 3), 25 * i, np.uint8))),
                        {"is_gui_open": i >= 5})
    assert got[1][1] == pytest.approx([p for _, p in monitor.curve], abs=1e-6)
    bad = episode("b")
    bad[1] = dataclasses.replace(bad[1], metadata={"harness": {"invocation": 0}})
    R.write_episodes(tmp_path / "bad", [bad])
    with pytest.raises(R.RecordError, match=r"episode b step 1: metadata\['harness'\] needs"):
        data_lib.read_steps(str(tmp_path / "bad"))


def test_an_invocations_unit_begins_where_the_policy_does_after_closing_a_gui_left_open():
    """The policy executor's first steps of an invocation that found the GUI open close it (record subtask
    ``<label>/close_gui``): in no unit, the unit and its replay begin at the policy's first step (as the
    detector's invocation does in the loop, ``HarnessSpec.completion_after_close``); an invocation that only
    closed it gives none."""
    def step(i, k, task, check, closing=False):
        return dataclasses.replace(
            _step("h", i, subtask=f"{task}(count=1)" + ("/close_gui" if closing else "")),
            invocation=k, invocation_instruction=task, invocation_task=task, check=check)

    steps = ([step(i, 0, "mine_log", int(i == 2)) for i in range(3)]
             + [step(i, 1, "craft_sticks", int(i == 8), closing=i < 6) for i in range(3, 9)]
             + [step(i, 2, "craft_planks", 0, closing=True) for i in range(9, 11)])
    units = data_lib.invocation_units(steps)
    assert [(u.instruction, u.start, u.negatives, u.positives) for u in units] == [
        ("mine_log", 0, (0, 1), (2,)), ("craft_sticks", 6, (6, 7), (8,))]
    assert [(r.start, r.end, r.done, r.task) for r in data_lib.replays(steps)] == [
        (0, 3, 2, "mine_log"), (6, 9, 2, "craft_sticks")]
    qs = data_lib.sample_queries({"h": steps}, (4, 0), per_unit=8)
    assert {(q.step, q.frames) for q in qs if q.instruction == "craft_sticks"} >= {(8, (106, 108))}
    assert all(q.step not in (3, 4, 5, 9, 10) for q in qs)


def test_the_privileged_check_after_k_steps_reads_1_only_once_it_has_held_longer():
    from histeve_jax.harness.controller import PrivilegedCompletion
    from histeve_jax.harness.schemas import load_schemas

    sub = load_schemas()["mine_log"].instantiate({"count": 1})
    held = [0, 1, 1, 0, 1, 1, 1, 1]
    for after, want in ((0, held), (2, [0, 0, 0, 0, 0, 0, 1, 1])):
        c = PrivilegedCompletion(after)
        c.reset(sub, {}, {"inventory": {}})
        assert [c.probability({}, {"inventory": {"default:tree": h}}) for h in held] == want
    with pytest.raises(ValueError, match="after must be >= 0"):
        PrivilegedCompletion(-1)


def test_threshold_and_binary_metrics_by_hand():
    prob, y = np.array([0.1, 0.4, 0.35, 0.8, 0.7, 0.2]), np.array([0, 0, 1, 1, 1, 0])
    m = binary_metrics(prob, y, 0.5)
    assert (m["tp"], m["fp"], m["fn"], m["tn"]) == (2, 0, 1, 3)
    assert m["precision"] == 1.0 and m["recall"] == 2 / 3 and m["fnr"] == 1 / 3 and m["fpr"] == 0.0
    # Midpoint 0.275 (between 0.2 and 0.35): tp 3, fp 1 -> F1 6/7, over 0.8 at 0.5 and 2/3 at 0.375.
    assert calibrate_threshold(prob, y) == pytest.approx(0.275)


def _episodes(directory, n):
    """Episodes in the real format: dark frames until the last, which is bright (the completion)."""
    eps = []
    for e in range(n):
        eps.append([R.StepRecord(episode_id=f"ep{e}", step=i, task_id="mine_dirt", kind="demo",
                                 instruction="dig the ground", subtask="dig" if i < 5 else "done",
                                 frame=R.encode_frame(np.full((56, 56, 3), 200 if i == 5 else 20 + e,
                                                              np.uint8)),
                                 action={"camera": [0.0, 0.0]}, is_gui_open=False, completed=int(i == 5))
                    for i in range(6)])
    R.write_episodes(directory, eps)


def test_trains_through_the_shared_loop_with_the_policy_frozen(pruned, tmp_path):
    det_cfg = pruned[0].config
    _episodes(tmp_path / "train", 3)
    cfg = detector_configs.get_config("tiny").train
    cfg.num_train_steps, cfg.eval_every, cfg.checkpoint_every, cfg.progress_bar = 3, 0, 3, False
    cfg.async_checkpoint, cfg.data.batch_size, cfg.data.train_dirs = False, 4, str(tmp_path / "train")
    cfg.optimizer.warmup_steps = 1
    spec = RunSpec.from_config(cfg, str(tmp_path / "run"))
    stage = detector_stage(spec, det_cfg, POLICY, detector_dir=pruned[2])
    before = stage.pretrained(None, None)
    history = train(spec, stage)
    assert np.isfinite(history[3]["loss"]) and history[3]["data/good_samples"] == 12
    after = load_trained(spec, stage)
    frozen = lambda m: jax.tree.leaves(nnx.state(m.policy, Frozen))
    for a, b in zip(frozen(before), frozen(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(before.detector.head[...]), np.asarray(after.detector.head[...]))
    assert {path[0] for path, _ in nnx.to_flat_state(nnx.state(after, nnx.Param))} == {"detector"}


def test_loop_stops_and_the_loop_threshold_by_hand():
    # (query steps, probabilities, first step the check holds): three episodes, by hand
    a = ([1, 3, 5, 7, 9], [0.2, 0.7, 0.8, 0.9, 0.9], 6)  # up to 0.7: stops at 5 (early); 0.8: 7; 0.9: 9
    b = ([1, 3, 5, 7], [0.1, 0.3, 0.95, 0.95], 4)  # fires at 7 up to 0.95: 3 steps after the check holds
    c = ([1, 3, 5], [0.6, 0.65, 0.1], None)  # never completes: up to 0.6 it stops (early), above never
    m = loop_stops([a, b, c], 0.6)
    assert m == {"episodes": 3, "early": 2, "missed": 0, "delays": [3]}
    m = loop_stops([a, b, c], 0.85)
    assert m == {"episodes": 3, "early": 0, "missed": 0, "delays": [3, 3]}
    assert loop_stops([a, b, c], 0.96)["missed"] == 2
    # the lowest threshold at or under the early budget: none early needs > 0.7 (a) and > 0.6 (c): 0.8
    assert loop_threshold([a, b, c], max_early=0.0) == 0.8
    assert loop_threshold([a, b, c], max_early=0.34) == 0.65  # one early allowed: c still stops at 0.6
    assert loop_threshold([c], max_early=0.0) == 0.65  # 0.6 stops it at 3; at 0.65 one query is not two
    d = ([1, 3], [0.9, 0.9], None)
    assert loop_threshold([d], max_early=0.0) > 0.9  # only never firing keeps d whole
    assert loop_threshold([a, b, c], rule="balanced") == 0.8  # none early, none missed
    # A trade: f never completes (0.85 twice), g twice completes at 3 (0.8 from 5 on). No early stop means
    # never firing, g missed twice; "balanced" takes one early (f) for two on time, at the lowest threshold
    # that costs that: at 0.1, g's two 0.1 queries fire at step 3, as its check holds.
    f = ([1, 3, 5, 7], [0.85, 0.85, 0.5, 0.5], None)
    g = ([1, 3, 5, 7], [0.1, 0.1, 0.8, 0.8], 3)
    assert loop_threshold([f, g, g], max_early=0.0) > 0.85
    assert loop_stops([f, g, g], 0.86)["missed"] == 2
    assert loop_threshold([f, g, g], rule="balanced") == 0.1
    assert loop_stops([f, g, g], 0.1) == {"episodes": 3, "early": 1, "missed": 0, "delays": [0, 0]}
    assert loop_threshold([f, g, g], rule="balanced", early_cost=3.0) > 0.85  # an early stop dearer
    with pytest.raises(ValueError, match="rule 'fewest'"):
        loop_threshold([f], rule="fewest")
    # Per task: "dig" is a, b and c as above (0.8 keeps all three whole); "chop" is g alone, whose lowest
    # threshold with no early stop is its first query's 0.1 (on time at 3). One threshold for all four must
    # hold a, b, c whole (0.8: a 1 step late, b 3), and then g stops at 7, 4 steps late.
    curves, tasks = [a, b, c, g], ["dig", "dig", "dig", "chop"]
    assert loop_thresholds(curves, tasks, max_early=0.0) == {"chop": 0.1, "dig": 0.8}
    assert loop_threshold(curves, max_early=0.0) == 0.8 and loop_stops(curves, 0.8)["delays"] == [1, 3, 4]
    with pytest.raises(ValueError, match="4 curves, 3 task names"):
        loop_thresholds(curves, tasks[:3])
    # The report's loop fields (experiments.detector.loop_calibration): how the replays end at the
    # thresholds the harness will use, in all and by task.
    d = ml_collections.ConfigDict({"consecutive": 2, "max_early": 0.0, "loop_rule": "max_early",
                                   "early_cost": 1.0, "per_task_thresholds": True})
    cal = loop_calibration(curves, tasks, d)
    assert cal["loop_threshold"] == 0.8 and cal["loop_thresholds"] == {"chop": 0.1, "dig": 0.8}
    assert cal["loop_validation"] == {"episodes": 4, "early": 0, "missed": 0, "on_time": 3,
                                      "mean_delay": pytest.approx(4 / 3)}
    assert cal["loop_validation_by_task"]["chop"] == {"episodes": 1, "early": 0, "missed": 0, "on_time": 1,
                                                      "mean_delay": 0.0}
    d.per_task_thresholds = False
    cal = loop_calibration(curves, tasks, d)
    assert "loop_thresholds" not in cal and cal["loop_validation_by_task"]["chop"]["mean_delay"] == 4.0
    assert cal["loop_validation"]["mean_delay"] == pytest.approx(8 / 3)


def test_signal_on_two_consecutive_queries_or_the_budget(coupled):
    assert first_signal([0.9, 0.2, 0.8, 0.7, 0.9], 0.6) == 3
    assert first_signal([0.9, 0.2, 0.9], 0.6) is None
    assert first_signal([0.7], 0.6, consecutive=1) == 0
    inputs = QueryInputs(coupled.config, POLICY)
    assert inputs.slots == frame_slots(coupled.config, POLICY.num_frames)
    frames = [np.full((56, 56, 3), 10 * i, np.uint8) for i in range(8)]
    fire = CompletionMonitor(coupled, inputs, MonitorOptions(threshold=0.0, every=2))
    fire.reset("dig the ground")
    out = [fire.observe(f) for f in frames]
    assert [m.step for m in out if m.probability is not None][:2] == [1, 3]
    assert out[3].stop and out[3].reason == "detector" and not out[2].stop and len(fire.curve) == 2
    never = CompletionMonitor(coupled, inputs, MonitorOptions(threshold=1.01, every=2, budget=6))
    never.reset("dig the ground")
    out = [never.observe(f) for f in frames]
    assert out[5].stop and out[5].reason == "budget" and not any(m.stop for m in out[:5])
    # The monitor's probability is the batch path's on the same frames.
    p = fire.curve[0][1]
    batch = {k: jnp.asarray(v)[None] for k, v in inputs([frames[max(1 - o, 0)] for o in inputs.slots[0]],
                                                         "dig the ground", 0).items()}
    ref = jax.nn.softmax(coupled.logits(batch), -1)[0, 1]
    assert p == pytest.approx(float(ref), abs=1e-5)
