"""Entry points (``python -m experiments.<name>``), their configs and the benchmarks.

Set before any of them imports TensorFlow (through clu and tensorflow-datasets): its C++ banners (oneDNN,
CUDA probing) would otherwise land between the progress bar and the results.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
