"""The order in which the learner takes group shards: one order, decided once, that every host follows.

Process 0 decides each next group: the smallest shard name in the directory not taken yet (names carry the
group's id, so this is about the order the actors wrote them). It reads the shard first, so whether it is
skipped (it does not read or decode) is decided with it. When the ``DONE`` file is there and no shard is
new, the stream ends; when none appears for ``timeout_s``, it fails. On several hosts process 0 publishes
each decision in jax.distributed's key-value store (``parallel.multihost.publish``) and the other hosts wait
for it, then read the shard themselves; a host that cannot read a shard process 0 read raises, as its batches
would no longer be the others'. The names taken so far are the stream's checkpointed state, so a restored
stream continues from the same list on any host. A decision's key is its position and a checksum of the
names before it: a second stream over the same directory in the same job reuses the first one's decisions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax

from histeve_jax.data import records as R
from histeve_jax.parallel import multihost

GROUP_PREFIX = "group"
DONE_FILE = "DONE"


@dataclasses.dataclass(frozen=True)
class Decision:
    """The group at one position of the order: its shard's name and whether it reads (``ok``), or the end
    (``end``: the actors are done and every shard is taken) or a timeout (no new shard for ``timeout_s``)."""

    name: str = ""
    ok: bool = False
    end: bool = False
    timeout: bool = False


def _key(directory: str, taken: Sequence[str]) -> str:
    prefix = zlib.crc32("\n".join(taken).encode())
    return f"histeve/rl_group_order/{zlib.crc32(directory.encode()):08x}/{len(taken)}/{prefix:08x}"


class GroupOrder:
    """``next(taken, read)``: the next group after the names ``taken``, read with ``read(name)`` (None: it
    does not read); raises ``StopIteration`` at the end and ``TimeoutError`` after ``timeout_s``."""

    def __init__(self, directory: str, *, poll_s: float, timeout_s: float):
        self.directory, self.poll_s, self.timeout_s = directory, poll_s, timeout_s
        self.hosts, self.primary = jax.process_count(), jax.process_index() == 0

    def _new_shards(self, taken: Sequence[str]) -> list[str]:
        if not os.path.isdir(self.directory):
            return []
        seen = set(taken)
        return sorted(n for n in (os.path.basename(p) for p in R.shard_paths(self.directory, GROUP_PREFIX))
                      if n not in seen)

    def _decide(self, taken: Sequence[str], read: Callable[[str], Any]) -> tuple[Decision, Any]:
        """Process 0's decision (and the group it read for it), waiting for a shard to appear."""
        t0 = time.monotonic()
        while True:
            new = self._new_shards(taken)
            if new:
                group = read(new[0])
                return Decision(name=new[0], ok=group is not None), group
            if os.path.exists(os.path.join(self.directory, DONE_FILE)):
                return Decision(end=True), None
            if time.monotonic() - t0 > self.timeout_s:
                return Decision(timeout=True), None
            time.sleep(self.poll_s)

    def next(self, taken: Sequence[str], read: Callable[[str], Any]) -> tuple[str, Any]:
        """(name, group read or None when the shard is skipped) of the group after ``taken``."""
        if self.hosts == 1:
            d, group = self._decide(taken, read)
        else:
            key = _key(self.directory, taken)
            stored = multihost.try_published(key) if self.primary else None
            if self.primary and stored is None:
                d, group = self._decide(taken, read)
                multihost.publish(key, json.dumps(dataclasses.asdict(d)))
            else:  # process 0 decides: a few more seconds than it may wait, for its read and the publish
                if stored is None:
                    stored = multihost.published(key, self.timeout_s + 300.0)
                d = Decision(**json.loads(stored))
                group = read(d.name) if d.ok else None
                if d.ok and group is None:
                    raise RuntimeError(f"{self.directory}/{d.name}: process 0 read this group shard but "
                                       f"process {jax.process_index()} cannot (the batches would differ)")
        if d.end:
            raise StopIteration
        if d.timeout:
            raise TimeoutError(f"{self.directory}: no new group shard for {self.timeout_s:.0f} s")
        return d.name, group
