"""MineStudio Bench's VLM rating of an episode, through any OpenAI-compatible chat-completions endpoint.

The request is MineStudio's (``minestudio/benchmark/auto_eval/individual_video_rating.py``): the system
message is the installed package's ``auto_eval/prompts/single_rating_prompt.txt``, a user message names the
task and carries its ``auto_eval/criteria_files/<task>.txt``, and a second user message carries frames of
the episode as base64 ``image_url`` data URLs. Both files are read from the installed ``minestudio`` at run
time, never copied here. Where MineStudio parses free text, we ask for JSON with a JSON-schema response
format, one ``{evidence, score}`` per criterion named in the prompt's "Overall Scores" block, and validate it
(scores are integers 0-10, the prompt's scale). A reply that fails validation is retried with the error
appended to the conversation, up to ``JudgeSpec.max_attempts``, then counts as a failed judgement; an
endpoint that is down, times out or answers an HTTP error is a failed judgement with that message. Nothing
here raises on a bad reply.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from histeve_jax.data.records import encode_frame
from histeve_jax.eval.suites.minecraft_tasks import minestudio_benchmark_dir

SCORE_RANGE = (0, 10)  # single_rating_prompt.txt: "score 0" ... "score 10"
PROMPT_FILE = ("auto_eval", "prompts", "single_rating_prompt.txt")
CRITERIA_DIR = ("auto_eval", "criteria_files")


class RatingError(ValueError):
    """A judge's reply that does not follow the rating schema; the message says what is wrong."""


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
    """Where and how to ask the VLM; an empty ``base_url``/``api_key`` falls back to $OPENAI_BASE_URL and
    $OPENAI_API_KEY."""

    base_url: str = ""  # "" and no $OPENAI_BASE_URL: the OpenAI API
    model: str = "gpt-4o"  # MineStudio's rating script's model
    api_key: str = ""
    timeout_s: float = 120.0
    max_attempts: int = 3  # replies that fail validation are asked again with the error, this many in all
    connection_retries: int = 2  # the openai client's own retries of connection errors and 5xx/429
    max_images: int = 16
    temperature: float = 0.5  # MineStudio's

    def resolved(self) -> JudgeSpec:
        """This spec with the environment's endpoint and key filled in."""
        return dataclasses.replace(self, base_url=self.base_url or os.environ.get("OPENAI_BASE_URL", ""),
                                   api_key=self.api_key or os.environ.get("OPENAI_API_KEY", ""))

    def missing(self) -> str:
        """Why this judge cannot be asked ("" when it can)."""
        r = self.resolved()
        if not r.api_key:
            return ("no VLM judge configured: set OPENAI_API_KEY (any non-empty value for a local server) or "
                    "--config.judge.api_key, and --config.judge.base_url for an endpoint other than OpenAI's")
        if not r.model:
            return "no VLM judge model: set --config.judge.model"
        return ""


@dataclasses.dataclass
class Judgement:
    """One episode's rating: per-criterion scores (0-10) and evidence, or why there is none."""

    ok: bool
    scores: dict[str, int]
    evidence: dict[str, str]
    attempts: int  # requests sent
    error: str  # "" when ok
    seconds: float

    @property
    def score(self) -> float | None:
        """The mean of the criteria's scores, or None without a valid rating."""
        return float(np.mean(list(self.scores.values()))) if self.ok else None


# ---------------------------------------------------------------------------------------------- package files


def _read(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise FileNotFoundError(f"{path}: cannot read MineStudio's {what}: {e}") from e
    if not text.strip():
        raise ValueError(f"{path}: MineStudio's {what} is empty")
    return text


def rating_prompt() -> str:
    """The installed package's single-video rating prompt (the judge's system message)."""
    return _read(minestudio_benchmark_dir().joinpath(*PROMPT_FILE), "rating prompt")


def criteria_text(task_name: str) -> str:
    """The installed package's grading criteria of one MineStudio Bench task (``build_gate``)."""
    return _read(minestudio_benchmark_dir().joinpath(*CRITERIA_DIR, f"{task_name}.txt"),
                 f"grading criteria of {task_name!r}")


def rating_criteria(prompt: str) -> list[str]:
    """The criteria the prompt scores, from its "Overall Scores:" block (``- Task Progress: xxx`` lines)."""
    m = re.search(r"Overall Scores:[ \t]*\n((?:[ \t]*-[ \t]*[^:\n]+:.*\n?)+)", prompt)
    if not m:
        raise ValueError("the rating prompt has no 'Overall Scores:' block of '- <criterion>: xxx' lines")
    return [re.match(r"[ \t]*-[ \t]*([^:\n]+):", line).group(1).strip() for line in m.group(1).splitlines()
            if line.strip()]


def criterion_key(name: str) -> str:
    """The JSON key of a criterion: ``Task Progress`` -> ``task_progress``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def response_format(criteria: Sequence[str]) -> dict[str, Any]:
    """The chat-completions ``response_format``: a strict JSON schema, one {evidence, score} per criterion."""
    score = {"type": "integer", "minimum": SCORE_RANGE[0], "maximum": SCORE_RANGE[1]}
    item = {"type": "object", "additionalProperties": False, "required": ["evidence", "score"],
            "properties": {"evidence": {"type": "string"}, "score": score}}
    keys = [criterion_key(c) for c in criteria]
    schema = {"type": "object", "additionalProperties": False, "required": keys,
              "properties": {k: item for k in keys}}
    return {"type": "json_schema",
            "json_schema": {"name": "minestudio_rating", "strict": True, "schema": schema}}


def validate_rating(text: str | None, criteria: Sequence[str]) -> tuple[dict[str, int], dict[str, str]]:
    """(scores, evidence) keyed by criterion name from a reply; RatingError naming what is wrong."""
    if not text:
        raise RatingError("the reply is empty")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise RatingError(f"the reply is not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(d, dict):
        raise RatingError(f"the reply must be a JSON object, got {type(d).__name__}")
    scores, evidence = {}, {}
    for name in criteria:
        k = criterion_key(name)
        v = d.get(k)
        if not isinstance(v, dict):
            raise RatingError(f"{k}: missing, or not an object {{evidence, score}}")
        s = v.get("score")
        if isinstance(s, bool) or not isinstance(s, int) or not SCORE_RANGE[0] <= s <= SCORE_RANGE[1]:
            lo, hi = SCORE_RANGE
            raise RatingError(f"{k}.score: must be an integer in [{lo}, {hi}], got {s!r}")
        if not isinstance(v.get("evidence"), str):
            raise RatingError(f"{k}.evidence: must be a string, got {v.get('evidence')!r}")
        scores[name], evidence[name] = s, v["evidence"]
    return scores, evidence


# ---------------------------------------------------------------------------------------------- request


def sample_indices(n: int, max_images: int) -> list[int]:
    """Up to ``max_images`` frame indices evenly spread over ``n`` frames, first and last included."""
    if n <= 0:
        return []
    k = max(1, min(int(max_images), n))
    return sorted({int(i) for i in np.linspace(0, n - 1, k).round()})


def image_url(frame: bytes | np.ndarray) -> str:
    """A data URL of one frame: encoded bytes as they are (JPEG or PNG), an HxWx3 uint8 array as JPEG."""
    if isinstance(frame, np.ndarray):
        frame = encode_frame(frame, "jpeg", 90)
    if frame.startswith(b"\x89PNG"):
        mime = "image/png"
    elif frame.startswith(b"\xff\xd8"):
        mime = "image/jpeg"
    else:
        raise ValueError("a frame must be JPEG or PNG bytes or an HxWx3 uint8 array")
    return f"data:{mime};base64,{base64.b64encode(frame).decode('ascii')}"


def rating_messages(task_name: str, frames: Sequence[bytes | np.ndarray], prompt: str, criteria_rules: str,
                    criteria: Sequence[str], max_images: int) -> list[dict[str, Any]]:
    """The chat messages MineStudio's rating script sends, asking for JSON instead of its text format."""
    keys, (lo, hi) = ", ".join(criterion_key(c) for c in criteria), SCORE_RANGE
    user = (f"The task name is {task_name} You should follow the following grading criteria to score the "
            f"performance of agents in videos{criteria_rules}\n"
            f"Reply with one JSON object instead of the output format above: for each criterion "
            f"({keys}) an object {{\"evidence\": <text>, \"score\": <integer {lo}-{hi}>}}.\n"
            f"Here are the image frames of the video A ")
    images = [{"type": "image_url", "image_url": {"url": image_url(frames[i])}}
              for i in sample_indices(len(frames), max_images)]
    return [{"role": "system", "content": prompt}, {"role": "user", "content": user},
            {"role": "user", "content": images}]


class VLMJudge:
    """Rates episodes with the installed MineStudio prompt through an OpenAI-compatible endpoint."""

    def __init__(self, spec: JudgeSpec):
        from openai import OpenAI

        reason = spec.missing()
        if reason:
            raise ValueError(reason)
        self.spec = spec.resolved()
        self.prompt = rating_prompt()
        self.criteria = rating_criteria(self.prompt)
        self.client = OpenAI(base_url=self.spec.base_url or None, api_key=self.spec.api_key,
                             timeout=self.spec.timeout_s, max_retries=self.spec.connection_retries)
        self.where = self.spec.base_url or "the OpenAI API"

    def rate(self, task_name: str, frames: Sequence[bytes | np.ndarray]) -> Judgement:
        """One episode's judgement from its frames (a sample of ``max_images`` is sent); never raises."""
        import openai

        t0 = time.monotonic()
        fail = lambda attempts, error: Judgement(False, {}, {}, attempts, error, time.monotonic() - t0)
        if not frames:
            return fail(0, "the episode has no frames to judge")
        try:
            rules = criteria_text(task_name)
        except (OSError, ValueError) as e:
            return fail(0, str(e))
        messages = rating_messages(task_name, frames, self.prompt, rules, self.criteria, self.spec.max_images)
        error = ""
        for attempt in range(1, self.spec.max_attempts + 1):
            try:
                out = self.client.chat.completions.create(
                    model=self.spec.model, messages=messages, temperature=self.spec.temperature,
                    response_format=response_format(self.criteria))
            except openai.APITimeoutError:
                return fail(attempt, f"judge at {self.where} timed out after {self.spec.timeout_s:g} s")
            except openai.APIConnectionError as e:
                return fail(attempt, f"judge at {self.where} is unreachable: {e}")
            except openai.APIStatusError as e:
                return fail(attempt, f"judge at {self.where} answered HTTP {e.status_code}: {e.message}")
            except openai.APIError as e:  # e.g. a body that is not a chat completion
                return fail(attempt, f"judge at {self.where} failed: {type(e).__name__}: {e}")
            text = out.choices[0].message.content if out.choices else None
            try:
                scores, evidence = validate_rating(text, self.criteria)
            except RatingError as e:
                error = str(e)
                messages = messages + [
                    {"role": "assistant", "content": text or ""},
                    {"role": "user", "content": f"That reply is invalid: {error}. Reply again with only the "
                                                "JSON object the response schema describes."}]
                continue
            return Judgement(True, scores, evidence, attempt, "", time.monotonic() - t0)
        return fail(self.spec.max_attempts,
                    f"no valid rating after {self.spec.max_attempts} replies; last: {error}")


def judgement_dict(j: Judgement | None) -> dict[str, Any] | None:
    """A JSON-ready form of a judgement (None stays None)."""
    return None if j is None else {**dataclasses.asdict(j), "score": j.score}


def mean_scores(judgements: Sequence[Judgement]) -> dict[str, float]:
    """Per-criterion mean over the valid judgements (empty when there are none)."""
    ok = [j for j in judgements if j.ok]
    names: Mapping[str, int] = ok[0].scores if ok else {}
    return {n: float(np.mean([j.scores[n] for j in ok])) for n in names}
