"""World-knowledge data (image + question/answer or caption) into record shards.

Accepted shapes, one sample per JSONL line or as a JSON list:
- LLaVA-style ``{"image": "imgs/1.jpg", "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": "..."}, ...]}``: one record per human/gpt turn pair;
- ``{"image", "question", "answer"}``;
- ``{"image", "caption"}``: the question is ``CAPTION_PROMPT``.
Each record is an episode of one step with ``kind="world_knowledge"``, ``instruction`` = the question (the
``<image>`` placeholder removed: the pipeline places the image itself), ``response`` = the answer. Image paths
are relative to the JSON file. A sample whose image is missing or does not decode is skipped and counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from histeve_jax.data import records as R
from histeve_jax.data.converters import ConversionStats

CAPTION_PROMPT = "Describe this Minecraft image."
_HUMAN = ("human", "user")
_GPT = ("gpt", "assistant")


def _samples(path: str) -> Iterator[tuple[int, Any]]:
    with open(path) as f:
        if path.endswith(".jsonl"):
            for i, line in enumerate(f):
                if line.strip():
                    try:
                        yield i + 1, json.loads(line)
                    except json.JSONDecodeError:
                        yield i + 1, None
        else:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise R.RecordError(f"{path}: not valid JSON: {e}") from e
            if not isinstance(data, list):
                raise R.RecordError(f"{path}: a .json world-knowledge file must hold a list of samples")
            yield from enumerate(data, 1)


def _strip_image_tag(text: str) -> str:
    return text.replace("<image>", "").strip()


def _text(v: Any, key: str) -> str:
    if not isinstance(v, str):
        raise R.RecordError(f"'{key}' must be a string, got {type(v).__name__}")
    return v


def qa_pairs(sample: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (question, answer) pairs of one sample in any accepted shape; raises RecordError naming the key."""
    if "conversations" in sample:
        turns = sample["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, Mapping) for t in turns):
            raise R.RecordError("'conversations' must be a list of {from, value} objects")
        pairs = []
        for q, a in zip(turns[0::2], turns[1::2], strict=False):
            if q.get("from") not in _HUMAN or a.get("from") not in _GPT:
                raise R.RecordError(f"conversation turns must alternate human/gpt, got {q.get('from')!r}, "
                                    f"{a.get('from')!r}")
            pairs.append((_strip_image_tag(_text(q.get("value"), "conversations.value")),
                          _text(a.get("value"), "conversations.value").strip()))
        if not pairs:
            raise R.RecordError("'conversations' has no human/gpt pair")
        return pairs
    if "question" in sample and "answer" in sample:
        return [(_strip_image_tag(_text(sample["question"], "question")), str(sample["answer"]).strip())]
    if "caption" in sample:
        return [(CAPTION_PROMPT, _text(sample["caption"], "caption").strip())]
    raise R.RecordError(f"sample has none of 'conversations', 'question'/'answer', 'caption' (keys: "
                        f"{sorted(sample)})")


def _frame(data: bytes) -> tuple[bytes, str]:
    """Keep jpeg/png bytes as they are (after checking they decode); re-encode anything else as png."""
    image = R.decode_frame(data)  # raises RecordError if it does not decode
    if data[:3] == b"\xff\xd8\xff":
        return data, "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return data, "png"
    return R.encode_frame(image, "png"), "png"


def convert_file(path: str | os.PathLike, output_dir: str | os.PathLike, *, task_id: str | None = None,
                 records_per_shard: int = 4096, prefix: str = "wk") -> ConversionStats:
    """Convert one JSON/JSONL world-knowledge file; returns what was written and skipped."""
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    task_id = task_id or os.path.splitext(os.path.basename(path))[0]
    stats = ConversionStats()
    zero_action: dict[str, Any] = {k: 0 for k in R.BINARY_KEYS}
    zero_action["camera"] = [0.0, 0.0]
    with R.ShardWriter(output_dir, prefix=prefix, records_per_shard=records_per_shard) as writer:
        for line_no, sample in _samples(path):
            if not isinstance(sample, Mapping):
                stats.skip("line is not a JSON object")
                continue
            try:
                if not isinstance(sample.get("image"), str):
                    raise R.RecordError("sample lacks 'image' (a path string)")
                pairs = qa_pairs(sample)
                image_path = os.path.join(base, sample["image"])
                if not os.path.exists(image_path):
                    raise R.RecordError(f"image {sample['image']} not found")
                with open(image_path, "rb") as f:
                    frame, fmt = _frame(f.read())
            except R.RecordError as e:
                stats.skip(f"{type(e).__name__}: {str(e).split(':')[0]}")
                continue
            for k, (question, answer) in enumerate(pairs):
                rec = R.StepRecord(
                    episode_id=f"{task_id}:{line_no}:{k}", step=0, task_id=task_id, kind="world_knowledge",
                    instruction=question, frame=frame, frame_format=fmt, action=dict(zero_action),
                    is_gui_open=False, done=True, response=answer,
                    metadata={"source": os.path.basename(path), "image": sample["image"], "turn": k})
                writer.write_episode([rec])
                stats.episodes += 1
                stats.records += 1
    stats.shards = list(writer.paths)
    return stats


def main(argv: list[str] | None = None) -> None:
    """``python -m histeve_jax.data.converters.world_knowledge FILE.jsonl [FILE.json ...] OUTPUT_DIR``."""
    import argparse

    ap = argparse.ArgumentParser(description="image + QA / caption JSON(L) -> world-knowledge record shards")
    ap.add_argument("files", nargs="+", help="JSON/JSONL files, then the output directory")
    a = ap.parse_args(argv)
    if len(a.files) < 2:
        ap.error("give at least one input file and the output directory")
    *inputs, out = a.files
    for path in inputs:
        stats = convert_file(path, out)
        print(f"{path}: records={stats.records} skipped={dict(stats.skipped)}")


if __name__ == "__main__":
    main()
