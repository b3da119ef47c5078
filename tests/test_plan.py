"""The ahead-of-time plan (experiments.plan) runs on its :tiny config: the imitation stage's tiny step lowers
and compiles over 8 simulated devices and the program prints its figures, consistent with that config."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_plan_compiles_the_imitation_step_on_8_devices_and_prints_its_figures():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # Cheaper LLVM passes: compiling is all the plan does. "scanned": the program's own FLOP count, without
    # the two extra unrolled compiles (the smoke test is of the plan, not of the FLOP accounting).
    env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true").strip()
    cmd = [sys.executable, "-m", "experiments.plan", "--config=experiments/configs/plan.py:tiny",
           "--config.flops_from=scanned"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    # layer loop scan: the TPU program (the CPU backend would otherwise unroll the stacked layers)
    first = out.splitlines()[0]
    assert first.startswith("mesh data=1 fsdp=8 tensor=1 (8 simulated devices), rules axes.RULES, "
                            "layer loop scan,"), first
    # imitation.py:tiny: batch 8 x max_len 112, a history frame + the current one, 112x196 -> 28 image tokens
    assert "batch 8 x 112 tokens (2 frames x 28 image tokens, 112x196 px)" in out
    assert "cost_analysis counts per device (probe: sharded/unsharded matmul FLOPs = 0.1250" in out
    m = re.search(r"FLOPs per device: compiled (\S+) \(scanned\), analytic (\S+) .*; ratio (\S+)", out)
    compiled, analytic, ratio = (float(x) for x in m.groups())
    assert compiled > 0 and analytic > 0 and abs(ratio - compiled / analytic) < 1e-3
    last = dict(kv.split("=") for kv in out.strip().splitlines()[-1].split())
    assert set(last) == {"hbm_fraction_v5p", "flops_ratio"} and float(last["flops_ratio"]) == ratio
    assert 0 <= float(last["hbm_fraction_v5p"]) < 0.6  # the config's hbm_budget


def test_tiny_rl_plan_compiles_the_learner_step_with_its_reference_and_mixed_batch():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true").strip()
    cmd = [sys.executable, "-m", "experiments.plan", "--config=experiments/configs/plan.py:rl_tiny"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()
    # experiments/configs/rl.py:tiny: 16 GRPO rows, 1 DPO pair x 2 x a 4-step window, 4 replay rows
    head = "RL step on {'data': 1, 'fsdp': 4, 'tensor': 1}: batch 28 (GRPO 16, DPO 8, replay 4) x 112"
    step = [line for line in out if line.startswith("RL step on")]
    assert len(step) == 1 and step[0].startswith(head), out
    gb = {k: float(v) for k, v in re.findall(r"'(\w+_bytes)': '([-+.e\d]+) GB'", step[0])}
    assert set(gb) >= {"params_bytes", "opt_bytes", "reference_bytes", "peak_bytes"}
    assert gb["reference_bytes"] == gb["params_bytes"] > 0  # the reference: params only, sharded alike
    # AdamW's two moments (and its count) per parameter; the peak holds policy, moments and reference
    assert 1.99 * gb["params_bytes"] <= gb["opt_bytes"] < 2.1 * gb["params_bytes"]
    assert gb["peak_bytes"] >= 4 * gb["params_bytes"]
    last = re.fullmatch(r"hbm_fraction_v5p=([\d.]+) \(budget 0.6\) act_hbm_fraction=([-+.e\d]+) "
                        r"inference_hosts=(\d+)", out[-1])
    assert last and 0 <= float(last.group(1)) < 0.6 and 0 < float(last.group(2)) < 1, out[-1]


def test_tiny_rl_plan_compiles_the_policy_servers_act_step_and_sizes_the_inference_hosts():
    """The act program (prefill + grammar-constrained decode) compiled per chip at each configured batch:
    its FLOPs grow with the rows, its weights do not, and the hosts serve the configured games."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true").strip()
    cmd = [sys.executable, "-m", "experiments.plan", "--config=experiments/configs/plan.py:rl_tiny",
           "--config.act.batches=(1, 4)"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()
    act = [re.search(r"act step, (\d+) rows per chip x 112 prompt tokens \+ (\d+) decoded: weights (\S+) GB, "
                     r"peak (\S+) GB .* compiled (\S+) FLOPs, .*; (\S+) ms per call", line) for line in out
           if line.startswith("act step")]
    assert len(act) == 2 and all(act), out
    (b1, n1, w1, p1, f1, t1), (b4, n4, w4, p4, f4, t4) = (m.groups() for m in act)
    assert (b1, b4) == ("1", "4") and n1 == n4 and int(n1) > 1  # the decode loop: END within vocab.max_len
    assert w1 == w4 and float(p4) > float(p1) >= float(w1)  # the weights once; the KV cache grows with rows
    assert 3.0 < float(f4) / float(f1) <= 4.0 + 1e-6  # the FLOPs with the rows (the grammar's once)
    assert float(t4) >= float(t1) > 0
    inf = [line for line in out if line.startswith("inference: 128 games x 20 Hz = 2560 actions/s")]
    hosts = int(re.fullmatch(r"hbm_fraction_v5p=\S+ \(budget 0.6\) act_hbm_fraction=\S+ "
                             r"inference_hosts=(\d+)", out[-1]).group(1))
    assert len(inf) == 1 and inf[0].endswith(f"-> {hosts} inference hosts") and hosts >= 1
