"""HiSTEVE in JAX/Flax: a hierarchical vision-language-action agent for open-world games."""

__version__ = "0.1.0"
