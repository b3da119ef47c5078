"""The whole agent: planner + harness + our policy + our detector, from nothing to a wooden pickaxe.

    python -m experiments.agent [--config=experiments/configs/agent.py:tiny] [--config.reuse=<workdir>]

``policy`` / ``detector`` name runs to use; empty, they are made under ``workdir`` (``policy/``: the
imitation run's ``:pickaxe`` variant; ``detector/``: ``experiments.detector`` trained beside that policy on
expert episodes of the long-horizon tasks' subtasks and the policy's own evaluation rollouts). ``play``
holds the long-horizon suite's fields (``harness.suite.SuiteSpec``'s). Seeds start at 1000 (held out from
the recorder's training seeds and the detector's), fixed before any result was looked at.
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("tiny",)
TASKS = ("wooden_pickaxe", "dirt_wall")
# The atomic subtasks the rules planner invokes for TASKS: the detector's expert episodes.
SUBTASKS = ("mine_log", "craft_planks", "craft_sticks", "craft_wooden_pickaxe", "mine_dirt", "build_wall",
            "place_dirt")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "tiny"
    if variant not in VARIANTS:
        raise ValueError(f"unknown agent config variant {variant!r}; choose one of {VARIANTS}")
    c = ml_collections.ConfigDict()
    c.workdir = "/tmp/histeve_runs/agent"
    c.reuse = ""  # an earlier agent workdir: work there, skipping every stage (and episode) it finished
    c.policy = ""  # a policy run ("": made under workdir/policy by the imitation :pickaxe variant)
    c.policy_config = "imitation.py:pickaxe"
    c.detector = ""  # a detector run beside that policy ("": made under workdir/detector)
    c.detector_record_tasks = SUBTASKS
    c.detector_record_episodes = 6  # expert episodes per subtask (beside the policy's own rollouts)
    # The policy's own rollouts of those subtasks per task (training seeds, played on past success), in place
    # of its held-out evaluation episodes: what it does once a subtask is done is what the loop must stop on.
    c.detector_rollout_episodes = 16
    # per-task exceptions ("mine_log=48": the subtask whose completion it missed most; on validation seeds
    # 0/6 against 3/6 without, its loop threshold 0.97 against 0.93)
    c.detector_rollout_task_episodes = ""
    c.detector_per_unit = 8  # queries per unit and class (3: the detector barely learnt in 1000 steps)
    # Training units: each subtask and its expert's phases (aim, dig, ...) as instructions of their own
    # (True), or the subtasks only (False), which the loop asks
    c.detector_subtasks = True
    # 3000 with 8 queries a unit: row 1 3/6 on validation seeds, 1/6 at 1000 with 3 (300: test F1 0.77 and
    # invocations ended at their second query in the loop)
    c.detector_steps = 3000
    c.detector_max_len = 192  # 4 frames x 28 tokens and the longest subtask's text with its phase (165)
    # The invocation's first frame as a slot (max_len grows by a frame's tokens and 2 markers); the subtasks
    # again from each later rise of their product as training queries and as loop-threshold replays; a loop
    # threshold per subtask (experiments/configs/detector.py)
    c.detector_anchor = False
    c.detector_resume_units = False
    c.detector_loop_resume_units = False
    c.detector_per_task_thresholds = False
    # A crop "top,bottom,left,right" the detector also reads detail_scale times larger, of the query's frame
    # and the anchor's ("84,112,14,154": the hotbar at 112x196; max_len grows by its tokens a crop). "": none.
    c.detector_detail = ""
    c.detector_detail_scale = 2
    # The policy's own invocations through the harness on training seeds (6000+), play.tasks each this many
    # episodes, the privileged check held 16 steps past each subtask's completion: each invocation a unit
    # from its own first frame (experiments/configs/detector.py harness_episodes). 0: none.
    c.detector_harness_episodes = 0
    c.progress_bar = True

    p = ml_collections.ConfigDict()
    p.tasks = TASKS
    p.episodes = 10  # per task and row
    p.seed = 1000
    p.inject = True  # the suite's standard injected failures
    p.policy_max_steps = 1200  # per episode, the policy rows (the experts: the task's budget, 330-550 used)
    p.detector_every = 2
    p.greedy = False
    # every held-out agent figure since 2026-12-05 sampled so (the policy's rollouts for its detector too)
    p.temperature = 0.5
    p.top_p = 0.8
    p.reports = 2  # HTML reports for the first episodes of each task and row
    p.env = ml_collections.ConfigDict({"randomize_init": True, "fps_max": 30, "viewing_range": 40})
    # stall_patience: steps the player may stand still outside the GUI before an invocation ends as a stall
    # and the harness backs off and turns (HarnessSpec; 0: off). 100 since stop 50: held-out wooden_pickaxe
    # in row 1 6/20 against 2/20 without it, row 2 5/10 both (README "Stalls")
    # walk_back: the harness walks back to a resource out of sight that its world memory saw (HarnessSpec)
    # completion_after_close: the detector's invocation begins at the policy's first step (HarnessSpec)
    p.harness = ml_collections.ConfigDict({"max_recoveries": 2, "max_planner_failures": 3,
                                              "stall_patience": 100, "walk_back": False,
                                              "completion_after_close": True})
    c.play = p

    c.planner = "rules"  # rules | endpoint (any OpenAI-compatible server) | local (a Qwen2.5-VL directory)
    c.unit_steps = True  # rules: one log, dirt block or craft per invocation (the unit the policy learnt)
    c.endpoint = ml_collections.ConfigDict({
        "base_url": "", "model": "gpt-4o", "api_key": "", "timeout_s": 60.0, "max_attempts": 3,
        "max_tokens": 128})
    c.local_model = ""
    return c
