"""The policy-coupled completion detector (a pruned Qwen2.5-VL-3B decoder reading the policy), one concern
per module:

- ``config``: ``DetectorConfig`` (decoder shape, the policy it reads, frames, lengths), ``tiny_config``,
  ``qwen3b_config``, ``check_policy`` (a mismatched policy is one line naming both);
- ``model``: ``Detector`` (the port's ``TextModel`` + ``CrossAttention`` after every n-th layer + 2-way head),
  ``parameter_count`` (by abstract evaluation);
- ``coupled``: ``CoupledDetector`` (frozen policy + detector; frames encoded once by the policy's tower);
- ``prune``: structured FFN pruning from a Hugging Face directory, the pruned detector's I/O;
- ``inputs``: one query's arrays (prompts, frames); ``data``: labels from records, balanced queries,
  splits, the grain batches; ``loss``: the loss, binary metrics, threshold calibration;
- ``stage``: the train loop's ``Stage``; ``predict``: probabilities, the trained module from a workdir;
- ``monitor``: the detector in the loop (``CompletionMonitor``, ``MonitoredAgent``, ``first_signal``);
- ``plan``: the AOT compile of the detector's step; ``vlm_baseline``: a prompted VLM through an endpoint.
"""

from histeve_jax.detector.config import DetectorConfig, qwen3b_config, tiny_config
from histeve_jax.detector.coupled import CoupledDetector, frame_slots
from histeve_jax.detector.model import CrossAttention, Detector, parameter_count

__all__ = ["CoupledDetector", "CrossAttention", "Detector", "DetectorConfig", "frame_slots",
           "parameter_count", "qwen3b_config", "tiny_config"]
