"""The train library end to end on the tiny variant: the loss falls, a killed run resumed from its
checkpoint continues exactly as an uninterrupted one, init_from carries a stage's weights, configs reject
unknown keys, the entry points read them."""

import dataclasses
import glob
import json
import os

import jax
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from experiments.configs import imitation, world_knowledge
from histeve_jax.data import synthetic
from histeve_jax.parallel import axes
from histeve_jax.parallel import mesh as mesh_lib
from histeve_jax.policy import Policy
from histeve_jax.train import data as data_lib
from histeve_jax.train import loop, setup
from histeve_jax.train import optimizer as optimizer_lib
from histeve_jax.train import state as state_lib
from histeve_jax.train.checkpoint import Checkpointer
from histeve_jax.train.specs import RunSpec


def _train(config, workdir):
    return loop.train(RunSpec.from_config(config, workdir))


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """Reuse compiled steps across the runs of this module (each run builds the same jitted functions)."""
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    yield
    jax.config.update("jax_compilation_cache_dir", old)


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    synthetic.write_demo_dataset(root / "train", episodes=12, length=12, seed=0)
    synthetic.write_demo_dataset(root / "eval", episodes=2, length=12, seed=1)
    return [str(root / "train")], [str(root / "eval")]


def _config(demo_dirs, **over):
    c = imitation.get_config("tiny")
    c.data.train_dirs, c.data.eval_dirs = (",".join(d) for d in demo_dirs)
    c.data.batch_size = 4
    c.num_train_steps = 24
    c.optimizer.warmup_steps = 2
    c.log_every = 1
    c.eval_every = 24
    c.eval_batches = 2
    c.checkpoint_every = 8
    c.progress_bar = False
    for k, v in over.items():
        c[k] = v
    return c


def _losses(history, steps):
    return np.array([history[s]["loss"] for s in steps])


@pytest.fixture(scope="module")
def whole_run(demo_dirs, tmp_path_factory):
    """(history, workdir) of the uninterrupted 24-step run that interrupted runs are compared with."""
    workdir = tmp_path_factory.mktemp("whole")
    return _train(_config(demo_dirs), str(workdir)), workdir


def test_killed_run_resumes_exactly_and_the_loss_falls(demo_dirs, whole_run, tmp_path, monkeypatch):
    whole, whole_dir = whole_run
    first = _train(_config(demo_dirs, stop_at_step=12), str(tmp_path / "killed"))
    # the kill lost steps 9-12 (the last checkpoint is step 8); the restart redoes them from step 8
    second = _train(_config(demo_dirs), str(tmp_path / "killed"))
    assert sorted(second) == list(range(9, 25))
    np.testing.assert_array_equal(_losses(first, range(1, 13)), _losses(whole, range(1, 13)))
    np.testing.assert_array_equal(_losses(second, range(9, 25)), _losses(whole, range(9, 25)))
    loss = _losses(whole, range(1, 25))
    assert loss[-3:].mean() < loss[:3].mean() - 1.0, loss
    assert whole[24]["eval/loss"] < loss[0] and 0 <= whole[24]["eval/acc/type"] <= 1
    assert whole[24]["data/bad_samples"] == 0 and whole[24]["data/good_samples"] == 24 * 4
    assert json.load(open(whole_dir / "config.json"))["stage"] == "imitation"
    assert glob.glob(str(whole_dir / "events.out.tfevents.*"))
    assert sorted(os.listdir(whole_dir / "checkpoints")) == ["16", "24", "8"]

    # init_from: a new stage starts from this run's final weights, with a fresh step and optimizer
    spec = RunSpec.from_config(_config(demo_dirs, init_from=str(whole_dir)), str(tmp_path / "s2"))
    stage = setup.policy_stage(spec)
    tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
    mesh = mesh_lib.mesh_from_config(spec.mesh)
    rules = axes.RULES
    fresh = Checkpointer(str(tmp_path / "stage2" / "checkpoints"), async_save=False)
    state, _, data_state = setup.build_state(spec, stage, tx, mesh, rules, fresh)
    done = Checkpointer(str(whole_dir / "checkpoints"), async_save=False)
    final, _, _ = done.restore(state)
    assert int(state.step) == 0 and data_state is None
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(final.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fresh.close()
    done.close()

    # a Hugging Face base is not even read when init_from replaces its weights
    def no_read(*a, **k):
        raise AssertionError("init_from run read the Hugging Face weights")

    monkeypatch.setattr(Policy, "from_pretrained", no_read)
    hf_stage = dataclasses.replace(stage, pretrained=lambda mesh, rules: Policy.from_pretrained())
    with Checkpointer(str(tmp_path / "stage2_hf" / "checkpoints"), async_save=False) as ck:
        state, _, _ = setup.build_state(spec, hf_stage, tx, mesh, rules, ck)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(final.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _parse(argv, default):
    fv = flags.FlagValues()
    # sys_argv: the override flags (--config.x=y) are made from the command line at definition time
    config_flags.DEFINE_config_file("config", default, flag_values=fv, lock_config=True,
                                    sys_argv=["prog", *argv])
    fv(["prog", *argv])
    return fv.config


def test_config_overrides_and_unknown_keys():
    path = os.path.join(os.path.dirname(imitation.__file__), "imitation.py")
    c = _parse(["--config.num_train_steps=50", "--config.data.image_size=(112,84)"], path + ":tiny")
    assert c.num_train_steps == 50 and c.optimizer.total_steps == 50  # the schedule follows
    assert tuple(c.data.image_size) == (112, 84)
    # the multi-slice layout launch/README.md describes is settable from the command line
    m = _parse(["--config.mesh.dcn.data=2"], path + ":tiny").mesh
    assert dict(m.dcn) == {"data": 2, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match="mesh.dcn"):
        mesh_lib.mesh_from_config(m, jax.devices()[:1])  # 1 device cannot form 2 slices
    with pytest.raises(Exception, match="no_such_key"):
        _parse(["--config.data.no_such_key=1"], path + ":tiny")
    q = _parse([], path + ":qwen7b")
    assert q.model.kind == "hf" and q.model.dtype == "bfloat16" and q.data.history == 3
    with pytest.raises(ValueError, match="unknown config variant"):
        imitation.get_config("huge")
    assert world_knowledge.get_config().data.kind == "world_knowledge"


def test_hf_variant_without_a_checkpoint_is_a_clear_error():
    c = imitation.get_config("qwen7b")
    c.model.hf_path = "/nonexistent/Qwen2.5-VL-7B"
    with pytest.raises(FileNotFoundError, match="hf_path"):
        setup.policy_config(RunSpec.from_config(c))
    # The plan needs no checkpoint: the named base gives the shape.
    assert setup.policy_config(RunSpec.from_config(c), named_base=True).base.text.hidden_size == 3584


def test_run_spec_names_a_missing_or_unknown_field():
    c = imitation.get_config("tiny")
    with c.unlocked():
        del c.data["stride"]
    with pytest.raises(ValueError, match=r"config\.data\.stride"):
        RunSpec.from_config(c)
    c = imitation.get_config("tiny")
    with c.unlocked():
        c.model.dtpye = "float32"
    with pytest.raises(ValueError, match=r"config\.model\.dtpye"):
        RunSpec.from_config(c)
    c = imitation.get_config("tiny")
    c.data.image_size = (56, "x")
    with pytest.raises(ValueError, match=r"config\.data\.image_size"):
        RunSpec.from_config(c)


def test_recorded_demos_split_holds_out_the_last_episode_of_each_task(tmp_path):
    from histeve_jax.data import records as R

    rng = np.random.default_rng(0)
    eps = [synthetic.ng_episode(rng, f"e{i}", 3, 28, 28) for i in range(5)]
    for i, ep in enumerate(eps):
        for r in ep:
            r.task_id = ("craft_planks", "place_dirt")[i % 2]
    R.write_episodes(tmp_path / "rec", eps)
    counts = data_lib.split_by_task(str(tmp_path / "rec"), str(tmp_path / "tr"), str(tmp_path / "ev"))
    assert counts == (3, 2)
    held = {r.episode_id for p in R.shard_paths(tmp_path / "ev") for r in R.read_shard(p)}
    kept = {r.episode_id for p in R.shard_paths(tmp_path / "tr") for r in R.read_shard(p)}
    assert held == {"e3", "e4"} and kept == {"e0", "e1", "e2"}


def test_unknown_config_key_on_the_command_line_names_it():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "experiments.imitation", "--config.data.no_such_key=1"],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(imitation.__file__))))
    assert out.returncode != 0
    assert "config key 'no_such_key' does not exist" in out.stderr
    assert "--config.data.no_such_key" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("stage", [imitation, world_knowledge])
@pytest.mark.parametrize("variant", ["tiny", "qwen7b"])
def test_every_variant_builds_its_optimizer_and_splits_its_batch(stage, variant):
    c = stage.get_config(variant)
    RunSpec.from_config(c)  # every field the library reads is there, and none it does not know
    optimizer_lib.make_optimizer(c.optimizer)  # raises on an invalid schedule (e.g. fewer steps than warm-up)
    assert c.optimizer.warmup_steps < c.num_train_steps
    assert c.data.batch_size % c.microbatches == 0


def test_sigterm_sets_the_preemption_flag_and_the_old_handler_comes_back():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    preempted = loop.Preemption()
    assert signal.getsignal(signal.SIGTERM) != before and not preempted.flag
    os.kill(os.getpid(), signal.SIGTERM)
    assert preempted.flag
    preempted.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_host_without_its_own_data_state_is_an_error_not_host_0s_position(tmp_path, monkeypatch):
    load = data_lib.load_host_iterator_state
    assert load(str(tmp_path), 8, {"from": "checkpoint"}) == {"from": "checkpoint"}
    monkeypatch.setattr(data_lib.jax, "process_count", lambda: 2)
    with pytest.raises(FileNotFoundError, match="process_0.json"):
        load(str(tmp_path), 8, {"from": "checkpoint"})
    data_lib.save_host_iterator_state(str(tmp_path), 8, {"from": "host"}, keep=3)
    assert load(str(tmp_path), 8, None) == {"from": "host"}


def test_eval_on_several_hosts_never_runs_out_before_eval_batches(demo_dirs, monkeypatch):
    import itertools

    spec = RunSpec.from_config(_config(demo_dirs))
    features = setup.policy_stage(spec).features
    one_pass = sum(1 for _ in data_lib.make_iterator(demo_dirs[1], spec.data, features, train=False))
    assert one_pass == 24 // 4  # 2 episodes x 12 steps, batches of 4
    monkeypatch.setattr(data_lib.jax, "process_count", lambda: 2)
    it = data_lib.make_iterator(demo_dirs[1], spec.data, features, train=False)  # 12 records, batches of 2
    assert len(list(itertools.islice(it, 10))) == 10  # more than its one pass of 6


def test_recording_without_the_game_falls_back_to_the_synthetic_data(tmp_path, monkeypatch, caplog):
    """data.generate="record" (the tiny imitation default) on a machine without minetest: no recorder
    runs, a warning says so, and the run gets exactly the data generate="synthetic" makes."""
    import logging

    from histeve_jax.data import records as R
    from histeve_jax.envs.luanti import process

    monkeypatch.setattr(process, "MINETEST_BIN", "/nonexistent/minetest")  # what HISTEVE_MINETEST sets
    assert not process.minetest_available()
    c = imitation.get_config("tiny")
    assert c.data.generate == "record" and not c.data.train_dirs
    c.synthetic.train_size, c.synthetic.eval_size, c.synthetic.length = 2, 1, 4
    with caplog.at_level(logging.WARNING):
        train, evald = data_lib.data_dirs(RunSpec.from_config(c, str(tmp_path / "rec")))
    assert "the Luanti game (minetest, Xvfb) is not installed; using synthetic data" in caplog.text
    data = tmp_path / "rec" / "data"
    assert train == [str(data / "train")] and evald == [str(data / "eval")]
    assert not os.path.exists(data / "recorded")  # the recorder never started
    c.data.generate = "synthetic"
    want = data_lib.data_dirs(RunSpec.from_config(c, str(tmp_path / "syn")))
    read = lambda dirs: [r for p in R.shard_paths(dirs[0]) for r in R.read_shard(p)]
    for got_dirs, want_dirs in zip((train, evald), want, strict=True):
        got_recs = read(got_dirs)
        assert got_recs and got_recs == read(want_dirs)


def test_without_train_dirs_the_run_generates_its_data_once(tmp_path):
    from histeve_jax.data import records as R

    c = imitation.get_config("tiny")
    c.data.generate = "synthetic"
    c.synthetic.train_size, c.synthetic.eval_size, c.synthetic.length = 2, 1, 4
    train, evald = data_lib.data_dirs(RunSpec.from_config(c, str(tmp_path)))
    assert train == [str(tmp_path / "data" / "train")] and evald == [str(tmp_path / "data" / "eval")]
    assert sum(1 for p in R.shard_paths(train[0]) for _ in R.read_shard(p)) == 2 * 4
    c.data.eval_dirs = "/given/eval"
    assert data_lib.data_dirs(RunSpec.from_config(c, str(tmp_path))) == (train, ["/given/eval"])


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sigterm_mid_run_saves_that_step_and_the_resumed_run_equals_the_whole(demo_dirs, whole_run, tmp_path):
    """The training program itself (experiments.train) gets SIGTERM after step 3: it saves the step it is at
    and exits 0; the resumed run continues from there exactly as the uninterrupted run."""
    import re
    import signal
    import subprocess
    import sys

    whole, _ = whole_run
    workdir = tmp_path / "preempted"
    over = {"data.train_dirs": demo_dirs[0][0], "data.eval_dirs": demo_dirs[1][0], "data.batch_size": 4,
            "num_train_steps": 24, "optimizer.warmup_steps": 2, "log_every": 1, "eval_every": 0,
            "checkpoint_every": 100, "progress_bar": False, "eval.enabled": False}
    config = f"--config={REPO}/experiments/configs/imitation.py:tiny"
    cmd = [sys.executable, "-m", "experiments.train", config, f"--workdir={workdir}", "--logtostderr",
           *(f"--config.{k}={v}" for k, v in over.items())]
    # The in-process runs' compilation cache: the program compiles nothing new.
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    log = []
    try:
        for line in proc.stderr:
            log.append(line)
            m = re.search(r"\] \[(\d+)\] ", line)  # clu's metrics line of a step
            if m and int(m.group(1)) >= 3:
                proc.send_signal(signal.SIGTERM)
                break
        log += proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    text = "".join(log)
    assert proc.returncode == 0, text[-3000:]
    saved = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
    assert len(saved) == 1 and 3 <= saved[0] < 24, (saved, text[-2000:])
    assert f"preempted: saved step {saved[0]}, stopping" in text
    resumed = _train(_config(demo_dirs, checkpoint_every=100), str(workdir))
    assert sorted(resumed) == list(range(saved[0] + 1, 25))
    steps = sorted(resumed)
    np.testing.assert_array_equal(_losses(resumed, steps), _losses(whole, steps))


def test_the_loop_with_microbatches_trains_as_the_full_batch(demo_dirs, whole_run, tmp_path):
    """2 microbatches of the action loss (replies of unequal length): the loop's losses are the full
    batch's (step 1 is the same parameters: only summation order differs; later steps follow)."""
    whole, _ = whole_run
    micro = _train(_config(demo_dirs, microbatches=2, stop_at_step=3, eval_every=0), str(tmp_path / "mb"))
    np.testing.assert_allclose(_losses(micro, [1]), _losses(whole, [1]), rtol=1e-6)
    np.testing.assert_allclose(_losses(micro, [2, 3]), _losses(whole, [2, 3]), rtol=1e-5)


def _final_params(spec, workdir, step=None):
    stage = setup.policy_stage(spec)
    tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
    mesh = mesh_lib.mesh_from_config(spec.mesh)
    abstract, _ = state_lib.abstract_train_state(stage.init_model, tx, mesh, axes.RULES)
    with Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False) as ck:
        return ck.restore(abstract, step=step)[0].params


def test_world_knowledge_stage_trains_and_imitation_starts_from_its_latest_weights(demo_dirs, tmp_path):
    c = world_knowledge.get_config("tiny")
    c.synthetic.train_size, c.synthetic.eval_size = 16, 4
    c.data.batch_size, c.num_train_steps, c.optimizer.warmup_steps = 4, 4, 1
    c.log_every, c.eval_every, c.checkpoint_every, c.progress_bar = 1, 0, 2, False  # eval: the demo runs
    wk_dir = str(tmp_path / "wk")
    wk = _train(c, wk_dir)
    assert sorted(wk) == [1, 2, 3, 4] and all(np.isfinite(wk[s]["loss"]) for s in wk)
    # Text answers, no action tokens (accuracies of absent token groups are not logged).
    assert "acc/other" in wk[1] and "acc/type" not in wk[1]
    assert sorted(os.listdir(os.path.join(wk_dir, "checkpoints"))) == ["2", "4"]
    # Imitation from it (the tiny run's program, compiled already): its first step is at learning rate 0
    # (the warm-up starts there), so its step-1 checkpoint holds the parameters it started from.
    im_dir = str(tmp_path / "im")
    im = _config(demo_dirs, init_from=wk_dir, checkpoint_every=1, stop_at_step=2, eval_every=0)
    hist = _train(im, im_dir)
    assert sorted(hist) == [1, 2] and hist[1]["learning_rate"] == 0.0 and hist[2]["learning_rate"] > 0
    spec = RunSpec.from_config(_config(demo_dirs), im_dir)
    got, latest, earlier = (_final_params(spec, im_dir, step=1), _final_params(spec, wk_dir),
                            _final_params(spec, wk_dir, step=2))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(latest), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(latest), jax.tree.leaves(earlier), strict=True))
