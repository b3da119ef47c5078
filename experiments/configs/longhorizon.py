"""The long-horizon suite: the harness on long-horizon Luanti tasks with injected failures.

    python -m experiments.longhorizon [--config=experiments/configs/longhorizon.py:tiny]
        [--config.policy=<workdir> [--config.detector=<detector run>]] [--config.planner=rules|endpoint|local]

Fields are ``histeve_jax.harness.suite.SuiteSpec``'s plus the planner's. Seeds start at 1000 (held out from
the recorder's training seeds), fixed before any result was looked at.
"""

from __future__ import annotations

import ml_collections

TASKS = ("wooden_pickaxe", "dirt_wall", "stone_pickaxe", "steel_pickaxe")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "tiny"
    c = ml_collections.ConfigDict()
    c.tasks = TASKS
    c.episodes = 1  # per task and executor
    c.seed = 1000
    c.executors = ("expert", "policy")  # policy runs only with a policy workdir
    c.policy = ""
    c.step = -1
    c.greedy = False
    c.temperature = 1.0
    c.top_p = 1.0
    c.inject = True
    c.max_steps = 0  # 0: the task's budget for experts, policy_max_steps for the policy
    c.policy_max_steps = 2000
    c.obs_size = ()  # (H, W); (): the policy run's image size (56x56 for the experts alone)
    c.detector = ""  # a detector run trained beside the policy: its invocations end by the detector
    c.detector_every = 2  # query the detector every k steps
    c.detector_threshold = 0.0  # every subtask's; 0: the detector run's loop threshold
    c.completion = "auto"  # auto (detector if given) | detector | privileged | both (a row each)
    c.goal_only = True  # also the policy given only the final goal
    c.resume = False  # read back the episodes out_dir already holds
    c.records = False  # also write each episode's records, labelled per invocation (out_dir/records/<row>)
    c.privileged_after = 0  # the policy rows' privileged check stops an invocation this many steps later
    c.out_dir = "/tmp/histeve_runs/longhorizon"
    c.reports = 1
    c.env = ml_collections.ConfigDict({"randomize_init": True, "fps_max": 30, "viewing_range": 40})
    c.planner = "rules"  # rules | endpoint (any OpenAI-compatible server) | local (a Qwen2.5-VL directory)
    c.unit_steps = False  # rules: one log, dirt block or craft per invocation (else the whole total at once)
    c.endpoint = ml_collections.ConfigDict({
        "base_url": "", "model": "gpt-4o", "api_key": "", "timeout_s": 60.0, "max_attempts": 3,
        "max_tokens": 128})
    c.local_model = ""  # planner=local: a Qwen2.5-VL save_pretrained directory
    # stall_patience: steps the player may stand still outside the GUI before an invocation ends as a stall
    # and the harness backs off and turns (HarnessSpec); 0: off. walk_back: when the planner has no executable
    # subtask for a resource out of sight, the harness walks back to one its world memory saw (HarnessSpec).
    # completion_after_close: the detector's invocation begins at the policy's first step, after the executor
    # closed a GUI left open (HarnessSpec); False: at the invocation's first step, as before stop 52.
    c.harness = ml_collections.ConfigDict({"max_recoveries": 2, "max_planner_failures": 3,
                                              "stall_patience": 0, "walk_back": False,
                                              "completion_after_close": True})
    if variant == "full":
        c.episodes = 10
    elif variant != "tiny":
        raise ValueError(f"unknown longhorizon config variant {variant!r}; choose 'tiny' or 'full'")
    return c
