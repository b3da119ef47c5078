"""Greedy generation after an image prompt, with a tiny random Qwen2.5-VL or a HF checkpoint.

    python -m experiments.generate                       # tiny random model, random image
    python -m experiments.generate --model_dir DIR [--image PATH] [--prompt "Describe the image."]

Prints the prompt length, the generated token ids, (with a real checkpoint) their text, and timings.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from histeve_jax.data.image_processing import VisionPreprocessConfig, process_images
from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLModel, SamplingOptions, generate, load_hf, tiny


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", default=None, help="HF save_pretrained dir; default: a tiny random model")
    p.add_argument("--image", default=None, help="image file; default: random pixels")
    p.add_argument("--prompt", default="Describe the image.")
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)

    tokenizer = None
    if a.model_dir:
        model = load_hf(a.model_dir, dtype=jnp.dtype(a.dtype))
        from histeve_jax.data.tokenizer import load_qwen_tokenizer

        if os.path.exists(os.path.join(a.model_dir, "tokenizer.json")):
            tokenizer = load_qwen_tokenizer(a.model_dir)
        elif model.config.text.vocab_size >= 151665:  # a real vocabulary: the packaged Qwen tokenizer fits
            tokenizer = load_qwen_tokenizer()
    else:
        model = Qwen2_5_VLModel(tiny(), rngs=nnx.Rngs(0))
    cfg = model.config

    if a.image:
        from PIL import Image

        image = np.asarray(Image.open(a.image).convert("RGB"))
    else:
        image = np.random.default_rng(0).integers(0, 256, (112, 168, 3), dtype=np.uint8)
    vis = process_images([image], VisionPreprocessConfig(max_pixels=28 * 28 * 256))
    grid = vis["image_grid_thw"]
    n_img = int(grid[0].prod()) // cfg.vision.spatial_merge_size**2
    block = [cfg.vision_start_token_id] + [cfg.image_token_id] * n_img + [cfg.vision_end_token_id]
    if tokenizer is not None:
        head = tokenizer("<|im_start|>user\n")["input_ids"]
        tail = tokenizer(f"{a.prompt}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        stop = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    else:
        head, tail, stop = [1, 2, 3], [4, 5, 6, 7], ()
    ids = np.asarray([head + block + tail], np.int32)

    kw = dict(pixel_values=jnp.asarray(vis["pixel_values"]), image_grid_thw=grid, stop_token_ids=stop)
    t0 = time.perf_counter()
    out = generate(model, ids, None, options=SamplingOptions(a.max_new_tokens), **kw)
    jax.block_until_ready(out.tokens)
    t1 = time.perf_counter()
    out = generate(model, ids, None, options=SamplingOptions(a.max_new_tokens), **kw)
    jax.block_until_ready(out.tokens)
    t2 = time.perf_counter()
    toks = np.asarray(out.tokens)[0, : int(out.lengths[0])]
    print(f"prompt: {ids.shape[1]} tokens ({n_img} image tokens, grid {grid.tolist()})")
    print(f"generated ids: {toks.tolist()}")
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(toks, skip_special_tokens=True)!r}")
    print(f"first call (compile + run) {t1 - t0:.2f} s, warm call {(t2 - t1) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
