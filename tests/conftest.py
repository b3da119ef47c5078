"""Shared fixtures. Tests run offline on CPU; the Qwen2.5-VL fixtures build tiny random HF models."""

import importlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# ---------------------------------------------------------------------- Qwen2.5-VL (tiny, random, fp32)


def qwen_tiny_hf(cfg, seed: int = 0):
    """A random `transformers` Qwen2_5_VLForConditionalGeneration matching our config (eager attention)."""
    import torch
    from transformers import Qwen2_5_VLConfig as HFConfig
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    hf_cfg = HFConfig(**cfg.to_hf_dict())
    model = Qwen2_5_VLForConditionalGeneration(hf_cfg).eval()
    # Non-trivial norm scales and biases, so a transposed or skipped tensor shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


# fp32 logits and hidden states against transformers, as measured over the 20 comparisons of the logits,
# weights and policy tests (CPU): max |ours - ref| <= 5.2e-7 * max|ref|, and <= 3.6e-6 * |ref| per element
# where |ref| >= 0.1 * max|ref|. The bound allows about 4x that: 2e-6 of the largest value plus 1e-5 of
# each element's own (small values are held to the absolute part, large ones also to their own scale).
REF_ATOL_OF_MAX = 2e-6
REF_RTOL = 1e-5


def assert_close_to_reference(ours, ref, where=None) -> None:
    """|ours - ref| <= REF_ATOL_OF_MAX * max|ref| + REF_RTOL * |ref| elementwise (over ``where``)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if where is not None:
        ours, ref = ours[where], ref[where]
    atol = REF_ATOL_OF_MAX * np.abs(ref).max()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, rtol=REF_RTOL, atol=atol, err_msg=f"max|diff|/max|ref| = {rel:.2e}")


@pytest.fixture(scope="session")
def qwen_tiny_dir(tmp_path_factory):
    """(our config, HF torch model, its save_pretrained dir) for the tiny test model."""
    from histeve_jax.models.qwen2_5_vl import tiny

    cfg = tiny()
    hf = qwen_tiny_hf(cfg)
    d = str(tmp_path_factory.mktemp("qwen_tiny"))
    hf.save_pretrained(d)
    return cfg, hf, d


def qwen_images(sizes, seed: int = 0):
    """pixel_values [N, 1176] and image_grid_thw [n, 3] from transformers' Qwen2-VL image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 256)
    rng = np.random.default_rng(seed)
    ims = [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in sizes]
    out = proc(images=ims, return_tensors="np")
    return out["pixel_values"].astype(np.float32), out["image_grid_thw"].astype(np.int64)


def qwen_vision_block(cfg, grid, token_id):
    """`<|vision_start|>` + N x placeholder + `<|vision_end|>` for one grid (N = t*h*w / merge^2)."""
    t, h, w = (int(x) for x in grid)
    n = t * h * w // cfg.vision.spatial_merge_size**2
    return [cfg.vision_start_token_id] + [token_id] * n + [cfg.vision_end_token_id]


@pytest.fixture(scope="session")
def qwen_tiny_flax(qwen_tiny_dir):
    """Our model loaded (scanned) from the tiny HF checkpoint."""
    from histeve_jax.models.qwen2_5_vl import load_hf

    return load_hf(qwen_tiny_dir[2], config_overrides={"scan_layers": True})


# ---------------------------------------------------------------------- installed dependencies and the game


def missing_dependency(msg: str) -> None:
    """Skip the calling test (or module) for a missing installed dependency; under CI=true fail instead, so a
    CI run without it cannot pass with its tests unrun."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {msg}", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def require_module(name: str, install: str):
    """The imported module ``name``; missing: ``missing_dependency`` (skip, or fail under CI=true)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing_dependency(f"the {name} package is not installed ({install}): {e}")



def pytest_runtest_setup(item):
    """``@pytest.mark.game`` tests skip without minetest or Xvfb, except under CI=true, where they fail."""
    if item.get_closest_marker("game") is None:
        return
    from histeve_jax.envs.luanti import minetest_available

    if not minetest_available():
        missing_dependency("minetest or Xvfb not installed (apt-get install minetest xvfb)")
