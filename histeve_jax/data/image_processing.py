"""Qwen2.5-VL image and video preprocessing in numpy (no torch), equal to the Hugging Face processor.

The reference is transformers' PIL/numpy path (``Qwen2VLImageProcessorPil``): PIL bicubic resize of the
uint8 image to a ``smart_resize`` size, ``float64 * (1/255) -> float32`` rescale, float32 CLIP
normalisation, then a patch flattening that orders patches merge-window by merge-window. Our outputs are
bit-equal to it. (The torchvision "fast" processor resizes with torch's antialiased bicubic and fuses the
rescale into the normalisation, so it differs from the PIL path by up to about one uint8 level.)

Rescale and normalise act on uint8 values only, so they are one 256-entry lookup table per channel,
computed with the reference's exact float arithmetic; the lookup runs after the patch transpose, on bytes.
An image is a one-frame video padded to ``temporal_patch_size`` by repeating its last frame, which is what
the reference's temporal broadcast does, so images and videos share one code path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

# OpenAI CLIP statistics, as transformers.image_utils.OPENAI_CLIP_MEAN / _STD.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Fallback frame rate when a video comes without one: transformers' VideoMetadata.sampled_fps uses 24.
DEFAULT_VIDEO_FPS = 24.0


@dataclasses.dataclass(frozen=True)
class VisionPreprocessConfig:
    """Resize bounds and patch geometry; the defaults are ``Qwen2VLImageProcessor``'s."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Side lengths are resized to multiples of this (one merge window of patches)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C * T * P * P."""
        return 3 * self.temporal_patch_size * self.patch_size**2


IMAGE_CONFIG = VisionPreprocessConfig()
# Qwen2VLVideoProcessor's defaults: videos get fewer pixels per frame than images.
VIDEO_CONFIG = VisionPreprocessConfig(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)
# The bounds Qwen2.5-VL-*-Instruct checkpoints ship in preprocessor_config.json (max 16384 tokens an image).
QWEN2_5_VL_CHECKPOINT_IMAGE_CONFIG = VisionPreprocessConfig(min_pixels=3136, max_pixels=12845056)


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280
) -> tuple[int, int]:
    """(height, width) divisible by ``factor``, with area in [min_pixels, max_pixels], aspect kept."""
    if min(height, width) <= 0:
        raise ValueError(f"image must have positive height and width, got {height}x{width}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def as_rgb_uint8(image: np.ndarray | Image.Image, name: str = "image") -> np.ndarray:
    """An [H, W, 3] uint8 array from a uint8 HWC array (RGB or grayscale HxW) or a PIL image."""
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise TypeError(f"{name}: expected uint8 pixels, got dtype {image.dtype}")
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"{name}: expected shape [H, W, 3] (or [H, W]), got {image.shape}")
    return image


def resize_image(image_hwc: np.ndarray, height: int, width: int) -> np.ndarray:
    """PIL bicubic resize of an [H, W, 3] uint8 image, as the reference PIL path does."""
    if image_hwc.shape[:2] == (height, width):
        return image_hwc  # PIL returns an exact copy for an unchanged size
    return np.asarray(Image.fromarray(image_hwc).resize((width, height), resample=Image.BICUBIC))


Crop = tuple[int, int, int, int]  # (top, bottom, left, right) pixels


def crop_image(image_hwc: np.ndarray, crop: Crop, scale: float = 1.0) -> np.ndarray:
    """``crop`` of an [H, W, 3] uint8 image, resized (``resize_image``) ``scale`` times."""
    t, b, l, r = crop
    return resize_image(np.ascontiguousarray(image_hwc[t:b, l:r]), round((b - t) * scale),
                        round((r - l) * scale))


def parse_crop(text: str, name: str = "crop") -> Crop | None:
    """``"top,bottom,left,right"`` -> the crop's four ints; "" -> None; else an error naming ``name``."""
    if not str(text).strip():
        return None
    parts = str(text).split(",")
    try:
        if len(parts) != 4:
            raise ValueError
        return tuple(int(x) for x in parts)  # type: ignore[return-value]
    except ValueError:
        raise ValueError(f"{name}={text!r}: want 'top,bottom,left,right' (4 ints) or ''") from None


_LUT_CACHE: dict[tuple, np.ndarray] = {}


def normalize_lut(
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
    rescale_factor: float = 1 / 255,
) -> np.ndarray:
    """[C, 256] float32: the normalised value of every uint8 level per channel, bit-equal to the reference."""
    key = (tuple(mean), tuple(std), rescale_factor)
    lut = _LUT_CACHE.get(key)
    if lut is None:
        levels = np.arange(256, dtype=np.float64)
        # The reference rescales in float64 then casts, and normalises in float32.
        rescaled = (levels * rescale_factor).astype(np.float32)
        mean32 = np.asarray(mean, dtype=np.float32)[:, None]
        std32 = np.asarray(std, dtype=np.float32)[:, None]
        lut = ((rescaled[None, :] - mean32) / std32).astype(np.float32)
        lut.setflags(write=False)
        _LUT_CACHE[key] = lut
    return lut


def rescale_and_normalize(image_hwc: np.ndarray, config: VisionPreprocessConfig = IMAGE_CONFIG) -> np.ndarray:
    """[H, W, 3] uint8 -> [H, W, 3] float32, ``(x / 255 - mean) / std`` with the reference's rounding."""
    lut = normalize_lut(config.image_mean, config.image_std, config.rescale_factor)
    return lut[np.arange(3), image_hwc]


def _lookup(x: np.ndarray, channel_axis: int, config: VisionPreprocessConfig) -> np.ndarray:
    """Normalised float32 values of contiguous uint8 ``x`` whose channel axis is ``channel_axis``."""
    lut = normalize_lut(config.image_mean, config.image_std, config.rescale_factor)
    # One flat table indexed by (channel * 256 + level): a single gather. The index is built as intp in
    # place, since numpy would convert any narrower index to intp anyway (an extra full-size copy).
    index = x.astype(np.intp)
    moved = np.moveaxis(index, channel_axis, 0)
    for c in range(1, x.shape[channel_axis]):
        moved[c] += 256 * c
    return lut.reshape(-1)[index]


def patchify_frames(frames_thwc: np.ndarray, config: VisionPreprocessConfig) -> tuple[np.ndarray, tuple]:
    """[F, H, W, 3] uint8 frames -> (patches [t*h*w, C*T*P*P] float32, (t, h, w)).

    Frames are padded to a multiple of ``temporal_patch_size`` by repeating the last one. Patch order is
    (t, h/merge, w/merge, merge, merge) and each patch is flattened as (C, T, P, P), as the reference does.
    """
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    num_frames, height, width, channels = frames_thwc.shape
    if height % (p * m) or width % (p * m):
        raise ValueError(f"frames of {height}x{width} are not multiples of patch*merge={p * m}; resize first")
    if pad := -num_frames % tp:
        frames_thwc = np.concatenate([frames_thwc, np.repeat(frames_thwc[-1:], pad, axis=0)], axis=0)
        num_frames += pad
    grid_t, grid_h, grid_w = num_frames // tp, height // p, width // p
    x = frames_thwc.reshape(grid_t, tp, grid_h // m, m, p, grid_w // m, m, p, channels)
    # -> [t, h/m, w/m, m, m, C, T, P, P]; transposing bytes is 4x cheaper than transposing floats.
    x = np.ascontiguousarray(x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7))
    patches = _lookup(x, channel_axis=-4, config=config)
    return patches.reshape(grid_t * grid_h * grid_w, channels * tp * p * p), (grid_t, grid_h, grid_w)


def _single_image_patches(image: np.ndarray, config: VisionPreprocessConfig) -> tuple[np.ndarray, tuple]:
    """Patches of one image, broadcast over the temporal patch (the reference's one-frame layout)."""
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    height, width, channels = image.shape
    grid_h, grid_w = height // p, width // p
    x = image.reshape(grid_h // m, m, p, grid_w // m, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
    values = _lookup(np.ascontiguousarray(x), channel_axis=-3, config=config)
    values = values.reshape(grid_h * grid_w, channels, 1, p * p)
    patches = np.empty((grid_h * grid_w, channels, tp, p * p), dtype=np.float32)
    patches[...] = values  # the temporal copies, written once
    return patches.reshape(grid_h * grid_w, channels * tp * p * p), (1, grid_h, grid_w)


def process_images(
    images: Sequence[np.ndarray | Image.Image], config: VisionPreprocessConfig = IMAGE_CONFIG
) -> dict[str, np.ndarray]:
    """``pixel_values`` [N, C*T*P*P] float32 and ``image_grid_thw`` [n, 3] int64 for a list of images.

    Images may differ in size; their patches are concatenated in order, as ``Qwen2VLImageProcessor`` does.
    """
    if isinstance(images, (np.ndarray, Image.Image)):
        images = [images]
    if len(images) == 0:
        raise ValueError("process_images: got an empty list of images")
    all_patches, grids = [], []
    for i, image in enumerate(images):
        image = as_rgb_uint8(image, name=f"images[{i}]")
        height, width = smart_resize(
            image.shape[0], image.shape[1], config.factor, config.min_pixels, config.max_pixels
        )
        patches, grid = _single_image_patches(resize_image(image, height, width), config)
        all_patches.append(patches)
        grids.append(grid)
    pixel_values = all_patches[0] if len(all_patches) == 1 else np.concatenate(all_patches, axis=0)
    return {"pixel_values": pixel_values, "image_grid_thw": np.asarray(grids, dtype=np.int64)}


def video_max_pixels(
    num_frames: int,
    config: VisionPreprocessConfig,
    cap_pixels_per_frame: bool,
    max_video_tokens: int = 128000,
) -> int:
    """Per-frame pixel cap; with ``cap_pixels_per_frame``, a share of the whole video's pixel budget."""
    if not cap_pixels_per_frame:
        return config.max_pixels
    total_pixels = int(max_video_tokens * config.factor * config.factor * 0.9)
    per_frame = total_pixels * config.temporal_patch_size // num_frames
    return max(min(config.max_pixels, per_frame), int(config.min_pixels * 1.05))


def process_videos(
    videos: Sequence[np.ndarray],
    fps: float | Sequence[float | None] | None = None,
    config: VisionPreprocessConfig = VIDEO_CONFIG,
    *,
    cap_pixels_per_frame: bool = False,
    max_video_tokens: int = 128000,
) -> dict[str, np.ndarray]:
    """``pixel_values_videos`` [N, C*T*P*P], ``video_grid_thw`` [n, 3], ``second_per_grid_ts`` [n].

    Each video is [F, H, W, 3] uint8 frames (already sampled). ``fps`` is the frame rate of those frames,
    one per video or shared; ``second_per_grid_ts = temporal_patch_size / fps`` as ``Qwen2_5_VLProcessor``
    computes it, with 24 fps when unknown as transformers assumes. It is float32, as the reference's torch
    tensors are.
    """
    if isinstance(videos, np.ndarray):
        videos = [videos]
    if len(videos) == 0:
        raise ValueError("process_videos: got an empty list of videos")
    if fps is None or isinstance(fps, (int, float)):
        fps = [fps] * len(videos)
    if len(fps) != len(videos):
        raise ValueError(f"process_videos: got {len(fps)} fps values for {len(videos)} videos")
    all_patches, grids, seconds = [], [], []
    for i, video in enumerate(videos):
        video = np.asarray(video)
        if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3 or video.shape[0] == 0:
            raise ValueError(
                f"videos[{i}]: expected uint8 frames [F, H, W, 3], got {video.dtype} {video.shape}"
            )
        num_frames, in_h, in_w = video.shape[:3]
        max_pixels = video_max_pixels(num_frames, config, cap_pixels_per_frame, max_video_tokens)
        height, width = smart_resize(in_h, in_w, config.factor, config.min_pixels, max_pixels)
        if (height, width) != (in_h, in_w):
            video = np.stack([resize_image(frame, height, width) for frame in video])
        patches, grid = patchify_frames(video, config)
        all_patches.append(patches)
        grids.append(grid)
        frame_rate = DEFAULT_VIDEO_FPS if fps[i] is None else float(fps[i])
        if frame_rate <= 0:
            raise ValueError(f"videos[{i}]: fps must be positive, got {frame_rate}")
        seconds.append(config.temporal_patch_size / frame_rate)
    return {
        "pixel_values_videos": np.concatenate(all_patches, axis=0),
        "video_grid_thw": np.asarray(grids, dtype=np.int64),
        "second_per_grid_ts": np.asarray(seconds, dtype=np.float32),
    }


def sample_frame_indices(
    total_num_frames: int,
    video_fps: float | None = None,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    temporal_patch_size: int = 2,
    min_frames: int = 4,
    max_frames: int = 768,
) -> np.ndarray:
    """Frame indices to keep, as ``Qwen2VLVideoProcessor.sample_frames`` picks them (int32).

    ``num_frames`` (rounded to the temporal patch) or a target ``fps`` given the source ``video_fps``.
    The sampled frames then run at ``len(indices) / total_num_frames * video_fps`` frames per second.
    """
    if fps is not None and num_frames is not None:
        raise ValueError("`num_frames` and `fps` are mutually exclusive")
    if num_frames is not None:
        num_frames = round(num_frames / temporal_patch_size) * temporal_patch_size
    elif fps is not None:
        if video_fps is None:
            raise ValueError("sampling at a target fps needs the source video_fps")
        max_frames = math.floor(min(max_frames, total_num_frames) / temporal_patch_size) * temporal_patch_size
        num_frames = total_num_frames / video_fps * fps
        num_frames = min(max(num_frames, min_frames), max_frames, total_num_frames)
        num_frames = math.floor(num_frames / temporal_patch_size) * temporal_patch_size
    else:
        return np.arange(total_num_frames, dtype=np.int32)
    if num_frames > total_num_frames or num_frames <= 0:
        raise ValueError(f"cannot sample {num_frames} frames from a video of {total_num_frames}")
    # The reference is torch.arange(0, total, total / num_frames).int(): torch steps in float64, stores
    # float32, then truncates; the float32 rounding can move a value onto the next integer.
    step = total_num_frames / num_frames
    count = math.ceil(total_num_frames / step)
    return (np.arange(count, dtype=np.float64) * step).astype(np.float32).astype(np.int32)
