"""Input-pipeline supply vs the 7B policy's demand on a TPU v5p host.

Supply: samples per CPU-second of the imitation pipeline with the ``qwen7b`` features (history 3 + the
current frame at 252x448, Qwen2.5-VL patches, prompt and Dual-Mouse targets), measured here in one process
(grain with ``worker_count=0`` and one read thread, so the process's CPU time is the pipeline's), on
synthetic demonstrations stored as 640x360 JPEG frames (the contractor resolution) and, the layout we
recommend for training, stored already at the model's 252x448.

Demand: training FLOPs per sample = 6 x 8.3e9 x (tokens per sample, measured from the pipeline's output)
plus the vision tower, 6 x 0.67e9 x (patches per sample), at 50% MFU of v5p's 459 TFLOP/s bf16 per chip,
4 chips per host. Per-host supply assumes the 208 vCPUs of a v5p VM host, 8 of them left to the trainer.

    python -m experiments.benchmarks.pipeline_throughput
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from experiments.configs import imitation
from histeve_jax.data import pipeline as P
from histeve_jax.data import records as R
from histeve_jax.data import synthetic

LLM_PARAMS = 8.3e9
VISION_PARAMS = 0.67e9  # Qwen2.5-VL-7B's ViT (32 blocks, width 1280) and merger
V5P_BF16_FLOPS = 459e12
MFU = 0.5
CHIPS_PER_HOST = 4
HOST_VCPUS = 208
TRAINER_VCPUS = 8


def _resized_copy(src: str, dst: str, size: tuple[int, int]) -> None:
    """The same episodes with frames stored at ``size`` (H, W), as ``converters.vpt`` ``resize=`` writes."""
    from histeve_jax.data.image_processing import resize_image

    eps: dict[str, list[R.StepRecord]] = {}
    for p in R.shard_paths(src):
        for r in R.read_shard(p):
            r.frame = R.encode_frame(resize_image(R.decode_frame(r.frame), *size), "jpeg")
            eps.setdefault(r.episode_id, []).append(r)
    R.write_episodes(dst, eps.values(), prefix="resized")


def measure(directory: str, spec: P.FeatureSpec, samples: int, batch_size: int = 8) -> tuple[float, float]:
    """(samples per CPU-second, mean tokens per sample) over ``samples`` samples after a warm-up batch."""
    opts = P.LoaderOptions(batch_size=batch_size, shard_count=1, shard_index=0, read_threads=1, seed=0)
    batches = P.make_batches(directory, spec, opts)
    next(batches)  # tokenizer load, first reads
    tokens = []
    cpu0 = time.process_time()
    for _ in range(samples // batch_size):
        b = next(batches)
        tokens.append(b["attention_mask"].sum(1))
    cpu = time.process_time() - cpu0
    return (samples // batch_size) * batch_size / cpu, float(np.concatenate(tokens).mean())


def main() -> None:
    c = imitation.get_config("qwen7b").data
    spec = P.FeatureSpec(kind="demo", history=c.history, stride=c.stride, image_size=tuple(c.image_size),
                         max_len=c.max_len, codebook=c.codebook)
    with tempfile.TemporaryDirectory() as tmp:
        raw, small = os.path.join(tmp, "raw"), os.path.join(tmp, "resized")
        synthetic.write_demo_dataset(raw, episodes=6, length=40, height=360, width=640, seed=0)
        _resized_copy(raw, small, spec.image_size)
        raw_rate, _ = measure(raw, spec, 96)
        rate, tokens = measure(small, spec, 192)

    patches = spec.num_images * spec.patches_per_image
    flops = 6 * LLM_PARAMS * tokens + 6 * VISION_PARAMS * patches
    demand = CHIPS_PER_HOST * V5P_BF16_FLOPS * MFU / flops
    cores = HOST_VCPUS - TRAINER_VCPUS
    supply = rate * cores
    print(f"sample: {spec.num_images} frames of {spec.image_size[0]}x{spec.image_size[1]}, "
          f"{tokens:.0f} tokens, {patches} patches; {flops:.3e} training FLOPs")
    print(f"pipeline: {raw_rate:.1f} samples/s/core from 640x360 frames, {rate:.1f} from frames stored at "
          f"{spec.image_size[0]}x{spec.image_size[1]} (used below)")
    print(f"v5p host: {CHIPS_PER_HOST} chips x {V5P_BF16_FLOPS / 1e12:.0f} TFLOP/s x {MFU:.0%} MFU consume "
          f"{demand:.1f} samples/s; {cores} of {HOST_VCPUS} vCPUs supply {supply:.0f} samples/s")
    print(f"samples_per_s_per_core={rate:.2f} demand_per_host={demand:.2f} ratio={supply / demand:.1f}")


if __name__ == "__main__":
    main()
