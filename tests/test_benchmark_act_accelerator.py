"""The accelerator act benchmark's path on the CPU: the bf16 policy of the plan's shape (tiny here), its
export, ours and the exported torch act on the same batched observations, and the table it prints."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_act_benchmark_times_ours_and_the_export_on_the_same_rows(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-m", "experiments.benchmarks.act_accelerator", f"--out={tmp_path}",
         "--variant=tiny", "--batches=1,3", "--reps=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ours = json.loads((tmp_path / "jax.json").read_text())
    theirs = json.loads((tmp_path / "torch.json").read_text())
    assert ours["frames"] == 2 and ours["weight_bytes"] > 0
    for b in ("1", "3"):
        assert len(ours["batches"][b]["tokens"]) == int(b)
        # bf16 on both sides, greedy: the exported torch act picks the same action tokens as ours
        assert theirs["batches"][b]["same_action"] == 1.0
        assert ours["batches"][b]["ms"] > 0 and theirs["batches"][b]["ms"] > 0
    lines = out.stdout.strip().splitlines()
    rows = [ln for ln in lines if ln.split(" | ")[0] in ("1", "3")]
    assert len(rows) == 2 and all(r.split(" | ")[-1] == "1.00" for r in rows)
    assert lines[-1].startswith("act_ms_1=") and "torch_ratio_3=" in lines[-1]
    assert (tmp_path / "table.txt").read_text().strip().splitlines()[-1] == lines[-1]
