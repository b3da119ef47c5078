"""Verification after an invocation and the advance / recover / replan rule, with the visual-change test.

"The visual state changed substantially" is concrete here: each frame is reduced to a 16x16 grayscale
signature (block means of luma in [0, 1]); the change between two consecutive frames is the mean absolute
difference of their signatures. Within an invocation, a change above ``VISUAL_JUMP`` between two frames
with the same GUI state (opening or closing a GUI is a large but expected change), when none of the last
``OWN_STEPS`` actions turned the camera by more than ``STILL_TURN`` degrees or pressed attack, use or the
inventory key (a fast turn close to a tree, a block dug or placed under the camera change the view a lot,
and are the agent's own doing), means the scene was swapped under the executor: a teleport, a respawn, a
world rebuilt. Measured on the game at 56x56: in expert play of wooden_pickaxe (456 such steps) the
largest change was 0.066, digging the block under the camera in mine_dirt reached 0.091; teleports across
the arena gave 0.10-0.25 (0.036 for a one-block move). The threshold 0.12 is above everything the agent
did itself and catches the scene swaps (0.19-0.25); the privileged position (a jump over
``POSITION_JUMP`` blocks in one step) catches teleports between look-alike places of the flat world.

``verify`` records the outcome: ``success`` (the completion condition holds: the privileged check on
Luanti; the hook for the detector's own evidence is the controller's), ``failure`` (a recognizable
failure condition holds, the executor gave up, the detector's candidate completion did not verify, or
no progress within the budget or before a stall) or ``interrupted`` (cut short by a visual jump, by the
budget while still progressing, or by a stall after some progress). A stall (``StallMonitor``, off unless
the harness asks for it) is the player standing still outside the GUI for ``patience`` steps. ``decide``
then advances on success, replans when recovery is infeasible (an unrecoverable failure condition, the
recovery budget spent), the subtask is inapplicable, or the visual state changed substantially, and
otherwise recovers locally by invoking the same subtask again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from histeve_jax.envs.base import wrap_degrees
from histeve_jax.harness.schemas import Subtask

SIGNATURE = 16
VISUAL_JUMP = 0.12  # mean |luma difference| of consecutive 16x16 signatures; see the module docstring
STILL_TURN = 2.0  # degrees: camera turns up to this explain no large change
OWN_STEPS = 4  # a dig, click or turn explains the changes of this many steps (the server lags the input)
POSITION_JUMP = 3.0  # blocks in one step: walking covers ~0.2 (Luanti's privileged pos)
STALL_MOVE = 0.05  # blocks: a player whose privileged position moved less than this since ...
STALL_TURN = 1.0  # ... and whose yaw and pitch turned less than this (degrees) has stood still


def signature(frame: np.ndarray) -> np.ndarray:
    """[16, 16] float32 block-mean luma in [0, 1] of an HxWx3 uint8 frame (H, W >= 16)."""
    f = np.asarray(frame, np.float32)
    if f.ndim != 3 or f.shape[2] != 3 or min(f.shape[:2]) < SIGNATURE:
        raise ValueError(f"signature: need an HxWx3 frame of at least {SIGNATURE}x{SIGNATURE}, got {f.shape}")
    luma = (f @ np.asarray([0.299, 0.587, 0.114], np.float32)) / 255.0
    h, w = luma.shape
    ys = np.linspace(0, h, SIGNATURE + 1).astype(int)
    xs = np.linspace(0, w, SIGNATURE + 1).astype(int)
    return np.asarray([[luma[ys[i]:ys[i + 1], xs[j]:xs[j + 1]].mean() for j in range(SIGNATURE)]
                       for i in range(SIGNATURE)], np.float32)


def visual_change(a: np.ndarray, b: np.ndarray) -> float:
    """The change between two frames: the mean absolute difference of their signatures, in [0, 1]."""
    return float(np.abs(signature(a) - signature(b)).mean())


class ChangeMonitor:
    """Watches one invocation's frames for a substantial visual change (and, on Luanti, a position jump)."""

    def __init__(self, threshold: float = VISUAL_JUMP, position_jump: float = POSITION_JUMP):
        self.threshold, self.position_jump = threshold, position_jump
        self.reset()

    def reset(self) -> None:
        self._prev: tuple[np.ndarray, bool, Any] | None = None
        self.max_change = 0.0
        self.jumped = False
        self.reason = ""
        self._own = 0

    def push(self, frame: np.ndarray, info: Mapping[str, Any],
             action: Mapping[str, Any] | None = None) -> bool:
        """Add the next frame (``action``: the one that led to it); True the first time a substantial change
        shows that the agent's own recent actions do not explain."""
        sig, gui, pos = signature(frame), bool(info.get("is_gui_open")), info.get("pos")
        own = action is not None and (
            float(np.abs(np.asarray(action.get("camera", (0, 0)), float)).max()) > STILL_TURN
            or any(int(action.get(k, 0)) for k in ("attack", "use", "inventory")))
        self._own = OWN_STEPS if own else max(0, self._own - 1)
        fired = False
        if self._prev is not None and not self.jumped:
            psig, pgui, ppos = self._prev
            if gui == pgui and self._own == 0:
                change = float(np.abs(sig - psig).mean())
                self.max_change = max(self.max_change, change)
                if change > self.threshold:
                    fired, self.reason = True, f"the view changed by {change:.3f} in one step"
            if not fired and pos is not None and ppos is not None:
                d = float(np.linalg.norm(np.asarray(pos, float) - np.asarray(ppos, float)))
                if d > self.position_jump:
                    fired, self.reason = True, f"the player moved {d:.1f} blocks in one step"
            self.jumped = fired
        self._prev = (sig, gui, pos)
        return fired


class StallMonitor:
    """Counts the steps in a row the player has stood still outside the GUI: position within ``STALL_MOVE``
    blocks and yaw and pitch within ``STALL_TURN`` degrees of where the still run began, the inventory and
    the crafting grid unchanged (on the privileged info, as the position jump above). An executor at a fixed
    point (a policy attacking the air beside a trunk, or leaves out of its reach, with the same frame in and
    the same action out) stands so until its budget is spent; a hand digs a log in 3.5 s (minetest_game's
    hand, ``oddly_breakable_by_hand`` level 1: 70 steps at 20 Hz, standing still), so a patience above that
    ends only stalls. ``push`` is True once the run reaches ``patience``."""

    def __init__(self, patience: int):
        if patience <= 0:
            raise ValueError(f"StallMonitor: patience must be > 0 steps, got {patience}")
        self.patience = int(patience)
        self.still = 0
        self._anchor: tuple | None = None

    @staticmethod
    def _state(info: Mapping[str, Any]) -> tuple | None:
        pos, yaw, pitch = info.get("pos"), info.get("yaw"), info.get("pitch")
        if pos is None or yaw is None or pitch is None or info.get("is_gui_open"):
            return None
        items = (info.get("inventory") or {}, info.get("craft_grid") or [])
        return np.asarray(pos, float), float(yaw), float(pitch), repr(items)

    def push(self, info: Mapping[str, Any]) -> bool:
        state, anchor = self._state(info), self._anchor
        if state is None or anchor is None or state[3] != anchor[3] or (
                np.abs(state[0] - anchor[0]).max() > STALL_MOVE
                or abs(wrap_degrees(state[1] - anchor[1])) > STALL_TURN
                or abs(state[2] - anchor[2]) > STALL_TURN):
            self._anchor, self.still = state, 0
        else:
            self.still += 1
        return self.still >= self.patience


@dataclasses.dataclass
class Verdict:
    """What one invocation achieved and what the harness does next."""

    outcome: str  # success | failure | interrupted
    ended_by: str  # detector | failure_condition | budget | executor_done | gave_up | visual_change | stall
    completed: bool
    applicable: bool
    failures: list[tuple[str, bool]]  # (failure condition, recoverable)
    progress: int  # growth of the schema's observable quantity during the invocation
    visual_change: float  # the largest consecutive-frame change seen
    changed: bool  # a substantial visual change (or position jump) happened
    reasons: list[str]
    decision: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "failures": [list(f) for f in self.failures]}


def verify(subtask: Subtask, before: Mapping[str, Any], after: Mapping[str, Any], *, ended_by: str,
           monitor: ChangeMonitor, error: str = "") -> Verdict:
    """The outcome of one invocation from the infos before and after it (see the module docstring)."""
    completed = subtask.is_complete(after)
    failures = [] if completed else subtask.failures(after)
    progress = subtask.progress_value(after) - subtask.progress_value(before)
    reasons = []
    if completed:
        outcome = "success"
    elif ended_by == "visual_change":
        outcome, reasons = "interrupted", [monitor.reason]
    elif failures or ended_by in ("gave_up", "detector", "executor_done") or progress <= 0:
        outcome = "failure"
        reasons = [f"failure condition {n}" for n, _ in failures]
        if ended_by == "gave_up":
            reasons.append(f"the executor gave up: {error}")
        elif ended_by == "detector":
            reasons.append("the detector's candidate completion did not verify")
        elif ended_by == "executor_done":
            reasons.append("the executor stopped before the completion condition held")
        if progress <= 0 and ended_by == "budget":
            reasons.append("no progress within the budget")
        if ended_by == "stall":
            reasons.append(error or "the player stood still")
    elif ended_by == "stall":
        outcome, reasons = "interrupted", [error or "the player stood still"]
    else:
        outcome, reasons = "interrupted", [f"the budget ran out while progressing (+{progress})"]
    return Verdict(outcome, ended_by, completed, subtask.is_applicable(after), failures, progress,
                   monitor.max_change, monitor.jumped, reasons)


def decide(verdict: Verdict, recoveries: int, max_recoveries: int) -> str:
    """advance | recover | replan, by the paper's rule (see the module docstring); sets verdict.decision."""
    if verdict.outcome == "success":
        d = "advance"
    elif (verdict.changed or not verdict.applicable or recoveries >= max_recoveries
          or any(not recoverable for _, recoverable in verdict.failures)):
        d = "replan"
    else:
        d = "recover"
    verdict.decision = d
    return d
