"""The harness: capability-constrained planning over parameterised atomic subtask schemas, bounded policy
invocations, verification, recovery and replanning, and four memories.

- ``schemas``: the subtask schema files (one YAML each, pydantic-validated) and their instantiation into the
  atomic task's instruction text, conditions and budget.
- ``memory``: working, episodic, procedural and world memory, JSON per episode, and their retrieval.
- ``planners``: one interface (``base``); ``rules`` (deterministic, from the game's recipes and the task's
  subgoals), ``openai`` (any OpenAI-compatible endpoint), ``local`` (a Flax Qwen2.5-VL, constrained by
  ``json_constraint``), served over HTTP by ``server``.
- ``executors``: the scripted experts and a trained policy; ``controller``: the handoff loop as an Agent;
  ``verify``: outcomes, the advance/recover/replan rule, the visual-change test; ``inject``: injected
  failures; ``suite``: the long-horizon runner behind ``experiments.longhorizon``.
"""
