"""Our numpy preprocessing against transformers' Qwen2-VL image processor (PIL path): bit-equal outputs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from hf_video_reference import hf_sample_frames, hf_video_patchify
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from transformers.image_utils import PILImageResampling, SizeDict
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.video_utils import VideoMetadata

from histeve_jax.data import image_processing as ip


def _image(height, width, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def hf():
    return Qwen2VLImageProcessorPil()


def test_smart_resize_matches_transformers():
    sizes = [
        (1, 1),
        (10, 10),
        (27, 29),
        (56, 56),
        (100, 150),
        (360, 640),
        (57, 301),
        (2000, 30),
        (4000, 3000),
    ]
    for height, width in sizes:
        for min_pixels, max_pixels in [
            (56 * 56, 28 * 28 * 1280),
            (128 * 28 * 28, 28 * 28 * 768),
            (3136, 12845056),
        ]:
            assert ip.smart_resize(height, width, 28, min_pixels, max_pixels) == hf_smart_resize(
                height, width, 28, min_pixels, max_pixels
            ), (height, width, min_pixels, max_pixels)
    with pytest.raises(ValueError, match="aspect ratio"):
        ip.smart_resize(10, 2500)


@pytest.mark.parametrize(
    "height,width",
    [
        (10, 10),  # tiny: scaled up to min_pixels
        (57, 301),  # not multiples of 28
        (364, 644),  # already multiples of 28: no resampling
        (360, 640),  # a game frame
        (30, 2000),  # extreme aspect ratio
        (1500, 1700),  # above max_pixels: scaled down
    ],
)
def test_pixel_values_bit_equal_to_transformers(hf, height, width):
    image = _image(height, width, seed=height * 7 + width)
    ref = hf(images=[image], return_tensors="np")
    ours = ip.process_images([image])
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    assert ours["pixel_values"].dtype == np.float32
    assert ours["pixel_values"].shape == ref["pixel_values"].shape
    # Bit-equal, not just close: same PIL resampling and the same float rounding.
    np.testing.assert_array_equal(ours["pixel_values"], ref["pixel_values"])


def test_min_max_pixels_configurable(hf):
    image = _image(300, 500, seed=3)
    config = ip.VisionPreprocessConfig(min_pixels=64 * 28 * 28, max_pixels=96 * 28 * 28)
    ref = Qwen2VLImageProcessorPil(min_pixels=config.min_pixels, max_pixels=config.max_pixels)(
        images=[image], return_tensors="np"
    )
    ours = ip.process_images([image], config)
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_array_equal(ours["pixel_values"], ref["pixel_values"])
    assert not np.array_equal(
        ours["image_grid_thw"], hf(images=[image], return_tensors="np")["image_grid_thw"]
    )


def test_batch_of_different_sizes_concatenated_in_order(hf):
    images = [_image(100, 150, 1), _image(57, 301, 2), _image(364, 644, 3), _image(100, 150, 4)]
    ref = hf(images=images, return_tensors="np")
    ours = ip.process_images(images)
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_array_equal(ours["pixel_values"], ref["pixel_values"])
    assert len(ours["pixel_values"]) == ours["image_grid_thw"].prod(axis=1).sum()


def test_pil_and_grayscale_inputs_match_transformers(hf):
    rgb = _image(90, 120, 5)
    gray = rgb[:, :, 0].copy()
    ref = hf(images=[Image.fromarray(rgb)], return_tensors="np")
    np.testing.assert_array_equal(
        ip.process_images([Image.fromarray(rgb)])["pixel_values"], ref["pixel_values"]
    )
    # transformers takes grayscale as a PIL "L" image; we also take the bare [H, W] array.
    ref = hf(images=[Image.fromarray(gray)], return_tensors="np")
    for image in (Image.fromarray(gray), gray):
        np.testing.assert_array_equal(ip.process_images([image])["pixel_values"], ref["pixel_values"])


def test_rescale_and_normalize_equals_transformers_arithmetic(hf):
    image = _image(28, 56, 6)
    chw = np.moveaxis(image, -1, 0)
    ref = hf.normalize(hf.rescale(chw, 1 / 255), ip.OPENAI_CLIP_MEAN, ip.OPENAI_CLIP_STD)
    np.testing.assert_array_equal(np.moveaxis(ip.rescale_and_normalize(image), -1, 0), ref)


def test_bad_images_raise_clear_errors():
    with pytest.raises(TypeError, match=r"images\[1\].*uint8"):
        ip.process_images([_image(30, 30), np.zeros((30, 30, 3), np.float32)])
    with pytest.raises(ValueError, match=r"images\[0\].*\[H, W, 3\]"):
        ip.process_images([np.zeros((30, 30, 4), np.uint8)])
    with pytest.raises(ValueError, match="empty"):
        ip.process_images([])


def _reference_video(hf, frames, config):
    """transformers' per-frame PIL resize, rescale and normalize, then its video patch stacking."""
    size = SizeDict(shortest_edge=config.min_pixels, longest_edge=config.max_pixels)
    processed = []
    for frame in frames:
        chw = hf.resize(np.moveaxis(frame, -1, 0), size=size, resample=PILImageResampling.BICUBIC, factor=28)
        processed.append(hf.normalize(hf.rescale(chw, 1 / 255), ip.OPENAI_CLIP_MEAN, ip.OPENAI_CLIP_STD))
    return hf_video_patchify(np.stack(processed))


@pytest.mark.parametrize("num_frames", [4, 5])  # 5: padded by repeating the last frame
def test_video_patches_equal_per_frame_reference(hf, num_frames):
    rng = np.random.default_rng(num_frames)
    frames = rng.integers(0, 256, (num_frames, 70, 130, 3), dtype=np.uint8)
    config = ip.VisionPreprocessConfig(min_pixels=56 * 56, max_pixels=140 * 140)
    ref_patches, t, h, w = _reference_video(hf, frames, config)
    ours = ip.process_videos([frames], fps=20.0, config=config)
    np.testing.assert_array_equal(ours["video_grid_thw"], [[t, h, w]])
    assert t == (num_frames + 1) // 2
    np.testing.assert_array_equal(ours["pixel_values_videos"], ref_patches)


def test_video_defaults_and_second_per_grid_ts():
    frames = np.random.default_rng(0).integers(0, 256, (4, 360, 640, 3), dtype=np.uint8)
    other = frames[:2, :200, :300]
    out = ip.process_videos([frames, other], fps=[20.0, None])
    # Qwen2VLVideoProcessor's defaults: at least 128*28*28 pixels per frame, at most 768*28*28.
    assert tuple(out["video_grid_thw"][0]) == (
        2,
        *[s // 14 for s in hf_smart_resize(360, 640, 28, 100352, 602112)],
    )
    # temporal_patch_size / fps, with transformers' 24 fps for a video without metadata.
    np.testing.assert_array_equal(out["second_per_grid_ts"], np.float32([2 / 20.0, 2 / 24.0]))
    assert len(out["pixel_values_videos"]) == out["video_grid_thw"].prod(axis=1).sum()


def test_cap_pixels_per_frame_bounds_long_videos():
    # 2000 frames: the share of 128000 tokens' pixels (90316 per frame) is below the floor
    # int(1.05 * 100352) = 105369, so the floor is the cap.
    assert ip.video_max_pixels(2000, ip.VIDEO_CONFIG, cap_pixels_per_frame=True) == 105369
    assert ip.video_max_pixels(8, ip.VIDEO_CONFIG, cap_pixels_per_frame=True) == 28 * 28 * 768
    assert ip.video_max_pixels(2000, ip.VIDEO_CONFIG, cap_pixels_per_frame=False) == 28 * 28 * 768


@pytest.mark.parametrize(
    "total,video_fps,kwargs",
    [
        (100, 30.0, {"fps": 2}),
        (31, 24.0, {"fps": 5}),
        (7, 10.0, {"fps": 1}),  # clamped to min_frames
        (1000, 29.97, {"fps": 3.3}),
        (95, 20.0, {"num_frames": 33}),
    ],
)
def test_sample_frame_indices_match_transformers(total, video_fps, kwargs):
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
    ref = hf_sample_frames(metadata, **kwargs)
    np.testing.assert_array_equal(ip.sample_frame_indices(total, video_fps, **kwargs), ref)


def test_sample_frame_indices_without_a_target_keeps_every_frame():
    np.testing.assert_array_equal(ip.sample_frame_indices(9, 20.0), np.arange(9))
    with pytest.raises(ValueError, match="mutually exclusive"):
        ip.sample_frame_indices(9, 20.0, fps=2, num_frames=4)


def test_an_image_is_a_one_frame_video():
    image = _image(84, 140, 11)
    video = ip.process_videos([image[None]], config=ip.IMAGE_CONFIG)
    single = ip.process_images([image])
    np.testing.assert_array_equal(video["video_grid_thw"], single["image_grid_thw"])
    np.testing.assert_array_equal(video["pixel_values_videos"], single["pixel_values"])
