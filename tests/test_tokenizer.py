"""The real Qwen tokenizer files, loaded with AutoTokenizer, against Qwen2.5-VL's config ids."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from transformers import AutoTokenizer, Qwen2_5_VLConfig

from histeve_jax.data import tokenizer as tk


@pytest.fixture(scope="module")
def tok():
    return tk.load_qwen_tokenizer()


@pytest.fixture(scope="module")
def package_tok():
    return AutoTokenizer.from_pretrained(str(tk.packaged_tokenizer_dir()), local_files_only=True)


def test_loads_with_autotokenizer_and_ids_match_qwen2_5_vl_config(tok):
    config = Qwen2_5_VLConfig()
    assert tok.convert_tokens_to_ids("<|image_pad|>") == tk.IMAGE_PAD_ID == config.image_token_id == 151655
    assert tok.convert_tokens_to_ids("<|video_pad|>") == tk.VIDEO_PAD_ID == config.video_token_id == 151656
    assert (
        tok.convert_tokens_to_ids("<|vision_start|>")
        == tk.VISION_START_ID
        == config.vision_start_token_id
        == 151652
    )
    vision_end = tok.convert_tokens_to_ids("<|vision_end|>")
    assert vision_end == tk.VISION_END_ID == config.vision_end_token_id == 151653
    assert tk.ENDOFTEXT_ID == config.text_config.bos_token_id == tok.pad_token_id == 151643
    assert tk.IM_END_ID == config.text_config.eos_token_id == tok.eos_token_id == 151645
    assert tok.convert_tokens_to_ids("<|im_start|>") == tk.IM_START_ID == 151644
    # Every one of Qwen2.5-VL's 22 special tokens, each a single token when it appears in text.
    assert sorted(tk.SPECIAL_TOKENS.values()) == list(range(151643, 151665))
    for token, token_id in tk.SPECIAL_TOKENS.items():
        assert tok.encode(f"a{token}b", add_special_tokens=False)[1] == token_id, token


def test_only_qwen2_5_vl_ids_remain(tok, package_tok):
    # The packaged files are Qwen3's: four extra added tokens that Qwen2.5-VL tokenises as plain text.
    assert len(package_tok) == 151669 and package_tok.convert_tokens_to_ids("<think>") == 151667
    assert len(tok) == tk.NUM_TOKENIZER_IDS == 151665
    ids = tok.encode("<think>", add_special_tokens=False)
    assert len(ids) > 1 and max(ids) < 151643
    assert tok.decode(ids) == "<think>"


def test_ordinary_text_tokenizes_as_the_package_files(tok, package_tok):
    text = "Mine 3 oak logs, then craft a crafting_table.\n\n  Répète: 你好世界 <|im_end|> ok"
    assert tok.encode(text) == package_tok.encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_has_the_documented_format(tok):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What now?"}]},
        {"role": "assistant", "content": "Chop the tree."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And now?"}]},
    ]
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What now?<|im_end|>\n"
        "<|im_start|>assistant\nChop the tree.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>And now?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.chat_template == tk.QWEN2_5_VL_CHAT_TEMPLATE
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    with_ids = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *messages[:1]], tokenize=False, add_vision_id=True
    )
    assert with_ids == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>What now?<|im_end|>\n"
    )


def test_check_special_tokens_rejects_a_mismatch():
    class Shifted:
        pad_token_id = tk.PAD_ID

        def convert_tokens_to_ids(self, token):
            return tk.SPECIAL_TOKENS[token] + (1 if token == "<|image_pad|>" else 0)

    with pytest.raises(ValueError, match="image_pad"):
        tk.check_special_tokens(Shifted())


def test_derived_directory_is_reused(tmp_path):
    first = tk.qwen2_5_vl_tokenizer_dir(cache_dir=tmp_path)
    second = tk.qwen2_5_vl_tokenizer_dir(cache_dir=tmp_path)
    assert first == second and (first / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging leftovers


def test_loads_are_fresh_instances_and_saved_added_tokens_reload(tok, tmp_path):
    saved = tk.load_qwen_tokenizer()
    saved.add_tokens(["<act_0>", "<act_1>"], special_tokens=True)
    assert len(saved) == 151667 and len(tok) == 151665  # adding tokens to one leaves the others alone
    saved.save_pretrained(tmp_path / "policy")
    loaded = tk.load_qwen_tokenizer(tmp_path / "policy")
    assert loaded.convert_tokens_to_ids(["<act_0>", "<act_1>"]) == [151665, 151666]
    check = {token: loaded.convert_tokens_to_ids(token) for token in tk.SPECIAL_TOKENS}
    assert check == tk.SPECIAL_TOKENS
    assert len(loaded.encode("<think>", add_special_tokens=False)) > 1
    assert loaded.chat_template == tk.QWEN2_5_VL_CHAT_TEMPLATE
