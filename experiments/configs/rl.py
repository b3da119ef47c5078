"""Stage 3, RL from branch groups: the learner's train config, the ``rl`` group (``rl.spec.RLSpec``, with its
``loss`` = ``losses.rl.RLLossConfig`` and ``score`` = ``rl.scoring.ScoreConfig``) and the evaluation.

``python -m experiments.rl`` (``:tiny``, the default; CPU, Luanti) or ``:qwen7b`` (TPU pod learner, actors on
a Ray cluster, policy servers on accelerator hosts; see launch/rl.md); ``:rehearsal`` is that topology on this
machine (``histeve_jax.rl.rehearsal``: 2 learner processes, a 3-node local Ray cluster, faults injected).
The policy's shape (model, frames, prompt length) is the start run's: the
entry point reads it from ``start_run``'s config.json, so these fields only set what RL changes.

Choices (the paper leaves them open; the loss defaults' reasons are in ``RLLossConfig``'s docstring):
- K = 8 branches per group (TRL's default). The tiny run keeps it: with success rate p a group is
  uninformative with probability p^8 + (1 - p)^8, and scores also spread through verified progress and cost.
- min_reward_std = 0.01 (the loss default is 1e-6): a group whose scores differ only by a few steps of speed
  (0.1 x 10 / 120 = 0.008) is skipped, not amplified to +-1 advantages by the std normalisation.
- eps_A = 1e-4, clip [0.8, 1.28] (DAPO clip-higher), k3 KL with lambda_ref = 0.04, beta = 0.1: the defaults.
- DPO window: 4 steps in the tiny run (0.2 s: one cursor move and its click; the default 8 is for 20 Hz play
  at full size), one pair per batch; replay: 4 of 28 rows (1/7) are the start run's demonstrations.
- Staleness: at most 160 learner steps between the acting weights and the update (a group of 8 x ~100 steps
  is ~50 batches of 16 GRPO rows; two groups' worth plus the publishing interval).
"""

from __future__ import annotations

import ml_collections

from experiments.configs.evaluate import HELD_OUT_SEED

VARIANTS = ("tiny", "qwen7b", "rehearsal")


def rl_fields(variant: str) -> ml_collections.ConfigDict:
    """The ``rl`` group (RLSpec's fields)."""
    r = ml_collections.ConfigDict()
    r.rollout_dir = ""  # "": <workdir>/rollouts
    r.reference = ""  # "": the start run
    r.replay_dirs = ""  # "": <start run>/data/train (its demonstrations)
    r.rl_rows = 16
    r.pair_units = 1
    r.replay_rows = 4
    r.temperature = 1.0
    r.max_policy_lag = 160
    r.poll_s = 1.0
    r.timeout_s = 1800.0
    r.seed = 0
    r.groups_per_wave = 1
    r.max_steps = 120  # per branch (the evaluation's budget)
    r.max_backlog_groups = 1
    r.loss = ml_collections.ConfigDict({
        "group_size": 8, "adv_eps": 1e-4, "min_reward_std": 0.01, "clip_eps_low": 0.2,
        "clip_eps_high": 0.28, "aggregation": "token-mean", "kl_estimator": "k3", "dpo_beta": 0.1,
        "dpo_window": 4, "lambda_dpo": 1.0, "lambda_world": 1.0, "lambda_ref": 0.04})
    r.score = ml_collections.ConfigDict({"success": 1.0, "progress": 0.5, "steps": 0.1, "death": 0.5,
                                         "timeout": 0.05, "gui_open": 0.1, "grid_progress": 0.5})
    if variant == "qwen7b":
        r.rl_rows = 128
        r.pair_units = 4  # 4 pairs x 2 x 8 steps = 64 rows
        r.replay_rows = 64
        r.max_steps = 0  # the task's own budget
        r.groups_per_wave = 8
        r.max_backlog_groups = 16
        r.max_policy_lag = 64
        r.loss.dpo_window = 8
    if variant == "rehearsal":
        # 2 GRPO + 1 pair x 2 x 2 steps + 2 replay = 8 rows: the 8 devices of 2 processes x 4, as in
        # tests/test_rl_multihost.py; K = 2 branches of 12 steps keep a group to a few seconds of play
        r.rl_rows = 2
        r.replay_rows = 2
        r.loss.dpo_window = 2
        r.loss.group_size = 2
        r.max_steps = 12
        r.poll_s = 0.1
        r.timeout_s = 900.0
    return r


def server_fields(variant: str) -> ml_collections.ConfigDict:
    """The policy servers' placement (``rl.serving.ServerSpec``)."""
    s = ml_collections.ConfigDict()
    s.resource = ""  # "": placed by CPUs (one machine); "accelerator": on hosts that join with that resource
    s.replicas = 1
    s.num_cpus = 0.0
    s.max_batch = 0  # 0: the games one replica serves
    s.max_restarts = -1
    if variant == "qwen7b":
        # one replica per inference host (it acts on one chip: load_run's 1-device mesh); experiments.plan
        # :rl_qwen7b sizes them: 128 games at 20 Hz need 2560 actions/s, 14 v5p-8 hosts at 32 rows per chip
        s.resource = "accelerator"
        s.replicas = 14
    if variant == "rehearsal":
        s.resource = "accelerator"  # the inference node of the local cluster holds it
        s.replicas = 2
    return s


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "tiny"
    if variant not in VARIANTS:
        raise ValueError(f"unknown rl config variant {variant!r}; choose one of {VARIANTS}")
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.role = "all"  # "all": evaluate, learn and act here; "learner" / "actors": one side (launch/rl.md)
    c.distributed = "auto"  # the learner's jax.distributed; "on" on a multi-host slice (launch/tpu.sh)
    c.workdir = f"/tmp/histeve_runs/rl_{variant}"
    c.start_run = "/tmp/histeve_runs/imitation_tiny"  # stage 2's workdir (the tiny one runs first if absent)
    c.task = ""  # "": the weakest atomic task of the start run's evaluation with some success
    c.train_minutes = 20.0  # the actors stop starting groups after this; the learner then finishes
    c.instances = 2  # games
    c.ray_address = ""
    c.env = ml_collections.ConfigDict({"randomize_init": True, "fps_max": 30, "viewing_range": 40})
    c.group_seed = 100_000  # branch groups reset from seeds 100000, 100001, ... (never an evaluation seed)

    c.learner = ml_collections.ConfigDict()  # overrides of the start run's train config
    c.learner.num_train_steps = 100_000  # the stream's end (the actors' deadline) ends the run first
    c.learner.checkpoint_every = 10  # = the weights' publishing interval
    c.learner.keep_checkpoints = 4
    c.learner.log_every = 10
    c.learner.learning_rate = 1e-4
    c.learner.warmup_steps = 10
    c.learner.microbatches = 1

    c.rl = rl_fields(variant)
    c.server = server_fields(variant)

    c.eval = ml_collections.ConfigDict()
    c.eval.episodes = 20  # per task, before and after, on the same held-out seeds
    c.eval.seed = HELD_OUT_SEED
    c.eval.max_steps = 120
    c.eval.temperature = 1.0
    c.eval.greedy = False
    if variant == "qwen7b":
        c.start_run = "/mnt/runs/imitation_qwen7b"
        c.workdir = "/mnt/runs/rl_qwen7b"
        c.train_minutes = 24 * 60.0
        c.instances = 64
        c.learner.num_train_steps = 20_000
        c.learner.checkpoint_every = 20
        c.learner.learning_rate = 1e-6
        c.learner.warmup_steps = 50
        c.learner.microbatches = 4
        c.eval.episodes = 100
        c.eval.max_steps = 0
    if variant == "rehearsal":
        c.role = "rehearsal"
        c.workdir = "/tmp/histeve_runs/rl_rehearsal"  # the shared path every host sees; wiped at the start
        c.start_run = ""  # built by the rehearsal: the tiny policy at its random initialisation
        c.task = "place_dirt"
        c.instances = 2
        c.learner.checkpoint_every = 2
        c.learner.log_every = 1
        c.learner.warmup_steps = 1
        c.rehearsal = ml_collections.ConfigDict({
            "learner_processes": 2, "devices_per_process": 4, "groups": 3, "actor_cpus": 1.0,
            "kill_after_step": 4, "timeout_s": 900.0})
    return c
