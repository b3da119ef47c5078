"""The planner over any OpenAI-compatible chat-completions endpoint (GPT-4o, a vLLM server, our own served
model from ``python -m experiments.serve``), through the ``openai`` SDK.

Each request carries the admissible schemas as a strict JSON-schema ``response_format`` and ``max_tokens``;
the reply is validated (``base.validate_reply``) and, when it fails, asked again with the error appended,
up to ``EndpointSpec.max_attempts`` replies in all. An endpoint that is down, times out or answers an HTTP
error ends the planning step with that message (the SDK's own ``connection_retries`` come first); nothing
here raises, so the episode and its record go on.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from histeve_jax.harness.planners.base import (
    PlannerUnavailable,
    PlanningContext,
    PlanResult,
    TokenCount,
    plan_with_retries,
)


@dataclasses.dataclass(frozen=True)
class EndpointSpec:
    """Where and how to ask; an empty ``base_url``/``api_key`` falls back to $OPENAI_BASE_URL and
    $OPENAI_API_KEY."""

    base_url: str = ""
    model: str = "gpt-4o"  # the paper's planner
    api_key: str = ""
    timeout_s: float = 60.0
    max_attempts: int = 3
    connection_retries: int = 1
    max_tokens: int = 128  # a reply is one small JSON object
    temperature: float = 0.0
    max_frames: int = 2

    def resolved(self) -> EndpointSpec:
        return dataclasses.replace(self, base_url=self.base_url or os.environ.get("OPENAI_BASE_URL", ""),
                                   api_key=self.api_key or os.environ.get("OPENAI_API_KEY", ""))


class EndpointPlanner:
    """The planner behind an OpenAI-compatible endpoint."""

    name = "endpoint"

    def __init__(self, spec: EndpointSpec):
        from openai import OpenAI

        self.spec = spec.resolved()
        if not self.spec.api_key:
            raise ValueError("no planner endpoint key: set OPENAI_API_KEY (any non-empty value for a local "
                             "server) or the spec's api_key")
        self.client = OpenAI(base_url=self.spec.base_url or None, api_key=self.spec.api_key,
                             timeout=self.spec.timeout_s, max_retries=self.spec.connection_retries)
        self.where = self.spec.base_url or "the OpenAI API"
        self.tokens = TokenCount()
        self.name = f"endpoint:{self.spec.model}"

    def complete(self, messages: list[dict[str, Any]],
                 response_format: dict[str, Any]) -> tuple[str | None, str]:
        """One chat completion: (text, finish_reason); PlannerUnavailable when there is no reply."""
        import openai

        s = self.spec
        try:
            out = self.client.chat.completions.create(
                model=s.model, messages=messages, temperature=s.temperature, max_tokens=s.max_tokens,
                response_format=response_format)
        except openai.APITimeoutError:
            raise PlannerUnavailable(f"planner at {self.where} timed out after {s.timeout_s:g} s") from None
        except openai.APIConnectionError as e:
            raise PlannerUnavailable(f"planner at {self.where} is unreachable: {e}") from None
        except openai.APIStatusError as e:
            raise PlannerUnavailable(f"planner at {self.where} answered HTTP {e.status_code}: "
                                     f"{e.message}") from None
        except openai.APIError as e:  # a body that is not a chat completion
            raise PlannerUnavailable(f"planner at {self.where} failed: {type(e).__name__}: {e}") from None
        usage = getattr(out, "usage", None)
        if usage is not None:
            self.tokens.add(usage.prompt_tokens, usage.completion_tokens)
        if not out.choices:
            return None, "stop"
        return out.choices[0].message.content, out.choices[0].finish_reason or "stop"

    def plan(self, ctx: PlanningContext) -> PlanResult:
        self.tokens = TokenCount()
        return self.tokens.into(plan_with_retries(
            self.complete, ctx, name=self.name, max_attempts=self.spec.max_attempts,
            max_tokens=self.spec.max_tokens, max_frames=self.spec.max_frames))
