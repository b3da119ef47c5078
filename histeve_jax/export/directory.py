"""A trained run as a Hugging Face directory that PyTorch loads and acts with (``export_run``).

The directory (written under ``<out>.tmp-<pid>-<random>`` and renamed to ``out`` only when complete, so no
partial export ever has the final name):

* ``config.json``: Qwen2.5-VL's config (the policy's vocabulary) with ``model_type: histeve``,
  ``norm_regimes: 2``, ``auto_map`` (``AutoConfig`` / ``AutoModelForImageTextToText`` -> the modeling file)
  and a ``histeve`` block (source run and step, codebook, the action files);
* ``modeling_histeve.py`` (the RS-Norm model) and ``histeve_action.py`` (the PyTorch act), copied;
* safetensors (``export.hf_tensors``: sharded by ``max_shard_size``, tensor by tensor);
* the tokenizer with the action tokens and the chat template, the image processor (the policy's fixed
  frame size), ``histeve_actions.json`` + ``action_grammar.npz`` (+ ``id_map.npy`` for tiny models):
  ``export.action_tables``.

With ``detector=`` (``--detector=<detector run>``: a detector run is its own workdir, pointing at the policy
run it read; ``export.detector_export``), the completion detector is ``detector/`` (its ``config.json``,
safetensors and ``modeling_histeve_detector.py``), named by the ``detector`` key of ``config.json``'s
``histeve`` block and of ``histeve_actions.json``; a detector that does not read the exported policy is
refused (one line naming both).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Any

import numpy as np

from histeve_jax.data.records import FRAME_FORMATS
from histeve_jax.export import action_tables, detector_export, hf_tensors

MODELING_FILE = "modeling_histeve.py"
ACTION_FILE = "histeve_action.py"
_HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """Bad input to an export (the run, the output directory, the options); the message names it."""


def check_out_dir(out: str, overwrite: bool) -> None:
    """Refuse an ``out`` that exists and is not an empty directory, unless ``overwrite``."""
    if os.path.exists(out) and not overwrite:
        if not os.path.isdir(out):
            raise ExportError(f"{out}: exists and is not a directory (pass --overwrite to replace it)")
        if os.listdir(out):
            raise ExportError(f"{out}: exists and is not empty (pass --overwrite to replace it)")


def hf_config(model_config: Any, *, dtype: str, histeve: dict[str, Any]) -> dict[str, Any]:
    """The exported ``config.json`` dict."""
    cfg = model_config.to_hf_dict()
    cfg.update({
        "architectures": ["HiSteveForConditionalGeneration"],
        "model_type": "histeve",
        "dtype": dtype,
        "norm_regimes": int(model_config.norm_regimes),
        "auto_map": {
            "AutoConfig": "modeling_histeve.HiSteveConfig",
            "AutoModelForImageTextToText": "modeling_histeve.HiSteveForConditionalGeneration",
        },
        "histeve": histeve,
    })
    return cfg


def export_policy(policy: Any, tokenizer: Any, out: str, *, frame_format: str, jpeg_quality: int = 95,
                  id_map: np.ndarray | None = None, stride: int = 1, history_in_regime: bool = False,
                  dtype: str | None = None,
                  max_shard_size: int | str = "5GB",
                  overwrite: bool = False, source: dict[str, Any] | None = None,
                  detector: detector_export.DetectorRun | None = None) -> str:
    """Writes the exported directory of ``policy`` (a ``histeve_jax.policy.Policy``) to ``out``.

    ``tokenizer``: the one the policy was trained with (action tokens added); ``frame_format`` and
    ``jpeg_quality``: the codec of its training frames (a run's ``data.frame_format``; the exported actor
    passes each frame through it, as ``LoadedPolicy`` does, png: none); ``id_map``: tokenizer id ->
    model id for tiny models; ``stride``/``history_in_regime``: the run's frame layout (``data.stride``,
    ``data.history_in_regime``); ``dtype``: the weights' dtype (default: the parameters'); ``detector``: a
    detector run's detector that reads this policy (``detector_export.load_detector_run``). Returns ``out``.
    """
    from transformers import Qwen2VLImageProcessorPil

    from histeve_jax.actions.tokens import ActionVocab

    out = os.path.abspath(out)
    check_out_dir(out, overwrite)
    config = policy.config
    model_config = policy.model.config
    dtype = dtype or np.dtype(model_config.param_dtype).name
    if dtype not in DTYPES:
        raise ExportError(f"--dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    if frame_format not in FRAME_FORMATS:
        raise ExportError(f"frame_format={frame_format!r}: expected one of {', '.join(FRAME_FORMATS)}")
    np_dtype = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(_bfloat16())
    tok_vocab = ActionVocab.from_tokenizer(tokenizer, config.codebook)
    mapped = tok_vocab.ids if id_map is None else np.asarray(id_map)[tok_vocab.ids]
    if not np.array_equal(mapped, config.vocab.ids):
        raise ExportError(f"the tokenizer's action ids {tok_vocab.ids[:2].tolist()}.. map to "
                          f"{mapped[:2].tolist()}.., the policy's are {config.vocab.ids[:2].tolist()}..")
    tables = action_tables.action_tables(config, tok_vocab, id_map=id_map, stride=stride,
                                         frame_format=frame_format, jpeg_quality=jpeg_quality,
                                         history_in_regime=history_in_regime)
    histeve = {"source": source or {}, "codebook": config.codebook, "actions": action_tables.ACTIONS_FILE,
               "action_module": ACTION_FILE}
    if detector is not None:
        histeve["detector"] = tables["detector"] = detector_export.SUBDIR

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    os.makedirs(tmp)
    try:
        hf_tensors.write_weights(policy.model, tmp, dtype=np_dtype, max_shard_size=max_shard_size)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config(model_config, dtype=dtype, histeve=histeve), f, indent=2)
        for fn in (MODELING_FILE, ACTION_FILE):
            shutil.copyfile(os.path.join(_HERE, fn), os.path.join(tmp, fn))
        tokenizer.save_pretrained(tmp)
        h, w = config.image_size
        Qwen2VLImageProcessorPil(min_pixels=h * w, max_pixels=h * w).save_pretrained(tmp)
        with open(os.path.join(tmp, action_tables.ACTIONS_FILE), "w") as f:
            json.dump(tables, f, indent=1)
        grammar = action_tables.grammar_arrays(config)
        np.savez_compressed(os.path.join(tmp, action_tables.GRAMMAR_FILE), **grammar)
        if id_map is not None:
            np.save(os.path.join(tmp, action_tables.ID_MAP_FILE), np.asarray(id_map, np.int32))
        if detector is not None:
            detector_export.write_detector(detector, config, tmp, dtype=dtype, np_dtype=np_dtype,
                                           max_shard_size=max_shard_size)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace(tmp: str, out: str) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (overwrite) is moved aside first, then removed."""
    old = None
    if os.path.lexists(out):
        old = f"{out}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None and os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old)
    elif old is not None:
        os.remove(old)


def _bfloat16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


def export_run(run: str, out: str, *, step: int | None = None, dtype: str | None = None,
               max_shard_size: int | str = "5GB", overwrite: bool = False, detector: str | None = None,
               detector_step: int | None = None) -> str:
    """Exports a run's workdir (its ``config.json`` and latest or given checkpoint) to ``out``, with the
    completion detector of the detector run ``detector`` (its latest or ``detector_step`` checkpoint)."""
    from histeve_jax.eval.policy_agent import load_run

    check_out_dir(os.path.abspath(out), overwrite)  # before the (slow) restore
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    loaded = load_run(run, step)
    det = None
    if detector:
        det = detector_export.load_detector_run(detector, loaded.policy, policy_run=run,
                                                policy_step=loaded.step, policy_stride=loaded.stride,
                                                step=detector_step)
    return export_policy(loaded.policy, loaded.processor.tokenizer, out, frame_format=loaded.frame_format,
                         jpeg_quality=loaded.jpeg_quality, id_map=loaded.id_map, stride=loaded.stride,
                         history_in_regime=loaded.history_in_regime, dtype=dtype,
                         max_shard_size=max_shard_size, overwrite=overwrite,
                         source={"run": os.path.abspath(run), "step": loaded.step}, detector=det)
