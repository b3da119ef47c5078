"""The ``--config=<file>.py:<variant>`` flag of every entry point, with a clear error for unknown keys.

ml_collections applies ``--config.a.b=value`` overrides while the flag is defined (at import), and a key
that does not exist surfaces there as a bare ``AttributeError: "'b'"`` deep in a traceback.
"""

from __future__ import annotations

import re
import sys

from ml_collections import config_flags


def define_config(default: str, help_text: str = "Config file and variant: path.py:variant.") -> None:
    """Defines ``--config`` (locked); exits with a message naming the key if an override names none."""
    try:
        config_flags.DEFINE_config_file("config", default, help_text, lock_config=True)
    except (AttributeError, KeyError) as e:
        given = [a for a in sys.argv[1:] if a.startswith("--config.")]
        key = re.sub(r"[\"']", "", str(e).split("\n")[0])
        culprit = next((a.split("=")[0] for a in given if key and key in a), ", ".join(given))
        config = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")), default)
        sys.exit(f"error: config key {key!r} does not exist in {config} (override {culprit})")


def define_config_and_workdir(config_name: str, help_text: str) -> None:
    """``--config`` (default ``experiments/configs/<config_name>.py``) and ``--workdir``. Called from
    ``__main__``, not at import: tests import several entry points in one process, and absl defines a flag
    once per process."""
    import os

    from absl import flags

    define_config(os.path.join(os.path.dirname(__file__), "configs", f"{config_name}.py"), help_text)
    flags.DEFINE_string("workdir", None, "Run directory (default: config.workdir).")


def task_counts(tasks: tuple[str, ...], default: int, exceptions: str, flag: str) -> dict[str, int]:
    """Episodes per task: ``default``, except where ``exceptions`` ("task=n,...") says; a bad item is a
    ValueError naming ``flag``."""
    from histeve_jax.train.specs import task_number_pairs

    counts = {t: int(default) for t in tasks}
    try:
        pairs = task_number_pairs(exceptions, "episodes")
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from e
    for name, n in pairs:
        if name not in counts:
            raise ValueError(f"{flag}: {name!r} is not one of the recorded tasks {tuple(tasks)}")
        counts[name] = n
    return counts
