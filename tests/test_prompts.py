"""The prompt builder against transformers' Qwen2_5_VLProcessor built from the real tokenizer."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from hf_video_reference import hf_video_patchify
from PIL import Image
from transformers import BatchFeature, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil
from transformers.image_utils import PILImageResampling, SizeDict
from transformers.video_utils import VideoMetadata

from histeve_jax.data import image_processing as ip
from histeve_jax.data import tokenizer as tk
from histeve_jax.data.prompts import QwenVLProcessor, pad_batch


class ReferenceVideoProcessor:
    """Qwen2VLVideoProcessor's outputs without torchvision: transformers' PIL resize/rescale/normalize per
    frame and transformers' own video patchify (see hf_video_reference). Resizing is the one step that
    differs from the torchvision processor."""

    merge_size = 2
    temporal_patch_size = 2

    def __init__(self, image_processor, config):
        self.hf = image_processor
        self.size = SizeDict(shortest_edge=config.min_pixels, longest_edge=config.max_pixels)

    def __call__(self, videos, video_metadata=None, **kwargs):
        patches, grids = [], []
        for video in videos:
            frames = []
            for frame in video:
                chw = self.hf.resize(
                    np.moveaxis(frame, -1, 0), self.size, PILImageResampling.BICUBIC, factor=28
                )
                frames.append(
                    self.hf.normalize(self.hf.rescale(chw, 1 / 255), ip.OPENAI_CLIP_MEAN, ip.OPENAI_CLIP_STD)
                )
            p, t, h, w = hf_video_patchify(np.stack(frames))
            patches.append(p)
            grids.append([t, h, w])
        metadata = video_metadata or [VideoMetadata(total_num_frames=len(v)) for v in videos]
        return BatchFeature(
            {
                "pixel_values_videos": np.concatenate(patches),
                "video_grid_thw": np.asarray(grids),
                "video_metadata": metadata,
            }
        )


class ProcessorWithoutTorchvision(Qwen2_5_VLProcessor):
    """The real processor; only its class check on the video processor (a torchvision class) is skipped."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor":
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


VIDEO_CONFIG = ip.VisionPreprocessConfig(min_pixels=56 * 56, max_pixels=112 * 112)


@pytest.fixture(scope="module")
def tok():
    return tk.load_qwen_tokenizer()


@pytest.fixture(scope="module")
def hf_processor(tok):
    image_processor = Qwen2VLImageProcessorPil()
    video_processor = ReferenceVideoProcessor(image_processor, VIDEO_CONFIG)
    return ProcessorWithoutTorchvision(
        image_processor, tok, video_processor, chat_template=tk.QWEN2_5_VL_CHAT_TEMPLATE
    )


@pytest.fixture(scope="module")
def ours(tok):
    return QwenVLProcessor(tok, video_config=VIDEO_CONFIG)


def _image(height, width, seed):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _two_image_messages():
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare the two views. "},
                {"type": "image", "image": _image(100, 150, 1)},
                {"type": "text", "text": "before and after "},
                {"type": "image", "image": _image(57, 301, 2)},
                {"type": "text", "text": "— what changed?"},
            ],
        }
    ]


def test_render_matches_the_jinja_chat_template(ours, tok):
    cases = [
        _two_image_messages(),
        [{"role": "system", "content": "Act."}, {"role": "user", "content": "go"}],
        [
            {"role": "user", "content": [{"type": "video", "video": None}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "attack"},
            {"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
        ],
    ]
    for messages in cases:
        for add_generation_prompt in (False, True):
            for add_vision_id in (False, True):
                expected = tok.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    add_vision_id=add_vision_id,
                )
                rendered = ours.render(
                    messages, add_generation_prompt=add_generation_prompt, add_vision_id=add_vision_id
                )
                assert rendered == expected


def test_two_images_and_text_match_transformers(ours, hf_processor):
    messages = _two_image_messages()
    for item in messages[0]["content"]:  # transformers' chat path takes PIL images; so do we
        if item["type"] == "image":
            item["image"] = Image.fromarray(item["image"])
    ref = hf_processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="np"
    )
    text = hf_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [item["image"] for item in messages[0]["content"] if item["type"] == "image"]
    np.testing.assert_array_equal(
        hf_processor(text=[text], images=images)["input_ids"][0], ref["input_ids"][0]
    )
    for sample in (ours.from_messages(messages), ours(text, images=images)):
        np.testing.assert_array_equal(sample["input_ids"], ref["input_ids"][0])
        np.testing.assert_array_equal(sample["attention_mask"], ref["attention_mask"][0])
        np.testing.assert_array_equal(sample["mm_token_type_ids"], ref["mm_token_type_ids"][0])
        np.testing.assert_array_equal(sample["image_grid_thw"], ref["image_grid_thw"])
        np.testing.assert_array_equal(sample["pixel_values"], ref["pixel_values"])
    grids = ref["image_grid_thw"]
    assert (ref["input_ids"][0] == tk.IMAGE_PAD_ID).sum() == grids.prod(axis=1).sum() // 4


def test_video_matches_transformers(ours, hf_processor):
    frames = np.random.default_rng(7).integers(0, 256, (5, 90, 160, 3), dtype=np.uint8)
    image = _image(64, 64, 8)
    text = (
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>then "
        "<|vision_start|><|image_pad|><|vision_end|>ok<|im_end|>\n<|im_start|>assistant\n"
    )
    metadata = [VideoMetadata(total_num_frames=5, fps=20.0, frames_indices=list(range(5)))]
    ref = hf_processor(
        text=[text], images=[image], videos=[frames], video_metadata=metadata, return_tensors="pt"
    )
    sample = ours(text, images=[image], videos=[frames], video_fps=20.0)
    np.testing.assert_array_equal(sample["input_ids"], ref["input_ids"][0].numpy())
    np.testing.assert_array_equal(sample["mm_token_type_ids"], ref["mm_token_type_ids"][0].numpy())
    np.testing.assert_array_equal(sample["video_grid_thw"], ref["video_grid_thw"].numpy())
    np.testing.assert_array_equal(sample["pixel_values_videos"], ref["pixel_values_videos"].numpy())
    np.testing.assert_array_equal(sample["pixel_values"], ref["pixel_values"].numpy())
    # temporal_patch_size / fps, as float32 like the processor's torch tensor.
    np.testing.assert_array_equal(sample["second_per_grid_ts"], ref["second_per_grid_ts"].numpy())
    assert sample["second_per_grid_ts"].dtype == np.float32 and sample["second_per_grid_ts"][0] == np.float32(
        0.1
    )
    t, h, w = sample["video_grid_thw"][0]
    assert (sample["input_ids"] == tk.VIDEO_PAD_ID).sum() == t * h * w // 4


def test_video_in_messages_expands_by_construction(ours):
    frames = np.random.default_rng(9).integers(0, 256, (3, 90, 160, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 4.0}]}]
    sample = ours.from_messages(messages)
    expected_grid = ip.process_videos([frames], fps=4.0, config=VIDEO_CONFIG)
    np.testing.assert_array_equal(sample["video_grid_thw"], expected_grid["video_grid_thw"])
    t, h, w = expected_grid["video_grid_thw"][0]
    ids = sample["input_ids"]
    start = int(np.flatnonzero(ids == tk.VISION_START_ID)[0])
    n = t * h * w // 4
    assert (ids[start + 1 : start + 1 + n] == tk.VIDEO_PAD_ID).all()
    assert ids[start + 1 + n] == tk.VISION_END_ID
    np.testing.assert_array_equal(sample["second_per_grid_ts"], [np.float32(0.5)])


def test_target_ids_are_the_assistant_positions(ours, tok):
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": _image(56, 56, 3)}, {"type": "text", "text": "act"}],
        }
    ]
    targets = [151660, 10, 20, 151700]  # action tokens may be any ids, including unused embedding rows
    sample = ours.from_messages(messages, target_ids=targets)
    prompt = ours.from_messages(messages)
    n = len(prompt["input_ids"])
    np.testing.assert_array_equal(sample["input_ids"][:n], prompt["input_ids"])
    np.testing.assert_array_equal(sample["input_ids"][n:], [*targets, tk.IM_END_ID])
    assert tok.decode(prompt["input_ids"][-3:]) == "<|im_start|>assistant\n"
    np.testing.assert_array_equal(
        np.flatnonzero(sample["assistant_mask"]), np.arange(n, n + len(targets) + 1)
    )
    no_end = ours.from_messages(messages, target_ids=targets, append_im_end=False)
    assert len(no_end["input_ids"]) == n + len(targets) and no_end["assistant_mask"][n:].all()


def test_assistant_turns_in_history_are_marked(ours, tok, hf_processor):
    messages = [
        {"role": "user", "content": "Where is the tree?"},
        {"role": "assistant", "content": "\nTo the left, 3 blocks."},
        {"role": "user", "content": [{"type": "image", "image": _image(60, 80, 4)}]},
        {"role": "assistant", "content": [{"type": "token_ids", "ids": [151670, 151671]}]},
    ]
    sample = ours.from_messages(messages)
    ids, mask = sample["input_ids"], sample["assistant_mask"]
    # Text turns tokenise exactly as the whole rendered prompt does.
    text_only = ours.from_messages(messages[:2])
    np.testing.assert_array_equal(
        text_only["input_ids"], tok.encode(tok.apply_chat_template(messages[:2], tokenize=False))
    )
    marked = np.flatnonzero(mask)
    first, second = (
        marked[marked < len(text_only["input_ids"])],
        marked[marked >= len(text_only["input_ids"])],
    )
    # The leading "\n" merges with the template's "\n" into one token, which overlaps the reply: a target.
    assert tok.decode(ids[first]) == "\n\nTo the left, 3 blocks.<|im_end|>"
    np.testing.assert_array_equal(ids[second], [151670, 151671, tk.IM_END_ID])
    assert not mask[ids == tk.IMAGE_PAD_ID].any()


def test_placeholder_count_must_match_images(ours):
    with pytest.raises(ValueError, match=r"1 <\|image_pad\|> tokens but 2 images"):
        ours("<|vision_start|><|image_pad|><|vision_end|>", images=[_image(56, 56, 0), _image(56, 56, 1)])
    with pytest.raises(ValueError, match="unknown role"):
        ours.from_messages([{"role": "robot", "content": "hi"}])


def test_pad_batch_right_and_left(ours):
    a = ours("<|vision_start|><|image_pad|><|vision_end|>short", images=[_image(56, 56, 0)])
    b = ours("<|vision_start|><|image_pad|><|vision_end|>a longer prompt here", images=[_image(56, 84, 1)])
    la, lb = len(a["input_ids"]), len(b["input_ids"])
    right = pad_batch([a, b], length=lb + 2)
    assert right["input_ids"].shape == (2, lb + 2)
    np.testing.assert_array_equal(right["input_ids"][0, :la], a["input_ids"])
    assert (right["input_ids"][0, la:] == tk.PAD_ID).all() and right["attention_mask"][0].sum() == la
    left = pad_batch([a, b], side="left")
    np.testing.assert_array_equal(left["input_ids"][0, lb - la :], a["input_ids"])
    assert left["attention_mask"][0, : lb - la].sum() == 0
    np.testing.assert_array_equal(
        left["pixel_values"], np.concatenate([a["pixel_values"], b["pixel_values"]])
    )
    np.testing.assert_array_equal(
        left["image_grid_thw"], np.concatenate([a["image_grid_thw"], b["image_grid_thw"]])
    )
    with pytest.raises(ValueError, match="more than length"):
        pad_batch([a, b], length=la)
