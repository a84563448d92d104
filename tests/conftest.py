import os
import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).parent))

import torch

# NOTE: Triton reads TRITON_INTERPRET when it is imported; without a CUDA device its kernels can only run in
# the interpreter (on CPU tensors), so the kernel tests run there. With a device, the compiled kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
