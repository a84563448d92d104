"""Skip markers shared by the kernel tests: Triton installed (interpreter runs on CPU), CUDA + Triton (compiled)."""

from __future__ import annotations

import pytest
import torch

from dscale_runtime.kernels import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")
