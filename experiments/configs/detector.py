"""The completion detector: a pruned Qwen2.5-VL decoder trained on balanced completion queries.

``python -m experiments.detector --config=experiments/configs/detector.py:tiny`` (default: a tiny random
3B-style decoder pruned to a third, a tiny policy, Luanti episodes; CPU, minutes) or ``:qwen3b`` (the paper's
detector: Qwen2.5-VL-3B pruned to a third, reading a Qwen2.5-VL-7B policy; TPU pod). ``train`` holds the
shared loop's fields (``train.specs.RunSpec``); ``detector`` the detector's own; ``plan`` the AOT plan's.
"""

from __future__ import annotations

import ml_collections

from experiments.configs.common import base_config
from experiments.configs.plan import V5P_HBM_BYTES

VARIANTS = ("tiny", "qwen3b")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "tiny"
    if variant not in VARIANTS:
        raise ValueError(f"unknown detector config variant {variant!r}; choose one of {VARIANTS}")
    c = ml_collections.ConfigDict()
    c.variant = variant
    t = base_config("detector", "tiny" if variant == "tiny" else "qwen7b")
    t.variant = variant
    t.num_train_steps = 300
    t.log_every = 50
    t.eval_every = 100
    t.eval_batches = 8
    t.checkpoint_every = 300
    t.data.batch_size = 8
    t.data.generate = "record"
    t.optimizer.learning_rate = 1e-3
    t.optimizer.warmup_steps = 30
    c.train = t

    d = ml_collections.ConfigDict()
    d.records = ""  # comma-separated record dirs of expert episodes ("": record them with experiments.record)
    d.record_tasks = ("place_dirt", "mine_dirt")  # what the tiny run records when no records are given
    d.record_episodes = 12  # per task
    d.record_after_success = 8  # steps the experts play on after success: the task units' positives
    d.policy = ""  # a trained policy run's workdir ("": a random tiny policy)
    # Closed-loop evaluation episodes of the policy: "auto" = <policy>/eval/records/policy when it exists.
    d.eval_records = "auto"
    # The policy's own rollouts of record_tasks (needs policy): played by experiments.evaluate on training
    # seeds, on past success with the policy's own actions, so the positives show what the policy does once
    # a subtask is done (the frames the loop must stop on) and the negatives its own ways of not being done.
    d.rollout_episodes = 0  # per task (0: none)
    d.rollout_task_episodes = ""  # per-task exceptions to rollout_episodes: "mine_log=48"
    d.rollout_seed = 5000  # held out from evaluation (1000+), validation (2000+) and the recorder (0+)
    d.rollout_after_success = 40
    d.rollout_max_steps = 240
    d.rollout_temperature = 1.0
    d.rollout_top_p = 1.0
    # The policy's own invocations through the harness (needs policy): experiments.longhorizon plays
    # harness_tasks with the rules planner (one unit per invocation) and the privileged check, the policy
    # acting harness_after steps past each subtask's completion, on training seeds, failures injected, at
    # the rollouts' sampling; each invocation is a unit from its own first frame (detector.data), and the
    # validation split's are replayed for the loop threshold. They show the starts the atomic tasks'
    # episodes never do: another craft's finished screen, the hole the last dig left.
    d.harness_episodes = 0  # per task (0: none)
    d.harness_tasks = ("wooden_pickaxe", "dirt_wall")
    d.harness_seed = 6000  # held out from evaluation (1000+), validation (2000+), the rollouts (5000+)
    d.harness_after = 16
    d.harness_max_steps = 1200
    d.hf_source = ""  # a Hugging Face Qwen2.5-VL dir to prune ("" tiny: a random 3B-style one is written)
    d.pruned = ""  # an already pruned detector directory (skips pruning)
    d.ffn_keep = 1 / 3
    d.multiple_of = 1  # the kept width is rounded to this (128 for TPU tiles)
    d.cross_attention_every = 4  # 0: the ablation without cross-attention
    d.history_frames = 3
    d.stride = 4
    d.max_len = 160  # 4 frames x 28 tokens at the main job's 112x196, and the subtask's text
    d.policy_max_len = 112  # the main job's data.max_len
    d.per_unit = 3  # queries per unit and class
    d.post_window = 4  # steps after a subtask boundary that count as complete
    d.subtasks = True  # training units: the task and each of the expert's phases (aim, dig, place, ...)
    d.start_jitter = False  # True: training queries begin their invocation at a random step (detector.data)
    # The invocation's first frame as one more slot (DetectorConfig.anchor; max_len must hold a frame's tokens
    # and its 2 vision markers more: experiments.agent raises it so)
    d.anchor = False
    # The task again from each later rise of its product's count (detector.data.resume_units): invocations
    # that begin with the product held, as training queries and as loop-threshold replays
    d.resume_units = False
    d.loop_resume_units = False
    # A crop "top,bottom,left,right" of the frame (pixels at the policy's image size) the detector also reads
    # detail_scale times larger, for the query's frame and the anchor's (DetectorConfig.detail; max_len must
    # hold its tokens and 2 markers per crop more): "84,112,14,154" is the hotbar at 112x196 (20 tokens at
    # scale 2). "": none.
    d.detail = ""
    d.detail_scale = 2
    d.eval_subtasks = False  # validation and test units: the task only (the atomic subtask the loop ends)
    d.splits = (0.6, 0.2, 0.2)  # train / validation (threshold) / test episodes, per task
    d.split_seed = 0
    d.monitor_every = 2  # in the loop: query every k steps ...
    d.consecutive = 2  # ... and fire on this many consecutive queries over the threshold
    d.max_early = 0.05  # loop threshold: the lowest whose replayed validation episodes end early at most so
    # How the loop threshold is picked from those replays (monitor.loop_threshold): "max_early" (above), or
    # "balanced": the fewest early_cost * early + missed stops (with the policy's own rollouts played on
    # past success in the data, where both happen).
    d.loop_rule = "max_early"
    d.early_cost = 1.0
    # Also a loop threshold per task, each by that rule from its own replays (loop_thresholds in the report;
    # the harness uses a subtask's own where it has one)
    d.per_task_thresholds = False
    c.detector = d

    c.vlm = ml_collections.ConfigDict()  # the prompted-VLM baseline (eval.suites.vlm_judge.JudgeSpec)
    c.vlm.base_url = ""  # "": $OPENAI_BASE_URL
    c.vlm.model = "gpt-4o"
    c.vlm.api_key = ""  # "": $OPENAI_API_KEY; neither: the baseline is skipped

    c.plan = ml_collections.ConfigDict()
    c.plan.num_devices = 8
    c.plan.ici = {"data": 1, "fsdp": -1, "tensor": 1}
    c.plan.hbm_bytes = V5P_HBM_BYTES

    if variant == "qwen3b":
        t.num_train_steps = 5000
        t.eval_every = 500
        t.checkpoint_every = 500
        t.model.kind = "hf"
        t.model.hf_path = ""  # the run reads detector.pruned
        t.model.base = "qwen2_5_vl_3b"
        t.model.remat = "full"
        t.data.image_size = (252, 448)
        t.data.batch_size = 64
        t.optimizer.learning_rate = 2e-5
        t.optimizer.warmup_steps = 200
        d.hf_source = "/mnt/models/Qwen2.5-VL-3B-Instruct"
        d.policy = "/mnt/runs/imitation_qwen7b"
        d.multiple_of = 128
        d.history_frames = 3
        d.stride = 5
        d.max_len = 4 * 144 + 64
        d.policy_max_len = 4 * 144 + 96
        c.plan.num_devices = 64
    return c
