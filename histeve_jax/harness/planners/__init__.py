"""Planner backends: ``rules`` (``planners.rules``), ``endpoint`` (any OpenAI-compatible server,
``planners.openai``), ``local`` (our Flax Qwen2.5-VL, ``planners.local``); ``make_planner`` builds one from a
config's ``planner``, ``endpoint`` and ``local_model`` fields."""

from __future__ import annotations

from typing import Any


def make_planner(c: Any) -> Any:
    """The configured planner backend (``c.planner``: rules | endpoint | local); bad input is a ValueError."""
    from histeve_jax.harness.planners.rules import RulesPlanner

    if c.planner == "rules":
        return RulesPlanner(unit_steps=bool(c.get("unit_steps", False)))
    if c.planner == "endpoint":
        from histeve_jax.harness.planners.openai import EndpointPlanner, EndpointSpec

        return EndpointPlanner(EndpointSpec(**dict(c.endpoint)))
    if c.planner == "local":
        from histeve_jax.harness.planners.local import LocalModel, LocalPlanner

        if not c.local_model:
            raise ValueError("planner=local needs --config.local_model=<a Qwen2.5-VL directory>")
        return LocalPlanner(LocalModel(c.local_model), max_attempts=c.endpoint.max_attempts,
                            max_tokens=c.endpoint.max_tokens)
    raise ValueError(f"planner: unknown {c.planner!r}; choose rules, endpoint or local")
