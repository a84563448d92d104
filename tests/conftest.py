import os
import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).parent))

from collections.abc import Iterator

import pytest
import torch

# NOTE: Triton reads TRITON_INTERPRET when it is imported; without a CUDA device its kernels can only run in
# the interpreter (on CPU tensors), so the kernel tests run there. With a device, the compiled kernels run.
# The one process-wide setting the suite makes on purpose: it is in place before any test module is imported.
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


# ------------------------------------------------------------------------------------------ global torch state
# The GPU suite runs every GPU test file in one process (benchmarks/gpu_suite.sh): a test, fixture or imported
# benchmark that leaves a process-wide setting changed (TF32 left on by a benchmark made 14 fp32 tests fail
# there) changes every later test. Each test and each module is checked: what it changed and left changed
# fails it, naming the setting, and is put back so later tests run as they would alone. Test modules must not
# change any of it when imported (checked once collection is done). Seeds are not checked (tests seed freely).
ENV_PREFIXES = ("DSCALE_", "TRITON_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG",
             "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


UNREADABLE = "unreadable (TF32 set through both the legacy and the fp32_precision API)"


def _settings() -> dict[str, tuple]:
    """name -> (getter, setter) of every process-wide setting checked, in the order they are restored."""
    b = torch.backends

    def attr(obj, name):
        return (lambda: getattr(obj, name)), (lambda value: setattr(obj, name, value))

    def legacy(get, set_):
        """A legacy TF32 getter, which torch makes raise once the fp32_precision API set a conflicting value:
        that reads as UNREADABLE (a change too) and is not restored through the legacy setter."""
        def read():
            try:
                return get()
            except RuntimeError:
                return UNREADABLE
        return read, (lambda value: None if value == UNREADABLE else set_(value))

    def precision(*path):
        """The fp32_precision API's value in effect at `path` ('none' inherits: cudnn.conv from cudnn from the
        global one, 'ieee' at the top); restored as that explicit value."""
        nodes = [b]
        for name in path:
            nodes.append(getattr(nodes[-1], name))

        def read():
            values = [getattr(n, "fp32_precision", "none") for n in reversed(nodes)]
            return next((v for v in values if v != "none"), "ieee")
        return read, (lambda value: setattr(nodes[-1], "fp32_precision", value))

    def deterministic_set(value):
        torch.use_deterministic_algorithms(value[0], warn_only=value[1])

    return {
        "torch.backends.cuda.matmul.fp32_precision": precision("cuda", "matmul"),
        "torch.backends.cudnn.conv.fp32_precision": precision("cudnn", "conv"),
        "torch.backends.cudnn.rnn.fp32_precision": precision("cudnn", "rnn"),
        # NOTE: set_float32_matmul_precision also sets allow_tf32, restored right after it
        "torch.get_float32_matmul_precision()": legacy(torch.get_float32_matmul_precision,
                                                       torch.set_float32_matmul_precision),
        "torch.backends.cuda.matmul.allow_tf32": legacy(*attr(b.cuda.matmul, "allow_tf32")),
        "torch.backends.cudnn.allow_tf32": legacy(*attr(b.cudnn, "allow_tf32")),
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            attr(b.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            attr(b.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
        "torch.backends.cudnn.enabled": attr(b.cudnn, "enabled"),
        "torch.backends.cudnn.benchmark": attr(b.cudnn, "benchmark"),
        "torch.backends.cudnn.deterministic": attr(b.cudnn, "deterministic"),
        "torch.are_deterministic_algorithms_enabled() (warn_only)": (
            lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
            deterministic_set),
        "torch.backends.cuda.flash_sdp_enabled()": (b.cuda.flash_sdp_enabled, b.cuda.enable_flash_sdp),
        "torch.backends.cuda.mem_efficient_sdp_enabled()": (b.cuda.mem_efficient_sdp_enabled,
                                                            b.cuda.enable_mem_efficient_sdp),
        "torch.backends.cuda.math_sdp_enabled()": (b.cuda.math_sdp_enabled, b.cuda.enable_math_sdp),
        "torch.get_default_dtype()": (torch.get_default_dtype, torch.set_default_dtype),
        "torch.get_default_device()": (torch.get_default_device, lambda device: torch.set_default_device(
            None if device == torch.device("cpu") else device)),  # NOTE: None drops the device mode altogether
        "torch.get_num_threads()": (torch.get_num_threads, torch.set_num_threads),
        "torch.is_grad_enabled()": (torch.is_grad_enabled, torch.set_grad_enabled),
        "torch.is_anomaly_enabled()": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    }


SETTINGS = _settings()


def _environment() -> dict[str, str | None]:
    names = set(ENV_NAMES) | {k for k in os.environ if k.startswith(ENV_PREFIXES)}
    return {k: os.environ.get(k) for k in sorted(names)}


def torch_state() -> dict:
    """The process-wide settings a test could leave changed: torch's (precision, backends, defaults, threads,
    grad and anomaly mode) and the environment variables the runtime, Triton and torch.distributed read."""
    state = {name: get() for name, (get, _) in SETTINGS.items()}
    state.update({f"os.environ[{k!r}]": v for k, v in _environment().items()})
    return state


def changed(before: dict, after: dict) -> dict[str, tuple]:
    return {k: (before.get(k), after.get(k)) for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)}


def restore(before: dict, diff: dict) -> None:
    """Puts the changed settings back, in `SETTINGS` order (the fp32_precision API, then the legacy TF32 flags)."""
    for name, (_, set_) in SETTINGS.items():
        if name in diff:
            set_(before[name])
    for key in diff:
        if key.startswith("os.environ["):
            var = key[len("os.environ['"):-2]
            if before.get(key) is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = before[key]


def describe(diff: dict) -> str:
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())


_AT_START = torch_state()
"""Before any test module is imported (this conftest is imported first)."""


def pytest_collection_finish(session):
    """Test modules (and what they import, benchmarks included) may not change the global state at import."""
    diff = changed(_AT_START, torch_state())
    if diff:
        restore(_AT_START, diff)
        pytest.exit(f"importing the test modules changed process-wide state (set it inside a test, fixture or "
                    f"function and restore it): {describe(diff)}", returncode=pytest.ExitCode.USAGE_ERROR)


def _check(what: str) -> Iterator[None]:
    before = torch_state()
    yield
    diff = changed(before, torch_state())
    if diff:
        restore(before, diff)
        pytest.fail(f"{what} left process-wide state changed (restore it, or scope it to a context manager): "
                    f"{describe(diff)}", pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _module_leaves_global_state():
    """Module-scoped fixtures (set up before, torn down after every test of the module) restore what they set."""
    yield from _check("this test module (its module-scoped fixtures)")


@pytest.fixture(autouse=True)
def _test_leaves_global_state():
    """Each test (with its function-scoped fixtures) leaves torch's process-wide state as it found it."""
    yield from _check("this test")
