"""The harness's four memories, JSON-serialisable per episode, and their retrieval into the planner's context.

* working: the planning state h_j: objective, current subtask, verified progress (subtasks verified done,
  task subgoals verified, the privileged inventory), unresolved requirements (goal clauses that do not hold
  yet), recent failures.
* episodic: one entry per invocation: the working state before and after, the subtask, its outcome
  (success / failure / interrupted), cost in steps, diagnostics (how it ended, failure conditions, visual
  change, progress).
* procedural: dependencies among parameterised subtasks learned from verified successes: what a subtask
  consumed and produced (inventory deltas) and what held before it ran; kept across episodes
  (``save``/``load``).
* world: landmarks (watched node kinds and where they were seen, from Luanti's privileged ``nearby``; the
  player's position at each verification) with spatial relations to the player (distance, bearing).

``Memory.retrieve`` picks the entries the planner sees: the last episodic entries and every failure of an
admissible subtask, the procedural entries of admissible subtasks, the nearest landmarks of each kind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from histeve_jax.envs.base import wrap_degrees

RECENT_FAILURES = 3
LANDMARKS_PER_KIND = 4


def _counts(info: Mapping[str, Any]) -> dict[str, int]:
    return {k: int(v) for k, v in sorted((info.get("inventory") or {}).items()) if int(v) > 0}


@dataclasses.dataclass
class WorkingMemory:
    """The current planning state."""

    objective: str
    current: str = ""
    verified: list[str] = dataclasses.field(default_factory=list)  # subtasks verified done, in order
    subgoals_done: list[str] = dataclasses.field(default_factory=list)
    inventory: dict[str, int] = dataclasses.field(default_factory=dict)
    unresolved: list[str] = dataclasses.field(default_factory=list)
    recent_failures: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def observe(self, info: Mapping[str, Any], unresolved: Sequence[str]) -> None:
        """Refresh the verified state from an info dict (privileged on Luanti)."""
        self.inventory = _counts(info)
        self.subgoals_done = list(info.get("subgoals_done") or [])
        self.unresolved = list(unresolved)

    def fail(self, subtask: str, outcome: str, reasons: Sequence[str]) -> None:
        self.recent_failures = (self.recent_failures + [
            {"subtask": subtask, "outcome": outcome, "reasons": list(reasons)}])[-RECENT_FAILURES:]

    def snapshot(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))


@dataclasses.dataclass
class EpisodicEntry:
    """One invocation of the executor and what the harness made of it."""

    index: int
    subtask: str  # label, name(k=v)
    name: str
    params: dict[str, Any]
    start_step: int
    cost: int  # steps
    outcome: str  # success | failure | interrupted
    decision: str  # advance | recover | replan | stop
    before: dict[str, Any]
    after: dict[str, Any]
    diagnostics: dict[str, Any]


class ProceduralMemory:
    """Subtask -> what verified successes consumed, produced and needed; kept across episodes."""

    def __init__(self, entries: Mapping[str, Mapping[str, Any]] | None = None):
        self.entries: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (entries or {}).items()}

    def learn(self, label: str, name: str, params: Mapping[str, Any], before: Mapping[str, Any],
              after: Mapping[str, Any], cost: int) -> dict[str, Any]:
        """Record one verified success from the infos before and after it; returns the entry."""
        b, a = _counts(before), _counts(after)
        consumed = {k: b[k] - a.get(k, 0) for k in b if b[k] > a.get(k, 0)}
        produced = {k: a[k] - b.get(k, 0) for k in a if a[k] > b.get(k, 0)}
        e = self.entries.get(label)
        if e is None:
            e = self.entries[label] = {"subtask": name, "params": dict(params), "consumed": consumed,
                                       "produced": produced, "held_before": b, "successes": 0,
                                       "mean_cost": 0.0}
        else:  # keep what every success consumed at least (the dependency), produced at most
            e["consumed"] = {k: min(v, consumed.get(k, 0)) for k, v in e["consumed"].items() if k in consumed}
            e["produced"] = {k: max(v, produced.get(k, 0)) for k, v in {**produced, **e["produced"]}.items()}
        e["mean_cost"] = (e["mean_cost"] * e["successes"] + cost) / (e["successes"] + 1)
        e["successes"] += 1
        return e

    def dependencies(self, label: str) -> list[str]:
        """Labels of learned subtasks that produced what ``label`` consumed."""
        e = self.entries.get(label)
        if e is None:
            return []
        return sorted(k for k, o in self.entries.items()
                      if k != label and set(o["produced"]) & set(e["consumed"]))

    def retrieve(self, names: Iterable[str]) -> list[dict[str, Any]]:
        """The learned entries of subtasks named in ``names``, with their dependencies."""
        names = set(names)
        return [{"label": k, **v, "depends_on": self.dependencies(k)} for k, v in sorted(self.entries.items())
                if v["subtask"] in names]

    def save(self, path: str | os.PathLike) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProceduralMemory:
        """The memory saved at ``path`` (empty if there is none); a corrupt file is one ValueError."""
        if not os.path.exists(path):
            return cls()
        try:
            with open(path) as f:
                return cls(json.load(f))
        except (json.JSONDecodeError, AttributeError, TypeError) as e:
            raise ValueError(f"{path}: not a procedural memory file: {e}") from None


class WorldMemory:
    """Landmarks by kind (node positions, first seen at step) and the player's verified positions."""

    def __init__(self) -> None:
        self.landmarks: dict[str, list[dict[str, Any]]] = {}
        self.positions: list[dict[str, Any]] = []

    def observe(self, info: Mapping[str, Any], step: int, *, label: str = "") -> None:
        """Add the watched nodes in ``info["nearby"]`` not seen yet (a few per kind); forget mined ones."""
        seen: dict[str, set[tuple[int, ...]]] = {}
        for name, p in info.get("nearby") or []:
            seen.setdefault(name, set()).add(tuple(int(v) for v in p))
        for name, marks in list(self.landmarks.items()):  # a node gone from sight within range was dug
            self.landmarks[name] = [m for m in marks if tuple(m["pos"]) in seen.get(name, set())
                                    or _dist(m["pos"], info.get("pos")) > 12]
        for name, p in info.get("nearby") or []:
            marks = self.landmarks.setdefault(name, [])
            pos = [int(v) for v in p]
            if len(marks) < LANDMARKS_PER_KIND and all(m["pos"] != pos for m in marks):
                marks.append({"pos": pos, "step": int(step)})
        if label and info.get("pos") is not None:
            self.positions.append({"pos": [round(float(v), 2) for v in info["pos"]], "step": int(step),
                                   "after": label})

    def retrieve(self, pos: Sequence[float] | None, yaw: float | None,
                 kinds: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The nearest landmarks of each kind with their distance and bearing from the player."""
        out = []
        for name, marks in sorted(self.landmarks.items()):
            if kinds is not None and name not in set(kinds):
                continue
            for m in sorted(marks, key=lambda m: _dist(m["pos"], pos))[:2]:
                out.append({"kind": name, "pos": m["pos"], **relation(pos, yaw, m["pos"])})
        return out


def _dist(a: Sequence[float], b: Sequence[float] | None) -> float:
    if b is None:
        return 0.0
    return math.dist([float(a[0]), float(a[2])], [float(b[0]), float(b[2])])


def relation(pos: Sequence[float] | None, yaw: float | None, target: Sequence[float]) -> dict[str, Any]:
    """Distance (blocks, horizontal) and bearing of ``target`` from a player at ``pos`` facing ``yaw``:
    ahead / right / behind / left (yaw 0 faces +z and grows turning right, base.py's convention)."""
    if pos is None or yaw is None:
        return {}
    dx, dz = float(target[0]) - float(pos[0]), float(target[2]) - float(pos[2])
    rel = wrap_degrees(math.degrees(math.atan2(dx, dz)) - float(yaw))
    side = "ahead" if abs(rel) <= 45 else "behind" if abs(rel) >= 135 else "right" if rel > 0 else "left"
    return {"distance": round(math.hypot(dx, dz), 1), "bearing": side}


class Memory:
    """The four memories of one episode (procedural shared across episodes)."""

    def __init__(self, objective: str, procedural: ProceduralMemory | None = None):
        self.working = WorkingMemory(objective)
        self.episodic: list[EpisodicEntry] = []
        self.procedural = procedural if procedural is not None else ProceduralMemory()
        self.world = WorldMemory()

    def retrieve(self, admissible: Iterable[str], info: Mapping[str, Any], k: int = 3) -> dict[str, Any]:
        """The retrieved contextual memory R_j for a planning step over the ``admissible`` subtask names."""
        names = set(admissible)
        recent = self.episodic[-k:]
        failed = [e for e in self.episodic[:-k] if e.outcome != "success" and e.name in names]
        short = lambda e: {"subtask": e.subtask, "outcome": e.outcome, "cost": e.cost,
                           "why": e.diagnostics.get("reasons", [])}
        return {"episodic": [short(e) for e in failed[-k:] + recent],
                "procedural": self.procedural.retrieve(names),
                "world": self.world.retrieve(info.get("pos"), info.get("yaw"))}

    def to_json(self) -> dict[str, Any]:
        """Everything, JSON-ready (the episode's memory file)."""
        return json.loads(json.dumps({
            "working": self.working.snapshot(), "episodic": [dataclasses.asdict(e) for e in self.episodic],
            "procedural": self.procedural.entries,
            "world": {"landmarks": self.world.landmarks, "positions": self.world.positions}}))

    def save(self, path: str | os.PathLike) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)
