"""The exported Hugging Face directory against the JAX policy it came from: it loads offline through the auto
classes, its logits equal ours in NG, GUI and mixed batches, its PyTorch act picks our greedy actions, the
tokenizer keeps every action token id, the export's memory stays bounded, and bad input is refused
without leaving anything under the output's name."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from experiments.configs import imitation
from histeve_jax.actions.codebook import Regime
from histeve_jax.data import synthetic
from histeve_jax.eval.policy_agent import load_run
from histeve_jax.export import ExportError, action_tables, export_policy
from histeve_jax.export.__main__ import main as export_main
from histeve_jax.train import loop
from histeve_jax.train.specs import RunSpec

STEPS = 4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny policy trained for a few steps on synthetic demonstrations: a real run's workdir."""
    root = tmp_path_factory.mktemp("export_run")
    synthetic.write_demo_dataset(root / "demos", episodes=4, length=12, seed=0)
    c = imitation.get_config("tiny")
    c.data.train_dirs, c.data.eval_dirs = str(root / "demos"), ""
    # 56x56 frames: at the main job's 112x196 the random tiny model's greedy actions barely vary (3 distinct
    # over 100 observations, none a click), and the comparison below would test little
    c.data.image_size, c.data.max_len = (56, 56), 80
    c.data.batch_size = 4
    c.num_train_steps, c.checkpoint_every = STEPS, STEPS
    c.optimizer.warmup_steps = 1
    c.log_every, c.eval_every, c.eval_batches = STEPS, 0, 0
    c.progress_bar = False
    loop.train(RunSpec.from_config(c, str(root / "run")))
    return str(root / "run")


@pytest.fixture(scope="module")
def loaded(run_dir):
    """The run's policy with distinct RS-Norm rows and random action rows in lm_head, so the regime changes
    the logits and greedy actions vary (a few steps from init, both rows are still almost equal)."""
    lp = load_run(run_dir)
    m = lp.policy.model
    rng = np.random.default_rng(0)
    for norm in (m.language_model.layers.input_norm, m.language_model.layers.post_attn_norm):
        norm.scale.set_value(jnp.asarray(1 + 0.5 * rng.standard_normal(norm.scale.shape), jnp.float32))
    w = np.asarray(m.lm_head[...]).copy()
    ids = lp.config.vocab.ids
    w[:, ids] = rng.standard_normal((w.shape[0], len(ids)))
    m.lm_head.set_value(jnp.asarray(w))
    return lp


@pytest.fixture(scope="module")
def exported(loaded, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("exported") / "policy")
    export_policy(loaded.policy, loaded.processor.tokenizer, out, frame_format=loaded.frame_format,
                  jpeg_quality=loaded.jpeg_quality, id_map=loaded.id_map, stride=loaded.stride,
                  max_shard_size="200KB", source={"run": loaded.workdir, "step": loaded.step})
    return out


def _actor_module(path):
    spec = importlib.util.spec_from_file_location(f"histeve_action_{abs(hash(path))}",
                                                  os.path.join(path, "histeve_action.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def actor(exported):
    return _actor_module(exported).HiSteveActor(exported)


def _observations(n, seed):
    rng = np.random.default_rng(seed)
    words = ["chop", "the", "tree", "mine", "stone", "open", "inventory", "craft", "planks", "jump"]
    obs = []
    for _ in range(n):
        h, w = (int(s) for s in rng.integers(40, 90, 2))  # resized to the policy's 56x56 by both sides
        # blocks of random colour (JPEG keeps them; it would smooth pixel noise to near grey, and a random
        # tiny model's actions would hardly vary)
        frames = [np.kron(rng.integers(0, 256, (-(-h // 8), -(-w // 8), 3)), np.ones((8, 8, 1)))[:h, :w]
                  .astype(np.uint8) for _ in range(2)]
        obs.append((frames, " ".join(rng.choice(words, int(rng.integers(1, 6))))))
    return obs, rng.integers(0, 2, n).tolist()


def test_directory_loads_offline_through_the_auto_classes_with_both_rs_norm_rows(exported, loaded):
    cfg = json.load(open(os.path.join(exported, "config.json")))
    auto = cfg["auto_map"]
    assert auto["AutoModelForImageTextToText"] == "modeling_histeve.HiSteveForConditionalGeneration"
    assert auto["AutoConfig"] == "modeling_histeve.HiSteveConfig"
    assert cfg["norm_regimes"] == 2 and cfg["histeve"]["source"]["step"] == STEPS
    index = json.load(open(os.path.join(exported, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1  # sharded
    model = AutoModelForImageTextToText.from_pretrained(exported, trust_remote_code=True)
    assert type(model).__name__ == "HiSteveForConditionalGeneration"
    ours = loaded.policy.model.language_model.layers
    for i, layer in enumerate(model.model.language_model.layers):
        for theirs, mine in ((layer.input_layernorm, ours.input_norm), (layer.post_attention_layernorm,
                                                                          ours.post_attn_norm)):
            np.testing.assert_array_equal(theirs.weight.detach().numpy(), np.asarray(mine.scale[...])[i])
    assert AutoTokenizer.from_pretrained(exported, trust_remote_code=True).convert_tokens_to_ids(
        "<|act_end|>") == loaded.processor.tokenizer.convert_tokens_to_ids("<|act_end|>")
    assert AutoImageProcessor.from_pretrained(exported, trust_remote_code=True).merge_size == 2


@pytest.mark.parametrize("regimes", [[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], ids=["NG", "GUI", "mixed"])
def test_logits_match_ours(regimes, loaded, actor):
    obs, _ = _observations(4, seed=1)
    inp = loaded.inputs(obs)
    ours = np.asarray(loaded.policy.model(
        jnp.asarray(inp["input_ids"]), attention_mask=jnp.asarray(inp["attention_mask"]),
        pixel_values=jnp.asarray(inp["pixel_values"]), image_grid_thw=loaded.config.image_grid(2 * len(obs)),
        regime=jnp.asarray(regimes, jnp.int32)))
    t_inp = actor.inputs(obs)
    with torch.no_grad():
        theirs = actor.model(**t_inp, regime=torch.tensor(regimes)).logits.numpy()
    real = t_inp["attention_mask"].numpy() == 1  # both are left-padded: align on the prompt's end
    ours = ours[:, -theirs.shape[1]:]
    ids = inp["input_ids"][:, -theirs.shape[1]:]
    np.testing.assert_array_equal(ids[real], t_inp["input_ids"].numpy()[real])
    err = np.abs(ours - theirs)[real].max() / np.abs(ours[real]).max()
    assert err < 1e-4, err
    with torch.no_grad():  # the regime matters: the other row gives other logits
        other = actor.model(**t_inp, regime=1 - torch.tensor(regimes)).logits.numpy()
    assert np.abs(other - theirs)[real].max() > 100 * np.abs(ours - theirs)[real].max()


def test_the_actor_sees_each_frame_through_the_runs_codec(exported, loaded, actor):
    """A JPEG-trained run acts on each frame's JPEG round trip (``LoadedPolicy.through_codec``); the export
    records that codec and its actor applies it, so raw frames give the inputs ours give."""
    table = json.load(open(os.path.join(exported, action_tables.ACTIONS_FILE)))
    assert loaded.frame_format == "jpeg"
    assert table["observation"]["frame_codec"] == {"format": "jpeg", "quality": loaded.jpeg_quality}
    obs, _ = _observations(3, seed=4)
    for frames, _text in obs:
        for f in frames:
            np.testing.assert_array_equal(actor.through_codec(f), loaded.through_codec(f))
            assert not np.array_equal(actor.through_codec(f), f)  # it does change the frame
    ours = loaded.inputs(obs)["pixel_values"]
    theirs = actor.inputs(obs)["pixel_values"].numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-6)
    with pytest.raises(ExportError, match="frame_format='webp'"):
        export_policy(loaded.policy, loaded.processor.tokenizer, str(exported) + "-webp", frame_format="webp")
    assert not os.path.exists(str(exported) + "-webp")


def test_the_actors_frame_history_is_the_runs_layout(exported, loaded, tmp_path):
    """The directory records whether the run's history stays within a GUI-open or closed run
    (``data.history_in_regime``); the actor's ``frame_history()`` then gives the windows ours gives."""
    import dataclasses

    table = json.load(open(os.path.join(exported, action_tables.ACTIONS_FILE)))
    assert table["observation"]["history_in_regime"] is False
    out = str(tmp_path / "in_regime")
    export_policy(loaded.policy, loaded.processor.tokenizer, out, frame_format=loaded.frame_format,
                  jpeg_quality=loaded.jpeg_quality, id_map=loaded.id_map, stride=2, history_in_regime=True)
    actor = _actor_module(out).HiSteveActor(out)
    assert actor.history_in_regime and actor.stride == 2
    ours = dataclasses.replace(loaded, stride=2, history_in_regime=True).layout.frame_history()
    theirs = actor.frame_history()
    frames = [np.full((8, 8, 3), i, np.uint8) for i in range(12)]
    regimes = [0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    for f, r in zip(frames, regimes, strict=True):
        a, b = ours.push(f, r), theirs.push(f, r)
        assert [int(x[0, 0, 0]) for x in a] == [int(x[0, 0, 0]) for x in b]
    assert loaded.history == 1
    assert [int(x[0, 0, 0]) for x in ours.push(frames[0], 0)] == [10, 0]  # 2 back, within the run
    assert [int(x[0, 0, 0]) for x in theirs.push(frames[0], 1)] == [0, 0]  # the GUI opened: itself


def test_greedy_actions_equal_ours_for_100_observations(loaded, actor):
    obs, regimes = _observations(100, seed=2)
    ours = loaded.sample(obs, regimes, jax.random.key(0), greedy=True)
    tokens = actor.act_tokens(obs, regimes)
    theirs = actor.act(obs, regimes)
    for i, (a, t, b) in enumerate(zip(ours, tokens, theirs, strict=True)):
        assert t[: len(a.tokens)].tolist() == a.tokens, i
        assert set(b) == set(a.action) and int(a.regime) == regimes[i], i
        for k, v in a.action.items():
            np.testing.assert_array_equal(b[k], v, err_msg=f"observation {i} key {k}")
    distinct = {json.dumps({k: np.asarray(v).tolist() for k, v in b.items()}) for b in theirs}
    # A random tiny model's hidden states vary little between observations: a handful of distinct actions
    assert len(distinct) >= 4, len(distinct)
    assert any(b["camera"].any() for b in theirs) and any(b["attack"] or b["use"] for b in theirs)


def test_tokenizer_round_trip_keeps_every_action_token_id(exported, loaded):
    ref = loaded.processor.tokenizer
    tok = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    table = json.load(open(os.path.join(exported, action_tables.ACTIONS_FILE)))
    strings = [t["string"] for t in table["tokens"]]
    ids = tok.convert_tokens_to_ids(strings)
    assert ids == ref.convert_tokens_to_ids(strings) == [t["tokenizer_id"] for t in table["tokens"]]
    assert tok.encode("".join(strings), add_special_tokens=False) == ids  # each is one unsplit token
    assert tok.decode(ids) == "".join(strings)
    id_map = np.load(os.path.join(exported, table["id_map"]))
    model_ids = [t["model_id"] for t in table["tokens"]]
    assert id_map[ids].tolist() == loaded.config.vocab.ids.tolist() == model_ids
    assert tok.chat_template == ref.chat_template


def test_decode_port_matches_ours(exported, loaded):
    mod = _actor_module(exported)
    table = json.load(open(os.path.join(exported, action_tables.ACTIONS_FILE)))
    vocab = loaded.config.vocab
    rng = np.random.default_rng(3)
    keys = [k for k in table["env_keys"] if k != "camera"]
    for i in range(200):
        env = {k: int(rng.random() < 0.15) for k in keys}
        env["inventory"] = int(rng.random() < 0.05)
        env["camera"] = rng.uniform(-12, 12, 2) * (rng.random(2) < 0.6)
        ids = vocab.encode(env, Regime(i % 2))
        want, regime = vocab.decode(ids)
        got, got_regime = mod.decode_action(table, ids)
        assert got_regime == int(regime) and set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{ids} {k}")
    with pytest.raises(ValueError, match="out of order or repeated"):
        mod.decode_action(table, vocab.encode({"attack": 1, "camera": [0, 0]}, 0)[[0, 1, 1, 2]])


def test_cli_exports_a_run_and_refuses_a_non_empty_out(run_dir, tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert export_main([f"--run={run_dir}", f"--out={out}", "--dtype=bfloat16"]) == 0
    model = AutoModelForImageTextToText.from_pretrained(out, trust_remote_code=True)
    assert model.dtype == torch.bfloat16
    before = sorted(os.listdir(out))
    capsys.readouterr()  # drop transformers' loading progress
    assert export_main([f"--run={run_dir}", f"--out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and out in err and "not empty" in err and "--overwrite" in err
    assert sorted(os.listdir(out)) == before
    assert export_main([f"--run={run_dir}", f"--out={out}", f"--step={STEPS}", "--overwrite"]) == 0
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "float32"
    assert sorted(os.listdir(tmp_path)) == ["cli"]  # no temporary or moved-aside directory left


def _leftovers(parent, name):
    return [p for p in os.listdir(parent) if p.startswith(name)]


def test_bad_runs_are_one_line_naming_them_and_leave_nothing(run_dir, tmp_path, capsys):
    empty = tmp_path / "no_ckpt"
    empty.mkdir()
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    json.dump(config, open(empty / "config.json", "w"))
    assert export_main([f"--run={empty}", f"--out={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(empty) in err and "no checkpoint" in err

    # a checkpoint whose tree is not its config's: the codebook changes the vocabulary's rows
    bad = tmp_path / "mismatch"
    bad.mkdir()
    os.symlink(os.path.join(run_dir, "checkpoints"), bad / "checkpoints")
    config["data"]["codebook"] = "openha"
    json.dump(config, open(bad / "config.json", "w"))
    assert export_main([f"--run={bad}", f"--out={tmp_path / 'b'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err and "does not match" in err
    assert _leftovers(tmp_path, "a") == [] and _leftovers(tmp_path, "b") == []


def test_a_failure_while_writing_leaves_nothing_under_the_final_name(loaded, tmp_path):
    with pytest.raises(ValueError):  # fails inside the write (the shard size is parsed there)
        export_policy(loaded.policy, loaded.processor.tokenizer, str(tmp_path / "c"), frame_format="jpeg",
                      id_map=loaded.id_map, max_shard_size="12 parsecs")
    assert _leftovers(tmp_path, "c") == []


_MEMORY_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import jax
    import numpy as np
    from flax import nnx
    from transformers import Qwen2VLImageProcessorPil  # noqa: F401 - the export imports it: not its memory
    from histeve_jax.data.pipeline import CompactVocab, FeatureSpec, load_tokenizer_with_actions
    from histeve_jax.export import export_policy
    from histeve_jax.models.qwen2_5_vl import tiny
    from histeve_jax.policy import Policy, tiny_config

    def status(key):  # bytes, from /proc/self/status (kB there)
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

    tok, _ = load_tokenizer_with_actions(FeatureSpec())
    base = tiny().replace(
        text={"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4, "mrope_section": (16, 24, 24)},
        vision={"out_hidden_size": 1024})
    jax.random.normal(jax.random.key(0), (8,)).block_until_ready()  # the CPU client exists before it
    gc.collect()
    before = status("VmRSS:")
    # Parameters placed one by one, as a restore places them (a whole-model random init would leave its
    # temporaries in the allocator and blur the baseline).
    policy = nnx.eval_shape(lambda: Policy(tiny_config(base=base), rngs=nnx.Rngs(0)))
    params = nnx.to_flat_state(nnx.state(policy, nnx.Param))
    for i, (_, var) in enumerate(params):
        var.set_value(jax.device_put(np.random.default_rng(i).random(var.shape, np.float32)))
    model_bytes = sum(int(np.prod(v.shape)) * 4 for _, v in params)
    gc.collect()
    loaded = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS (VmHWM) := current RSS
    export_policy(policy, tok, sys.argv[1], frame_format="png", id_map=CompactVocab().table(63),
                  max_shard_size="64MB")
    print(json.dumps({"model_bytes": model_bytes, "before": before, "loaded": loaded,
                      "peak": status("VmHWM:")}))
""")


def test_export_memory_stays_within_one_model_plus_a_tensor(tmp_path):
    """Peak RSS of exporting a ~300 MB model (8 wide layers), in a fresh process: below 1.5 model sizes over
    the process before the model, and well under one model over the loaded model (never held twice)."""
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path / "wide")], capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    size = m["model_bytes"]
    assert size > 250e6
    written = sum(os.path.getsize(tmp_path / "wide" / f) for f in os.listdir(tmp_path / "wide")
                  if f.endswith(".safetensors"))
    assert abs(written - size) < 0.01 * size
    print(f"model {size / 1e6:.0f} MB: export peak {(m['peak'] - m['loaded']) / 1e6:.0f} MB over the loaded "
          f"model, {(m['peak'] - m['before']) / 1e6:.0f} MB over the process before the model")
    assert m["peak"] - m["before"] < 1.5 * size
    assert m["peak"] - m["loaded"] < 0.5 * size
