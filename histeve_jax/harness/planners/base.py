"""The planner interface u_j = P(G, O_j, h_j, S_j, R_j): the context a planner sees, what it returns, and
the one validation of a reply that every backend goes through.

A reply is ``{"subtask": {"name": <admissible name>, "parameters": {...}}}`` (``schemas.reply_schema`` is
its JSON Schema). ``validate_reply`` turns reply text into an instantiated ``Subtask`` or raises
``PlanError`` saying what is wrong (not JSON, not an object, an unknown or inadmissible subtask, a bad
parameter): nothing that fails it reaches the executor. ``plan_messages`` renders the context as chat
messages for a VLM (text plus the recent frames as ``image_url`` data URLs).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from histeve_jax.data.records import encode_frame
from histeve_jax.harness.schemas import ParameterError, Subtask, SubtaskSchema, reply_schema


class PlanError(ValueError):
    """A planner reply that cannot be executed; the message says why (it goes back to the planner)."""


@dataclasses.dataclass
class PlanningContext:
    """Everything a planner may look at for one decision."""

    goal: str  # G, the long-horizon objective's text
    goal_check: dict[str, Any]  # its success check (the rules planner reads it; VLMs see the text)
    subgoals: tuple[tuple[str, dict[str, Any]], ...]  # the task's subgoals (rules planner only)
    frames: list[np.ndarray]  # O_j, recent observations, oldest first
    info: dict[str, Any]  # the latest env info (privileged on Luanti)
    working: dict[str, Any]  # h_j
    admissible: dict[str, SubtaskSchema]  # S_j: schemas whose applicability holds now
    retrieved: dict[str, Any]  # R_j
    schemas: dict[str, SubtaskSchema] = dataclasses.field(default_factory=dict)  # all of them


@dataclasses.dataclass
class PlanResult:
    """One planning step: the chosen subtask, or why there is none (never an exception)."""

    subtask: Subtask | None
    attempts: int  # replies asked for (retries included)
    error: str  # "" when a subtask was chosen
    replies: list[str]  # raw reply texts, for the report
    seconds: float
    planner: str
    prompt_tokens: int = 0  # summed over the attempts (0: a backend that does not count them, the rules)
    completion_tokens: int = 0

    def event(self) -> dict[str, Any]:
        """The report/JSON form."""
        return {"planner": self.planner, "subtask": self.subtask.label if self.subtask else None,
                "attempts": self.attempts, "error": self.error, "replies": self.replies,
                "seconds": round(self.seconds, 3), "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens}


class TokenCount:
    """Prompt and completion tokens of a planner's replies, summed over one ``plan`` call."""

    def __init__(self) -> None:
        self.prompt = self.completion = 0

    def add(self, prompt: int | None, completion: int | None) -> None:
        self.prompt += int(prompt or 0)
        self.completion += int(completion or 0)

    def into(self, result: PlanResult) -> PlanResult:
        result.prompt_tokens, result.completion_tokens = self.prompt, self.completion
        return result


class Planner(Protocol):
    """A planner backend."""

    name: str

    def plan(self, ctx: PlanningContext) -> PlanResult: ...


def validate_reply(text: str | None, admissible: Mapping[str, SubtaskSchema],
                   known: Mapping[str, SubtaskSchema] | None = None) -> Subtask:
    """The subtask a reply asks for, instantiated; PlanError naming what is wrong."""
    if not text or not text.strip():
        raise PlanError("the reply is empty")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"the reply is not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(d, dict) or set(d) != {"subtask"} or not isinstance(d["subtask"], dict):
        raise PlanError('the reply must be a JSON object {"subtask": {"name": ..., "parameters": {...}}}')
    choice = d["subtask"]
    if set(choice) - {"name", "parameters"} or "name" not in choice:
        raise PlanError(f"subtask: must have keys name and parameters, got {sorted(choice)}")
    name, params = choice["name"], choice.get("parameters", {})
    if name not in admissible:
        why = ("is not applicable in the current state" if known is not None and name in known
               else "is not a known subtask")
        raise PlanError(f"subtask.name: {name!r} {why}; admissible: {sorted(admissible)}")
    if not isinstance(params, dict):
        raise PlanError(f"subtask.parameters: must be an object, got {params!r}")
    try:
        return admissible[name].instantiate(params)
    except ParameterError as e:
        raise PlanError(f"subtask.parameters: {e}") from None


def response_format(admissible: Mapping[str, SubtaskSchema]) -> dict[str, Any]:
    """The chat-completions ``response_format``: a strict JSON schema over the admissible subtasks."""
    return {"type": "json_schema",
            "json_schema": {"name": "next_subtask", "strict": True, "schema": reply_schema(admissible)}}


SYSTEM_PROMPT = (
    "You are the planner of a game-playing agent in Luanti (a Minecraft-like game). A low-level policy "
    "executes one atomic subtask at a time through keyboard and mouse. Given the long-horizon goal, the "
    "recent frames, the verified planning state and retrieved memory, choose the single next subtask "
    "from the admissible ones and its parameters. There is no predefined route: reason from the game's "
    "crafting and smelting rules and what has been verified. Reply with only the JSON object "
    '{"subtask": {"name": <subtask>, "parameters": {...}}} that the response schema describes.')


def image_url(frame: np.ndarray) -> str:
    """A JPEG data URL of one HxWx3 uint8 frame."""
    return "data:image/jpeg;base64," + base64.b64encode(encode_frame(frame, "jpeg", 90)).decode("ascii")


def plan_messages(ctx: PlanningContext, max_frames: int = 2) -> list[dict[str, Any]]:
    """The chat messages of one planning step (system prompt, then the context and frames as user)."""
    schemas = [{"name": s.name, "description": s.description,
                "parameters": {k: p.json_schema() for k, p in s.parameters.items()}}
               for s in ctx.admissible.values()]
    state = {"goal": ctx.goal, "planning_state": ctx.working, "admissible_subtasks": schemas,
             "memory": ctx.retrieved}
    content: list[dict[str, Any]] = [{"type": "text", "text": json.dumps(state, separators=(",", ":"))}]
    content += [{"type": "image_url", "image_url": {"url": image_url(f)}} for f in ctx.frames[-max_frames:]]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]


def retry_messages(messages: Sequence[dict[str, Any]], reply: str, error: str) -> list[dict[str, Any]]:
    """The conversation with a rejected reply and the validation error appended (the retry)."""
    return list(messages) + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": f"That reply cannot be executed: {error}. Reply again with only the JSON "
                                    "object the response schema describes, choosing an admissible subtask."}]


class PlannerUnavailable(RuntimeError):
    """The planner could not be asked (endpoint down, timed out, HTTP error): no reply to validate."""


# complete(messages, response_format) -> (reply text, finish_reason); raises PlannerUnavailable
Complete = Callable[[list[dict[str, Any]], dict[str, Any]], tuple[str | None, str]]


def plan_with_retries(complete: Complete, ctx: PlanningContext, *, name: str, max_attempts: int,
                      max_tokens: int, max_frames: int = 2) -> PlanResult:
    """Ask, validate, and ask again with the validation error, up to ``max_attempts`` replies; never raises.

    A reply cut by the token budget (finish_reason "length") counts as a failed attempt with that error.
    """
    t0 = time.monotonic()
    replies: list[str] = []
    done = lambda sub, n, err: PlanResult(sub, n, err, replies, time.monotonic() - t0, name)
    if not ctx.admissible:
        return done(None, 0, "no subtask is admissible in the current state")
    messages = plan_messages(ctx, max_frames)
    fmt = response_format(ctx.admissible)
    error = ""
    for attempt in range(1, max_attempts + 1):
        try:
            text, finish = complete(messages, fmt)
        except PlannerUnavailable as e:
            return done(None, attempt, str(e))
        replies.append(text or "")
        if finish == "length":
            error = f"the reply hit the token budget of {max_tokens} tokens before it ended"
        else:
            try:
                return done(validate_reply(text, ctx.admissible, ctx.schemas), attempt, "")
            except PlanError as e:
                error = str(e)
        messages = retry_messages(messages, text or "", error)
    return done(None, max_attempts, f"no executable reply after {max_attempts} attempts; last: {error}")
