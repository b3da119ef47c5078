"""Deployment: a trained run exported as a Hugging Face directory that PyTorch loads and acts with.

``python -m histeve_jax.export --run=<workdir> --out=<dir> [--detector=<detector run>]`` (``export_run``);
the modules:

- ``directory``: ``export_run`` / ``export_policy`` (the directory's layout, written atomically);
- ``hf_tensors``: the policy's safetensors, both RS-Norm rows, written tensor by tensor;
- ``action_tables``: the codebook, action tokens, grammar and id map as plain JSON/numpy;
- ``detector_export``: a detector run's completion detector, checked against the policy, as ``detector/``;
- ``modeling_histeve`` / ``histeve_action``: torch-only files copied into the directory (the RS-Norm
  Qwen2.5-VL for ``trust_remote_code`` and the PyTorch ``act``); importing this package does not import
  them (nor torch); ``modeling_histeve_detector``: the detector in torch (into ``detector/``), beside the
  exported policy.
"""

from histeve_jax.export.directory import ExportError, export_policy, export_run

__all__ = ["ExportError", "export_policy", "export_run"]
