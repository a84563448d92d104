import os
import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).parent))

import pytest
import torch

# NOTE: Triton reads TRITON_INTERPRET when it is imported; without a CUDA device its kernels can only run in
# the interpreter (on CPU tensors), so the kernel tests run there. With a device, the compiled kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def interpreter():
    """Skips unless the Triton kernels run in Triton's interpreter (CPU machines with triton installed); keeps
    torch on one thread meanwhile (torch's CPU threads and the interpreter's numpy work slow each other down)."""
    from dscale_runtime.kernels.choice import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    from dscale_runtime.kernels import triton_fused

    if not triton_fused.interpreted():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (CUDA machine: the gpu tests run instead)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
