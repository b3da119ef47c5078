"""Ahead-of-time plan of the full-size train step on a pod, from a CPU host: nothing is allocated.

    python -m experiments.plan                                          # 7B imitation step, v5p-128, FSDP 64
    python -m experiments.plan --config=experiments/configs/plan.py:qwen7b --mesh=data=2,fsdp=32
    python -m experiments.plan --config.train.model.remat=none          # FLOPs without recomputation
    python -m experiments.plan --config=experiments/configs/plan.py:rl_qwen7b   # the RL learner's step
                                                     # and the policy server's act step on one host

It lowers and compiles the jitted train step (policy forward, action loss, backward, clipped AdamW update)
over a mesh of simulated CPU devices, with abstract state and batch that carry their shardings, then prints
per-device memory (parameters and optimizer state from the shardings; arguments, outputs and temporaries
from the compiled ``memory_analysis()``) and the compiled FLOPs (``cost_analysis()``) against an analytic
count. The last line is ``hbm_fraction_v5p=<f> flops_ratio=<r>``.

XLA:CPU schedules, fuses and rematerialises differently from XLA:TPU, so the memory figures are an estimate
of the TPU program's (bf16 dots in particular may keep f32 copies on CPU); the sharding, the per-device
shapes and the FLOPs are those of the SPMD-partitioned program.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from absl import app, flags  # noqa: E402

from experiments.config_cli import define_config  # noqa: E402

_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
define_config(os.path.join(_CONFIGS, "plan.py:qwen7b"), "Plan config.")
_MESH = flags.DEFINE_string(
    "mesh", "", "ICI mesh sizes, e.g. 'data=2,fsdp=-1' or '1,64,1' (default: config)."
)


def run_spec(config: Any) -> Any:
    """The stage's run spec (``train.specs``), as the train loop reads it."""
    from histeve_jax.train.specs import RunSpec

    return RunSpec.from_config(config.train)


def policy_config(spec: Any) -> Any:
    """The policy config the stage trains (``train.setup.policy_config``), scanned; with no Hugging Face
    config.json at hand, from the shape ``config.train.model.base`` names (any base: 3B, 7B, tiny)."""
    import dataclasses

    from histeve_jax.train import setup

    cfg = setup.policy_config(spec, named_base=True)
    # layer_loop "scan": the TPU program's loop. "auto" would unroll the layers here (the CPU backend), and
    # the plan would measure the unrolled program's memory and count its layers twice.
    return dataclasses.replace(cfg, base=cfg.base.replace(scan_layers=True, layer_loop="scan"))


def abstract_batch(cfg: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
    """ShapeDtypeStructs of one global batch as ``data.pipeline`` feeds ``policy.action_loss``."""
    import jax
    import jax.numpy as jnp

    B, L = batch_size, seq_len
    patches = cfg.num_frames * cfg.patches_per_image
    s = jax.ShapeDtypeStruct
    return {
        "input_ids": s((B, L), jnp.int32),
        "attention_mask": s((B, L), jnp.int32),
        "targets": s((B, L), jnp.int32),
        "loss_mask": s((B, L), jnp.float32),
        "regime": s((B,), jnp.int32),
        "pixel_values": s((B, patches, cfg.base.vision.patch_dim), jnp.float32),
    }


def analytic_flops(cfg: Any, batch_size: int, seq_len: int) -> dict[str, float]:
    """Training FLOPs of one step by part: 6 x matmul params x tokens, plus attention (12 B L^2 E per layer,
    all L^2 scores computed), the loss head only at ``max_targets`` positions, the vision tower on every
    patch (its patch embedding 4x: pixels need no gradient), attention over the real window lengths."""
    from histeve_jax.models.qwen2_5_vl.rope import vision_window_index

    t, v = cfg.model_config.text, cfg.model_config.vision
    B, L = batch_size, seq_len
    E, H, K, D, F = (
        t.hidden_size,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.head_dim,
        t.intermediate_size,
    )
    layer_params = E * H * D + 2 * E * K * D + H * D * E + 3 * E * F
    n_img = B * cfg.num_frames
    P = cfg.patches_per_image
    N = n_img * P
    Ev, Fv = v.hidden_size, v.intermediate_size
    grid = ((1, cfg.image_size[0] // v.patch_size, cfg.image_size[1] // v.patch_size),)
    _, cu = vision_window_index(grid, v.spatial_merge_size, v.window_size, v.patch_size)
    window_sq = float(sum(int(b - a) ** 2 for a, b in zip(cu[:-1], cu[1:], strict=True)))  # one image
    n_full = len(v.fullatt_block_indexes)
    merged = N // v.spatial_merge_size**2
    hid = Ev * v.spatial_merge_size**2
    return {
        "decoder_matmuls": 6.0 * t.num_hidden_layers * layer_params * B * L,
        "decoder_attention": 12.0 * t.num_hidden_layers * B * L * L * H * D,
        "lm_head": 6.0 * B * min(cfg.max_targets, L) * E * t.vocab_size,
        "vision_patch_embed": 4.0 * N * v.patch_dim * Ev,
        "vision_matmuls": 6.0 * v.depth * (4 * Ev * Ev + 3 * Ev * Fv) * N,
        "vision_attention": 12.0 * Ev * n_img * ((v.depth - n_full) * window_sq + n_full * P * P),
        "vision_merger": 6.0 * merged * (hid * hid + hid * v.out_hidden_size),
    }


def cost_analysis_is_per_device(mesh: Any) -> float:
    """Compiled FLOPs of a batch-sharded matmul over those of the unsharded one: 1/n means per device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    a = jax.ShapeDtypeStruct((8 * n, 256), jnp.float32)
    b = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    f = lambda x, y: x @ y
    whole = jax.jit(f).lower(a, b).compile().cost_analysis()["flops"]
    split = NamedSharding(mesh, P(mesh.axis_names))
    rep = NamedSharding(mesh, P())
    parted = jax.jit(f, in_shardings=(split, rep), out_shardings=split).lower(a, b).compile()
    return parted.cost_analysis()["flops"] / whole


def remat_visible_to_memory_analysis() -> tuple[float, float]:
    """(temp bytes without, with ``jax.checkpoint``) of 16 unrolled layers: XLA:CPU drops the barriers that
    keep recomputation apart, so remat of unrolled layers does not show in its memory analysis; inside a
    scan (the decoder) it does, because the saved residuals are the scan's stacked outputs."""
    import jax
    import jax.numpy as jnp

    layer = lambda w, x: jnp.tanh(x @ w) + jnp.sin(x)

    def loss(ws: Any, x: Any, fn: Any) -> Any:
        for w in ws:
            x = fn(w, x)
        return x.sum()

    ws = [jax.ShapeDtypeStruct((512, 512), jnp.float32)] * 16
    x = jax.ShapeDtypeStruct((2048, 512), jnp.float32)
    out = []
    for fn in (layer, jax.checkpoint(layer)):
        c = jax.jit(jax.grad(lambda ws, x, fn=fn: loss(ws, x, fn))).lower(ws, x).compile()
        out.append(float(c.memory_analysis().temp_size_in_bytes))
    return out[0], out[1]


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def compile_step(config: Any, cfg: Any, mesh: Any, *, images: bool = True) -> tuple[Any, Any, float, float]:
    """(compiled step, abstract state, lower seconds, compile seconds) of the policy ``cfg`` on ``mesh``."""
    import jax

    from histeve_jax.parallel import axes, sharding
    from histeve_jax.train import optimizer, setup
    from histeve_jax.train import state as state_lib
    from histeve_jax.train import step as step_lib

    spec = run_spec(config)
    stage = setup.policy_stage(spec, cfg)
    rules = axes.RULES
    tx, schedule = optimizer.make_optimizer(spec.optimizer)
    t0 = time.time()
    abstract, shardings = state_lib.abstract_train_state(stage.init_model, tx, mesh, rules)
    missing = sharding.unannotated_params(abstract.params)
    if missing:
        raise ValueError(f"plan: parameters without logical axis names: {missing}")
    batch = abstract_batch(cfg, spec.data.batch_size, spec.data.max_len)
    if not images:
        del batch["pixel_values"]
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    train_step = step_lib.make_train_step(stage.loss_fn, tx, schedule=schedule,
                                          microbatches=spec.loop.microbatches)
    lowered = step_lib.jit_train_step(train_step, shardings, mesh, rules).lower(abstract, batch, key)
    t1 = time.time()
    compiled = lowered.compile()
    return compiled, abstract, t1 - t0, time.time() - t1


def decoder_layer_flops(config: Any, cfg: Any, mesh: Any) -> tuple[float, float]:
    """(compiled FLOPs of one decoder layer's forward + backward, compile seconds), from the text-only step
    unrolled with 2 and with 1 layers: a layer's cost depends on the batch and length, not on the images."""
    flops, seconds = [], 0.0
    for k in (1, 2):
        base = cfg.base.replace(scan_layers=False, text={"num_hidden_layers": k})
        compiled, _, lo, co = compile_step(config, dataclasses.replace(cfg, base=base), mesh, images=False)
        flops.append(float(compiled.cost_analysis()["flops"]))
        seconds += lo + co
    return flops[1] - flops[0], seconds


def simulated_mesh(config: Any, mesh_flag: str = "") -> Any:
    """The mesh over ``config.num_devices`` simulated CPU devices (``--mesh`` or ``config.mesh.ici``)."""
    import jax

    # The CPU client reads this when it starts, i.e. at the first device query below.
    if jax.config.jax_num_cpu_devices < config.num_devices:
        jax.config.update("jax_num_cpu_devices", config.num_devices)
    from histeve_jax.parallel import mesh as mesh_lib

    devices = jax.devices()
    if len(devices) < config.num_devices:
        raise RuntimeError(f"plan: {len(devices)} devices, need {config.num_devices} (jax started too early)")
    ici = mesh_lib.parse_mesh_flag(mesh_flag) if mesh_flag else dict(config.mesh.ici)
    return mesh_lib.make_mesh(ici, devices=devices[: config.num_devices])


def plan(config: Any, mesh_flag: str = "") -> dict[str, float]:
    """Compile the step described by ``config`` and return the figures it prints."""
    import jax

    from histeve_jax.parallel import sharding

    mesh = simulated_mesh(config, mesh_flag)
    spec = run_spec(config)
    cfg = policy_config(spec)
    B, L = spec.data.batch_size, spec.data.max_len

    compiled, abstract, lower_s, compile_s = compile_step(config, cfg, mesh)
    scanned_flops = float(compiled.cost_analysis()["flops"])
    # XLA's cost analysis counts a while loop's body once, not once per trip: the scanned decoder is
    # counted as one layer, so the other L - 1 layers are added from unrolled 1- and 2-layer compiles.
    # (Their optimizer update, ~1e-5 of a layer's FLOPs, is counted twice; it does not show in 3 digits.)
    # Gradient accumulation is a loop too: its body (one microbatch) is counted once as well.
    if config.flops_from == "unrolled_layers" and cfg.base.scan_layers:
        layer_flops, flops_s = decoder_layer_flops(config, cfg, mesh)
        flops = scanned_flops + (cfg.base.text.num_hidden_layers - 1) * layer_flops
        flops *= spec.loop.microbatches
    else:
        flops, flops_s = scanned_flops, 0.0

    n = mesh.devices.size
    shape = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    params_b = sharding.bytes_per_device(abstract.params)
    opt_b = sharding.bytes_per_device(abstract.opt_state)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params))
    big = sharding.replicated_tensors(abstract, 1 << 20)
    mem = compiled.memory_analysis()
    hbm = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    per_device = cost_analysis_is_per_device(mesh)
    parts = analytic_flops(cfg, B, L)
    analytic_total = sum(parts.values())
    analytic = analytic_total / n if per_device < 0.5 else analytic_total
    ratio = flops / analytic
    frac = hbm / config.hbm_bytes
    tokens = B * L

    print(
        f"mesh {shape} ({n} simulated devices), rules axes.RULES, layer loop {cfg.base.layer_loop}, "
        f"remat '{cfg.base.remat}', "
        f"compute {spec.model.dtype}, params {spec.model.param_dtype}, microbatches {spec.loop.microbatches}"
    )
    print(
        f"batch {B} x {L} tokens ({cfg.num_frames} frames x {cfg.patches_per_image // 4} image tokens, "
        f"{cfg.image_size[0]}x{cfg.image_size[1]} px); {n_params / 1e9:.3f}B parameters"
    )
    print(
        f"lower {lower_s:.1f} s, compile {compile_s:.1f} s, FLOP-count compiles {flops_s:.1f} s, "
        f"host peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB"
    )
    print(f"per device: parameters {_gb(params_b)}, optimizer state {_gb(opt_b)} (from shardings)")
    print(
        f"per device (memory_analysis): arguments {_gb(mem.argument_size_in_bytes)}, "
        f"outputs {_gb(mem.output_size_in_bytes)}, aliased {_gb(mem.alias_size_in_bytes)}, "
        f"temporaries {_gb(mem.temp_size_in_bytes)}, total {_gb(hbm)} = {frac:.3f} of v5p HBM "
        f"(budget {config.hbm_budget})"
    )
    if big:
        print(f"replicated tensors over 1 MiB: {big}")
    no_remat, with_remat = remat_visible_to_memory_analysis()
    print(
        f"XLA:CPU memory analysis and remat of unrolled layers (the vision blocks): 16-layer probe "
        f"{no_remat / 1e6:.0f} MB without, {with_remat / 1e6:.0f} MB with jax.checkpoint"
        + (" -> not seen; the vision activations count in full" if with_remat >= 0.9 * no_remat else "")
    )
    print(
        f"cost_analysis counts {'per device' if per_device < 0.5 else 'the whole program'} "
        f"(probe: sharded/unsharded matmul FLOPs = {per_device:.4f}, 1/{n} = {1 / n:.4f}); "
        f"a scanned loop body counts once: scanned program {scanned_flops:.4e}"
    )
    for k, v in parts.items():
        print(f"  analytic {k:20s} {v:.4e}  ({100 * v / analytic_total:.1f}%)")
    print(
        f"FLOPs per device: compiled {flops:.4e} ({config.flops_from}), analytic {analytic:.4e} "
        f"(6 N T + attention, {analytic_total / tokens:.4e} per token); ratio {ratio:.3f}"
    )
    step_s = flops / config.peak_flops
    print(
        f"at v5p bf16 peak: {step_s:.3f} s/step of compiled FLOPs, "
        f"{tokens / max(step_s, 1e-12) / n:.0f} tokens/s/chip"
    )
    print(f"hbm_fraction_v5p={frac:.3f} flops_ratio={ratio:.3f}")
    return {
        "hbm_fraction_v5p": frac,
        "flops_ratio": ratio,
        "compiled_flops": flops,
        "analytic_flops": analytic,
        "params_bytes": params_b,
        "opt_bytes": opt_b,
        "temp_bytes": mem.temp_size_in_bytes,
    }


def plan_rl(config: Any, mesh_flag: str = "") -> dict[str, float]:
    """The RL learner's step (``histeve_jax.rl.plan.rl_plan``) of ``config`` (a ``:rl_*`` variant)."""
    from histeve_jax.rl.plan import rl_plan
    from histeve_jax.rl.spec import RLSpec

    mesh = simulated_mesh(config, mesh_flag)
    out = rl_plan(config.train, RLSpec.from_config(config.rl), mesh, config.hbm_bytes, verbose=True)
    print(f"learner: {mesh.devices.size} chips, {config.act.learner_hosts} hosts")
    out.update(plan_act(config))
    print(f"hbm_fraction_v5p={out['hbm_fraction']:.3f} (budget {config.hbm_budget}) "
          f"act_hbm_fraction={out['act_hbm_fraction']:.3g} inference_hosts={out['inference_hosts']}")
    return out


def plan_act(config: Any) -> dict[str, float]:
    """The policy server's act step on one inference host (``config.act``): compiled per chip at each of
    ``act.batches`` rows (bf16 weights, one replica per chip), its memory and time per call, and the
    inference hosts that serve ``act.games`` games at ``act.hz`` each (every game's act within a tick)."""
    from histeve_jax.rl.plan import act_plan, act_time

    a = config.act
    cfg = policy_config(run_spec(config))
    prompt_len = run_spec(config).data.max_len
    tick = 1.0 / a.hz
    chips = a.chips_per_host
    rows = []
    for b in a.batches:
        p = act_plan(cfg, int(b), prompt_len)
        params = p["weight_bytes"] / 2  # bf16
        t = act_time(p, 2.0 * params, chips=1, peak_flops=config.peak_flops,
                     hbm_bytes_per_s=a.hbm_bytes_per_s,
                     mfu=a.mfu)
        rows.append((p, t))
        print(f"act step, {b} rows per chip x {prompt_len} prompt tokens + {p['decode_tokens']} decoded: "
              f"weights {p['weight_bytes'] / 1e9:.4g} GB, peak {p['peak_bytes'] / 1e9:.4g} GB "
              f"({p['peak_bytes'] / config.hbm_bytes:.3f} of v5p HBM); compiled {p['flops']:.4e} FLOPs, "
              f"{p['bytes_accessed'] / 1e9:.2f} GB accessed (prefill + one decode step); "
              f"{1e3 * t:.4g} ms per call at MFU {a.mfu} -> {b / t:.0f} actions/s per chip")
    in_hbm = [(p, t) for p, t in rows if p["peak_bytes"] <= config.hbm_bytes] or rows[:1]
    fits = [(p, t) for p, t in in_hbm if t <= tick]
    best_p, best_t = max(in_hbm, key=lambda r: r[0]["batch"] / r[1])  # most actions/s per chip in HBM
    need = a.games * a.hz  # actions/s
    if fits:  # the largest batch whose call fits a tick: games per host = rows per chip x chips
        p, t = max(fits, key=lambda r: r[0]["batch"])
        per_host = p["batch"] * chips
        hosts = -(-a.games // per_host)
        how = f"{p['batch']} rows per chip in {1e3 * t:.1f} ms <= a {1e3 * tick:.0f} ms tick"
    else:  # no batch acts within a tick: throughput alone, each game slower than hz
        per_host = chips * best_p["batch"] / best_t / a.hz
        hosts = -(-need // (chips * best_p["batch"] / best_t))
        how = (f"no batch acts within a {1e3 * tick:.0f} ms tick (batch {rows[0][0]['batch']}: "
               f"{1e3 * rows[0][1]:.1f} ms), so each game acts below {a.hz:g} Hz; by throughput at "
               f"{best_p['batch']} rows per chip")
    hosts = int(hosts)
    print(f"inference: {a.games} games x {a.hz:g} Hz = {need:.0f} actions/s; one {chips}-chip host serves "
          f"{per_host:.1f} games ({how}) -> {hosts} inference hosts")
    return {"act_hbm_fraction": max(p["peak_bytes"] for p, _ in rows) / config.hbm_bytes,
            "act_ms": {int(p["batch"]): 1e3 * t for p, t in rows},
            "act_flops_per_row": best_p["flops"] / best_p["batch"],
            "games_per_inference_host": float(per_host), "inference_hosts": hosts}


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if "rl" in flags.FLAGS.config:
        plan_rl(flags.FLAGS.config, _MESH.value)
    else:
        plan(flags.FLAGS.config, _MESH.value)


if __name__ == "__main__":
    app.run(main)
