"""Converters from public data formats into the record shards of ``histeve_jax.data.records``.

- ``vpt``: OpenAI VPT contractor segments (``.mp4`` + ``.jsonl``).
- ``minestudio_lmdb``: MineStudio's chunked LMDB data sets (``image/``, ``action/``, ``meta_info/``).
- ``world_knowledge``: image + question/answer or caption JSON(L) files.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class ConversionStats:
    """What a converter wrote and what it skipped (reason -> count)."""

    episodes: int = 0
    records: int = 0
    filtered_steps: int = 0  # steps dropped on purpose (VPT null actions), not errors
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    shards: list[str] = dataclasses.field(default_factory=list)

    def skip(self, reason: str, n: int = 1) -> None:
        if n:
            self.skipped[reason] += n
