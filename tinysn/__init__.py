"""tinysn: SuperNeurons-style CNN training under a hard GPU memory cap, in Python and Triton.

Importing tinysn on a machine without a CUDA GPU switches Triton to its interpreter
(TRITON_INTERPRET=1) before Triton is imported, so the same kernels run on the CPU.
"""
import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .errors import OutOfMemory  # noqa: E402
from .units import parse_bytes  # noqa: E402
from .tensor import Tensor  # noqa: E402
from . import pool  # noqa: E402
from .graph import Net, Layer  # noqa: E402
from . import models, data  # noqa: E402
from .sched.plan import plan, max_batch, POLICIES, Plan  # noqa: E402
from .runtime import Runtime  # noqa: E402
from .from_torch import from_torch  # noqa: E402

__all__ = ["OutOfMemory", "Tensor", "parse_bytes", "pool", "Net", "Layer", "models", "plan",
           "max_batch", "POLICIES", "Plan", "Runtime", "from_torch"]
