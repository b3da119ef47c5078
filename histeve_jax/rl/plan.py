"""Ahead-of-time plan of the RL learner's step on a pod: the policy with its optimizer state, the frozen
reference (params only, sharded like the policy) and the mixed batch, compiled from abstract shapes.

Two programs run one after the other on the same chips every step, with the policy state, the reference
params and the batch resident throughout: the reference's forward (``learner.Reference``) and the train
step (``rl.loss.rl_loss`` through ``train.step``). The per-device peak is therefore the larger of
``train step (arguments + outputs - aliased + temporaries) + reference params`` and
``reference forward (arguments + temporaries) + policy state``. ``python -m experiments.plan
--config=experiments/configs/plan.py:rl_qwen7b`` calls ``rl_plan`` with the learner's train config (the
imitation config of that shape with RL's batch size and microbatches) and prints its figures; XLA:CPU's
memory analysis is an estimate of XLA:TPU's, as for the imitation plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from histeve_jax.rl.spec import RLSpec


def abstract_rl_batch(cfg: Any, rl: RLSpec, seq_len: int) -> dict[str, Any]:
    """ShapeDtypeStructs of one global RL batch (``learner.RLBatches``' keys, image grid left on the host)."""
    B, L, K = rl.batch_size, seq_len, min(cfg.max_targets, seq_len)
    s = jax.ShapeDtypeStruct
    return {
        "input_ids": s((B, L), jnp.int32), "attention_mask": s((B, L), jnp.int32),
        "targets": s((B, L), jnp.int32), "loss_mask": s((B, L), jnp.float32), "regime": s((B,), jnp.int32),
        "pixel_values": s((B, cfg.num_frames * cfg.patches_per_image, cfg.base.vision.patch_dim),
                          jnp.float32),
        "behaviour_logp": s((B, L), jnp.float32), "advantage": s((B,), jnp.float32),
        "rl_row": s((B,), jnp.bool_), "pair": s((B,), jnp.int32), "chosen": s((B,), jnp.bool_),
        "replay_row": s((B,), jnp.bool_), "ref_logp": s((B, K), jnp.float32),
    }


def _total(mem: Any) -> float:
    return float(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                 + mem.temp_size_in_bytes)


def rl_plan(train_config: Any, rl: RLSpec, mesh: Any, hbm_bytes: float, *, scan_layers: bool = True,
            verbose: bool = True) -> dict[str, float]:
    """Compile the reference forward and the RL train step on ``mesh`` (abstract; nothing is allocated) and
    return per-device bytes and ``hbm_fraction`` (the larger of the two programs' peaks, module docstring)."""
    from histeve_jax.parallel import axes, sharding
    from histeve_jax.rl.learner import RL_KEYS, rl_stage
    from histeve_jax.rl.loss import reference_log_probs
    from histeve_jax.train import optimizer, setup
    from histeve_jax.train import state as state_lib
    from histeve_jax.train import step as step_lib
    from histeve_jax.train.specs import RunSpec

    spec = RunSpec.from_config(train_config)
    cfg = setup.policy_config(spec, named_base=True)
    # layer_loop "scan": the TPU program's loop ("auto" unrolls on the CPU backend this compiles on).
    cfg = dataclasses.replace(cfg, base=cfg.base.replace(scan_layers=scan_layers, layer_loop="scan"))
    stage = rl_stage(spec, rl, cfg)
    rules = axes.RULES
    tx, schedule = optimizer.make_optimizer(spec.optimizer)
    abstract, shardings = state_lib.abstract_train_state(stage.init_model, tx, mesh, rules)
    batch = abstract_rl_batch(cfg, rl, spec.data.max_len)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    step_fn = step_lib.make_train_step(stage.loss_fn, tx, schedule=schedule,
                                       microbatches=spec.loop.microbatches)
    train = step_lib.jit_train_step(step_fn, shardings, mesh, rules).lower(abstract, batch, key).compile()

    graphdef, rest = abstract.graphdef, abstract.rest
    ref_keys = {k: v for k, v in batch.items() if k not in RL_KEYS}

    def ref_fn(params: Any, b: dict[str, Any]) -> jax.Array:
        with axes.activate(mesh, rules):
            from flax import nnx

            return reference_log_probs(nnx.merge(graphdef, params, rest), b, rl.temperature)

    ref = jax.jit(ref_fn, in_shardings=(shardings.params, step_lib.batch_sharding(mesh, rules)),
                  out_shardings=NamedSharding(mesh, PartitionSpec()))
    ref = ref.lower(abstract.params, ref_keys).compile()
    params_b = sharding.bytes_per_device(abstract.params)
    opt_b = sharding.bytes_per_device(abstract.opt_state)
    train_peak = _total(train.memory_analysis()) + params_b  # + the resident reference
    rm = ref.memory_analysis()
    # + the policy's state, resident while the reference runs
    ref_peak = float(rm.argument_size_in_bytes + rm.temp_size_in_bytes) + params_b + opt_b
    out = {"params_bytes": params_b, "opt_bytes": opt_b, "reference_bytes": params_b,
           "train_step_bytes": _total(train.memory_analysis()), "train_temp_bytes":
           float(train.memory_analysis().temp_size_in_bytes), "reference_forward_bytes":
           float(rm.argument_size_in_bytes + rm.temp_size_in_bytes), "peak_bytes": max(train_peak, ref_peak)}
    out["hbm_fraction"] = out["peak_bytes"] / hbm_bytes
    if verbose:
        gb = {k: f"{v / 1e9:.4g} GB" for k, v in out.items() if k.endswith("bytes")}
        print(f"RL step on {dict(mesh.shape)}: batch {rl.batch_size} (GRPO {rl.rl_rows}, DPO {rl.pair_rows}, "
              f"replay {rl.replay_rows}) x {spec.data.max_len}, microbatches {spec.loop.microbatches}; "
              f"per device {gb}")
    return out


def act_plan(cfg: Any, batch: int, prompt_len: int, *, dtype: Any = jnp.bfloat16) -> dict[str, float]:
    """Compile the policy server's act program (``ActionSampler``'s: prefill of ``batch`` prompts of
    ``prompt_len`` tokens with ``cfg.num_frames`` frames each, then the grammar-constrained decode loop of
    up to ``cfg.vocab.max_len`` tokens) on one device with ``dtype`` weights, from abstract shapes; returns
    its memory and cost analysis. XLA counts a loop body once: ``flops`` and ``bytes_accessed`` are the
    prefill plus ONE decode step (``act_time`` adds the others)."""
    import importlib
    import math

    from flax import nnx

    from histeve_jax.actions import grammar as grammar_lib
    from histeve_jax.policy import Policy
    from histeve_jax.policy.sampling import grammar_of

    # the module, not the package's generate() function of the same name
    gen = importlib.import_module("histeve_jax.models.qwen2_5_vl.generate")
    model = nnx.eval_shape(lambda: Policy(cfg, rngs=nnx.Rngs(0))).model
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    paths = tuple(p for p, _ in flat)

    def cast(v: Any) -> Any:
        v = v.get_value() if hasattr(v, "get_value") else v
        floating = jnp.issubdtype(v.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(v.shape, dtype if floating else v.dtype)

    weights = tuple(cast(v) for _, v in flat)
    layer_def, layer_state = nnx.split(model.language_model.layers)
    layer_paths = tuple(p for p, _ in nnx.to_flat_state(layer_state))
    run = gen._compiled(graphdef, paths, layer_def, layer_paths)
    s = jax.ShapeDtypeStruct
    B, T = batch, prompt_len
    n_img = B * cfg.num_frames
    pixels = s((n_img * cfg.patches_per_image, cfg.base.vision.patch_dim), jnp.float32)
    prompt = gen._Prompt(s((B, T), jnp.int32), s((B, T), jnp.int32), pixels, None, None, s((B,), jnp.int32))
    grammar = grammar_of(cfg)
    leaves, treedef = jax.tree.flatten(grammar_lib.ActionConstraint(grammar, np.zeros((B,), np.int32)))
    c_leaves = [s(np.shape(x), np.asarray(x).dtype) for x in leaves]
    end = cfg.vocab.id_of(cfg.vocab.slots.end)
    static = gen._Static(image_grid=cfg.image_grid(n_img), video_grid=None,
                         max_new=int(cfg.vocab.max_len), greedy=False, stop_ids=(end,), pad_id=end,
                         constraint=("tree", treedef), unstack=False)
    key = s((), jax.random.key(0).dtype)
    f32 = s((), jnp.float32)
    compiled = run.lower(weights, (), prompt, key, f32, f32, c_leaves, static=static).compile()
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    weight_bytes = float(sum(math.prod(w.shape) * jnp.dtype(w.dtype).itemsize for w in weights))
    return {"batch": B, "prompt_len": T, "decode_tokens": int(cfg.vocab.max_len),
            "weight_bytes": weight_bytes, "argument_bytes": float(mem.argument_size_in_bytes),
            "temp_bytes": float(mem.temp_size_in_bytes), "output_bytes": float(mem.output_size_in_bytes),
            "peak_bytes": _total(mem), "flops": float(cost["flops"]),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def act_time(plan: dict[str, float], decode_flops_per_row: float, *, chips: int, peak_flops: float,
             hbm_bytes_per_s: float, mfu: float) -> float:
    """Seconds of one act call of ``plan`` on ``chips`` chips (the batch split over them, weights on each):
    the program as compiled (prefill + one decode step) at ``mfu`` of peak or its bytes at HBM speed,
    whichever is longer, plus the other decode steps, each reading the weights once (a decode step's
    FLOPs, ``decode_flops_per_row`` per row, are far below that at these batches)."""
    prog = max(plan["flops"] / (chips * peak_flops * mfu), plan["bytes_accessed"] / (chips * hbm_bytes_per_s))
    step = max(plan["batch"] * decode_flops_per_row / (chips * peak_flops * mfu),
               plan["weight_bytes"] / hbm_bytes_per_s)
    return prog + (plan["decode_tokens"] - 1) * step
