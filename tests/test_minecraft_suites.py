"""The Minecraft suites' parts that run without Minecraft: task files, the reward rule, the summary, the
episode's records and report, and the entry point's first line (the judge: test_minecraft_judge.py).

Oracles: MineStudio's own loader (``minestudio.benchmark.utility.read_conf.convert_yaml_to_callbacks``) and
its real ``RewardsCallback`` (loaded from the installed package's file; the simulator package itself needs
cv2, absent here); MineStudio's InitInventoryCallback slot mapping by hand; hand-counted summaries. The
runners' game loop is ``run_episode`` on ``MineStudioEnv``; it has not run here (no Minecraft engine, no
Java 8).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from minecraft_suite_helpers import BENCH, CRITERIA, episode_result, raw_info, recorded_frames

from histeve_jax.envs.minestudio import info_from_sim
from histeve_jax.envs.tasks import TaskError
from histeve_jax.eval.rollout import Decision, EpisodeResult, step_record
from histeve_jax.eval.suites import minecraft_tasks as mt
from histeve_jax.eval.suites import vlm_judge as vj
from histeve_jax.eval.suites.minecraft import (
    SuiteEpisode,
    SuiteSpec,
    episode_verdict,
    finish_episode,
    format_table,
    resolve_tasks,
    summarize,
)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- task files


def test_every_installed_bench_yaml_parses_like_minestudio():
    from minestudio.benchmark.utility.read_conf import convert_yaml_to_callbacks

    counts = {}
    for split in mt.SPLITS:
        files = sorted((BENCH / "task_configs" / split).glob("*.yaml"))
        names = mt.list_bench_tasks(split)
        assert names == [f.stem for f in files] and names
        counts[split] = len(names)
        for f in files:
            task = mt.load_bench_task(f"{split}/{f.stem}")
            commands, meta = convert_yaml_to_callbacks(str(f))
            assert (task.name, task.split, task.key) == (meta["name"], split, f"{split}/{f.stem}")
            assert task.text and task.text.split() == meta["text"].split()
            assert list(task.commands) == commands
            assert task.max_steps == mt.BENCH_MAX_STEPS and not task.rewards and not task.is_success({})
    if importlib.metadata.version("minestudio") == "1.1.6":  # the version these counts were taken from
        assert counts == {"simple": 76, "hard": 77}


def test_bench_names_in_both_splits_need_the_split():
    with pytest.raises(TaskError, match=r"both splits; say simple/build_gate or hard/build_gate"):
        mt.load_bench_task("build_gate")
    only_hard = sorted({p.stem for p in (BENCH / "task_configs/hard").glob("*.yaml")}
                       - {p.stem for p in (BENCH / "task_configs/simple").glob("*.yaml")})
    assert mt.load_bench_task(only_hard[0]).key == f"hard/{only_hard[0]}"
    with pytest.raises(TaskError, match="neither split"):
        mt.load_bench_task("no_such_task")
    with pytest.raises(TaskError, match="unknown MineStudio Bench split 'medium'"):
        mt.list_bench_tasks("medium")


def test_openha_tasks_translate_minestudio_callbacks_to_commands():
    for name in mt.list_openha_tasks():
        t = mt.load_openha_task(name)
        assert t.rewards and t.max_steps == mt.OPENHA_MAX_STEPS == 400 and t.key == f"openha/{name}"
    d = {"text": "t", "init_inventory": [{"slot": s, "type": "minecraft:stone", "quantity": 3}
                                         for s in (0, 5, 9, 35, 36, 38, 40)],
         "commands": ["/time set day"], "summon_mobs": [{"mob_name": "cow", "number": 2, "range_x": [-1, 1],
                                                          "range_z": [2, 2]}],
         "rewards": [{"event": "pickup", "identity": "i", "objects": ["beef"], "reward": 1,
                      "max_reward_times": 1}], "maximum_steps": 50}
    t = mt.task_from_dict(d, "x", source="x.yaml")
    # MineStudio's InitInventoryCallback slot mapping, by hand: 0 and 40 are the hands, 36-39 armour
    slots = ["weapon.mainhand", "hotbar.5", "inventory.0", "inventory.26", "armor.feet", "armor.chest",
             "weapon.offhand"]
    assert list(t.commands) == [f"/replaceitem entity @p {s} minecraft:stone 3" for s in slots] + \
        ["/time set day"]
    assert t.max_steps == 50
    a, b = t.for_seed(7), t.for_seed(7)
    assert a.commands == b.commands != t.for_seed(8).commands and a.commands[:8] == t.commands
    summons = a.commands[8:]
    assert len(summons) == 2
    for c in summons:  # SummonMobsCallback's command, positions inside the ranges
        words = c.split()
        assert words[:8] == ["/execute", "as", "@p", "at", "@p", "run", "summon", "minecraft:cow"]
        assert -1 <= float(words[8][1:]) <= 1 and words[9] == "~3" and float(words[10][1:]) == 2.0


@pytest.mark.parametrize("patch, where", [
    ({"colour": 1}, r"x\.yaml\.colour: unknown key"),
    ({"text": " "}, r"x\.yaml\.text: missing or empty"),
    ({"custom_init_commands": ["give @s dirt"]}, r"custom_init_commands\[0\]: chat commands start with '/'"),
    ({"init_inventory": [{"slot": "random", "type": "dirt", "quantity": 1}]}, r"init_inventory\[0\]\.slot"),
    ({"init_inventory": [{"slot": 1, "type": "dirt", "quantity": ">2"}]}, r"init_inventory\[0\]\.quantity"),
    ({"summon_mobs": [{"name": "cow", "number": 0, "range_x": [0, 1], "range_z": [0, 1]}]},
     r"summon_mobs\[0\]\.number"),
    ({"reward_cfg": [{"event": "kill_entity", "identity": "k", "objects": ["cow"], "reward": 1,
                      "max_reward_times": 1}]}, r"reward_cfg\[0\]\.event: 'kill_entity' is not an event"),
    ({"reward_cfg": [{"event": "mine_block", "objects": ["dirt"], "reward": 1}]},
     r"reward_cfg\[0\]: a reward event has exactly the keys"),
    ({"reward_cfg": [{"event": "mine_block", "identity": "m", "objects": ["dirt"], "reward": -1,
                      "max_reward_times": 1}]}, r"reward_cfg\[0\]\.reward: must be a number >= 0"),
    ({"reward_cfg": [], "rewards": []}, r"both 'reward_cfg' and 'rewards'"),
])
def test_bad_task_files_name_the_file_and_key(patch, where):
    with pytest.raises(TaskError, match=where):
        mt.task_from_dict({"text": "t", **patch}, "x", source="x.yaml")


def test_an_openha_task_without_reward_events_is_refused(tmp_path):
    p = tmp_path / "plain.yaml"
    p.write_text(yaml.safe_dump({"text": "walk"}))
    with pytest.raises(TaskError, match=r"plain\.yaml\.reward_cfg: missing"):
        mt.load_openha_task(str(p))
    with pytest.raises(TaskError, match="no OpenHA-style task 'nope'"):
        mt.load_openha_task("nope")
    (tmp_path / "bad.yaml").write_text("text: [unclosed")
    with pytest.raises(TaskError, match=r"bad\.yaml: not valid YAML"):
        mt.load_openha_task(str(tmp_path / "bad.yaml"))


def test_resolve_tasks_expands_splits_and_applies_max_steps():
    spec = SuiteSpec("minestudio_bench", tasks=("simple", "hard/build_gate"), max_steps=77)
    tasks = resolve_tasks(spec)
    simple = [f"simple/{n}" for n in mt.list_bench_tasks("simple")]
    assert [t.key for t in tasks] == [*simple, "hard/build_gate"] and {t.max_steps for t in tasks} == {77}
    openha = [f"openha/{n}" for n in mt.list_openha_tasks()]
    assert [t.key for t in resolve_tasks(SuiteSpec("openha"))] == openha
    with pytest.raises(ValueError, match="unknown suite 'mcu'"):
        SuiteSpec("mcu")


# ---------------------------------------------------------------------------------------------- reward rule


def _minestudio_rewards_callback():
    """MineStudio's real RewardsCallback class, loaded from the installed files without the simulator package
    (whose __init__ imports cv2)."""
    root = BENCH.parent / "simulator" / "callbacks"
    names = {n: f"minestudio.simulator.callbacks.{n}" for n in ("callback", "rewards")}
    saved = {full: sys.modules.get(full) for full in names.values()}
    mods = {}
    try:
        for name, full in names.items():  # rewards.py imports callback.py by its full name
            spec = importlib.util.spec_from_file_location(full, root / f"{name}.py")
            mods[name] = sys.modules[full] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mods[name])
    finally:
        for full, m in saved.items():
            if m is None:
                sys.modules.pop(full, None)
            else:
                sys.modules[full] = m
    return mods["rewards"].RewardsCallback


def test_reward_rule_matches_minestudio_rewards_callback():
    rewards_callback = _minestudio_rewards_callback()
    ev = lambda event, identity, objects, reward, times: {
        "event": event, "identity": identity, "objects": objects, "reward": reward, "max_reward_times": times}
    cfg = [ev("mine_block", "logs", ["oak_log", "birch_log"], 1.0, 1),
           ev("craft_item", "zero", ["stick"], 0.0, 5),  # pays nothing
           ev("pickup", "never", ["dirt"], 2.0, 0),  # may pay 0 times
           ev("use_item", "bread", ["bread"], 0.5, 2)]
    task = mt.task_from_dict({"text": "t", "reward_cfg": cfg}, "t", source="t.yaml")
    items = [("mine_block", "oak_log"), ("mine_block", "birch_log"), ("mine_block", "dirt"),
             ("craft_item", "stick"), ("pickup", "dirt"), ("use_item", "bread"), ("use_item", "apple")]
    rng = np.random.default_rng(0)
    decided = {True: 0, False: 0}
    for episode in range(200):
        oracle = rewards_callback(cfg)
        counts = dict.fromkeys(items, 0)
        oracle.after_reset(None, {}, raw_info(counts))
        paid = False
        for _ in range(12):
            for it in items:  # Minecraft's statistics only grow; most steps change nothing
                if rng.random() < 0.04:
                    counts[it] += int(rng.integers(1, 3))
            raw = raw_info(counts)
            _, reward, *_ = oracle.after_step(None, {}, 0.0, False, False, raw)
            paid = paid or reward > 0  # OpenHA's rule, over the episode so far
            ours = task.is_success(info_from_sim(raw, cursor=None, held_slot=1))
            assert ours == paid, (episode, counts)
        decided[paid] += 1
    assert min(decided.values()) > 20  # both verdicts were exercised


def test_reward_paid_at_reset_is_not_a_success():
    task = mt.load_openha_task("mine_oak_log")
    info = info_from_sim(raw_info({("mine_block", "oak_log"): 1}), cursor=None, held_slot=1)
    info.update(task=task.name, success=task.is_success(info), steps=0)
    rec = step_record(task, "e0", 0, {"image": np.zeros((8, 8, 3), np.uint8)}, info,
                      Decision(action={}, subtask="done"), reward=0.0, done=True, kind="eval", seed=3,
                      backend="minestudio")
    res = EpisodeResult(task="mine_oak_log", seed=3, agent="random", episode_id="e0", success=True, steps=0,
                        interrupted=False, error="", progress=1.0, records=[rec], seconds=0.1)
    ep = episode_verdict(task, res)
    assert not ep.success and "already paid at reset" in ep.error
    assert ep.rewards_paid == ["mine oak_log blocks"]
    res.steps = 5
    ep = episode_verdict(task, res)
    assert ep.success and not ep.error and ep.rewards_paid == ["mine oak_log blocks"]


# ---------------------------------------------------------------------------------------------- summary


def _ep(task, seed, steps, success=False, interrupted=False, judgement=None):
    return SuiteEpisode(task=task, seed=seed, agent="random", episode_id=f"{task}-{seed}", steps=steps,
                        success=success, interrupted=interrupted, error="", rewards_paid=[],
                        judgement=judgement)


def test_openha_summary_counts_successes_over_finished_episodes():
    eps = [_ep("openha/a", 0, 10, True), _ep("openha/a", 1, 400), _ep("openha/a", 2, 30, True),
           _ep("openha/a", 3, 0, interrupted=True), _ep("openha/b", 0, 400)]
    rows = summarize("openha", eps)
    assert rows["openha/a"] == {"episodes": 4, "interrupted": 1, "mean_steps": pytest.approx(440 / 3),
                                "successes": 2, "success_rate": pytest.approx(2 / 3)}
    assert rows["openha/b"]["successes"] == 0 and rows["openha/b"]["success_rate"] == 0.0
    table = format_table("openha", rows).splitlines()
    assert table[0].split() == ["task", "episodes", "interrupted", "successes", "success_rate", "mean_steps"]
    assert table[1].split() == ["openha/a", "4", "1", "2", "0.67", "146.67"]


def test_bench_summary_separates_judged_failed_and_unjudged_episodes():
    good = vj.Judgement(True, dict.fromkeys(CRITERIA, 6), dict.fromkeys(CRITERIA, ""), 1, "", 0.1)
    better = vj.Judgement(True, {**dict.fromkeys(CRITERIA, 8), "Task Progress": 2}, {}, 1, "", 0.1)
    failed = vj.Judgement(False, {}, {}, 3, "no valid rating after 3 replies; last: x", 0.1)
    eps = [_ep("simple/a", 0, 600, judgement=good), _ep("simple/a", 1, 600, judgement=better),
           _ep("simple/a", 2, 600, judgement=failed), _ep("simple/a", 3, 600), _ep("simple/a", 4, 0,
                                                                                   interrupted=True)]
    row = summarize("minestudio_bench", eps)["simple/a"]
    assert (row["episodes"], row["interrupted"], row["judged"], row["judge_errors"], row["unjudged"]) == \
        (5, 1, 2, 1, 1)
    assert row["score"] == pytest.approx((6 + (2 + 8 * 5) / 6) / 2)
    assert row["criteria"]["Task Progress"] == 4.0 and row["criteria"]["Creative Attempts"] == 7.0
    assert format_table("minestudio_bench", {"simple/b": summarize("minestudio_bench", [
        _ep("simple/b", 0, 600)])["simple/b"]}).splitlines()[1].split()[-2] == "-"  # no score: unjudged


def test_entry_point_says_in_one_line_that_minecraft_cannot_run():
    from histeve_jax.envs.minestudio import missing_requirements

    if not missing_requirements():
        pytest.skip("this machine has MineStudio's engine and Java 8")
    for variant in ("", ":openha"):
        out = subprocess.run([sys.executable, "-m", "experiments.minecraft_bench",
                              f"--config=experiments/configs/minecraft_bench.py{variant}"],
                             cwd=REPO, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OPENAI_API_KEY": ""})
        lines = (out.stdout + out.stderr).strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1, lines
        assert lines[0].startswith("error: MineStudio's Minecraft cannot run here; missing: ")
        assert "mcprec-6.13.jar" in lines[0] and "Java 8" in lines[0]


def test_config_unpacks_into_the_suite_spec():
    from experiments.configs.minecraft_bench import get_config

    bench = SuiteSpec.from_config(get_config())
    assert (bench.suite, bench.tasks, bench.max_steps, bench.judge) == ("minestudio_bench", ("simple",), 0,
                                                                         vj.JudgeSpec())
    openha = SuiteSpec.from_config(get_config("openha"))
    assert (openha.suite, openha.tasks, openha.obs_size) == ("openha", (), (224, 224))
    with pytest.raises(ValueError, match="unknown minecraft_bench variant 'mcu'"):
        get_config("mcu")


def test_finish_episode_of_an_openha_task_reads_the_reward_events(tmp_path):
    task = mt.load_openha_task("mine_oak_log")
    frames = [np.ascontiguousarray(f[::4, ::4]) for f in recorded_frames(6)]
    result = episode_result(task, frames, lambda t: {("mine_block", "oak_log"): 1} if t >= 5 else {})
    ep = finish_episode(SuiteSpec("openha", out_dir=str(tmp_path)), task, result, None)
    assert ep.success and ep.steps == 5 and ep.rewards_paid == ["mine oak_log blocks"]
    assert ep.judgement is None
    assert [r.completed for r in result.records] == [0, 0, 0, 0, 0, 1]
    assert Path(ep.report).exists()
