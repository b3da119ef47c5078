"""Evaluation suites over the game backends: tasks, episode runners, judges and per-task summaries.

``minecraft_tasks`` (MineStudio Bench and OpenHA-style task files), ``vlm_judge`` (MineStudio's VLM rating
through an OpenAI-compatible endpoint) and ``minecraft`` (the two Minecraft suites' runners and summary).
Nothing is imported here, so ``suites.minecraft_tasks`` stays importable without ``openai`` or a game.
"""
