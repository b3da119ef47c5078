"""Game backends behind one gymnasium interface (see base.py): ``make("luanti")``, ``make("minestudio")``."""

from __future__ import annotations

from typing import Any

from histeve_jax.envs.base import noop_action, validate_action
from histeve_jax.envs.tasks import Task, list_tasks, load_task

BACKENDS = ("luanti", "minestudio")


def make(name: str, **kw: Any):
    """Build a backend env by name: ``make("luanti", obs_size=(H, W), task="mine_log")``."""
    if name == "luanti":
        from histeve_jax.envs.luanti import LuantiEnv

        return LuantiEnv(**kw)
    if name == "minestudio":
        from histeve_jax.envs.minestudio import MineStudioEnv

        return MineStudioEnv(**kw)
    raise ValueError(f"unknown env backend {name!r}; expected one of {BACKENDS}")


__all__ = ["BACKENDS", "Task", "list_tasks", "load_task", "make", "noop_action", "validate_action"]
