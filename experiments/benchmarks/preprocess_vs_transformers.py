"""Images/s through our Qwen2.5-VL preprocessing vs transformers' image processor, one 640x360 frame a call.

The transformers side is ``Qwen2VLImageProcessorPil`` (its torchvision processor needs torchvision, which
is not installed here), with ``return_tensors="np"``. Both produce bit-equal ``pixel_values``.

    python -m experiments.benchmarks.preprocess_vs_transformers [--iters 200] [--height 360 --width 640]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def images_per_second(fn, image: np.ndarray, iters: int) -> float:
    """Best-of-three throughput of ``fn([image])`` over ``iters`` calls (the best resists machine noise)."""
    fn([image])  # warm-up: LUT, imports, allocator
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            fn([image])
        best = max(best, iters / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--width", type=int, default=640)
    args = parser.parse_args()

    from transformers import Qwen2VLImageProcessorPil

    from histeve_jax.data.image_processing import process_images

    image = np.random.default_rng(0).integers(0, 256, (args.height, args.width, 3), dtype=np.uint8)
    hf = Qwen2VLImageProcessorPil()
    ref = hf(images=[image], return_tensors="np")["pixel_values"]
    if not np.array_equal(process_images([image])["pixel_values"], ref):
        raise SystemExit("pixel_values differ from transformers'; not benchmarking")

    ours = images_per_second(process_images, image, args.iters)
    theirs = images_per_second(lambda ims: hf(images=ims, return_tensors="np"), image, args.iters)
    print(f"frame={args.width}x{args.height} pixel_values={tuple(ref.shape)} iters={args.iters}")
    print(f"ours_per_s={ours:.1f} hf_per_s={theirs:.1f} ratio={ours / theirs:.2f}")


if __name__ == "__main__":
    main()
