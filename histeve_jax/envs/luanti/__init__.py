"""Luanti (Debian's minetest 5.6) backend: one private Xvfb + client + world per env."""

from histeve_jax.envs.luanti.env import LuantiEnv, crosshair_visible
from histeve_jax.envs.luanti.process import (
           GameCrashed,
           GameError,
           GameHung,
           LuantiProcess,
           minetest_available,
)

__all__ = ["GameCrashed", "GameError", "GameHung", "LuantiEnv", "LuantiProcess", "crosshair_visible",
           "minetest_available"]
