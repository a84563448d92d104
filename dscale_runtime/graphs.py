"""CUDA-graph capture of a pure tensor function over fixed-address inputs, with an eager twin (DESIGN 3.6).

`GraphedCall(fn, use_graph)` captures `fn()` once (after warm-up calls on a side stream) into a memory pool
that every graph of the runner shares, and replays it on each call; with `use_graph=False` each call runs
`fn` eagerly, which is what CPU runs and the graph tests' oracle do.
"""

from __future__ import annotations

import gc

import torch


class GraphedCall:
    """`fn()` -> outputs, captured once as a CUDA graph and replayed by `__call__`; eager when not `use_graph`.

    Inputs are whatever fixed-address tensors `fn` reads; outputs keep their addresses across replays.
    NOTE: graphs sharing one pool may replay in any order as long as every graph's inputs and outputs stay
    referenced (they do: the runner holds them); only intermediates are reused across graphs."""

    def __init__(self, fn, use_graph: bool, warmup: int = 2, pool=None) -> None:
        self.fn = fn
        self.graph = None
        self.outputs = None
        if not use_graph:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # NOTE: a garbage collection during capture may free an unreachable older graph (a step and its parts
        # can form a reference cycle), a CUDA call that invalidates the capture: the collector stays off until the
        # capture ends. No full collection here: it costs ~0.2 s in a large process, paid per graph; whoever
        # captures many (`StepRunner.prepare`, `PrefillRunner.prepare`) collects once before them (`collect_garbage`).
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = fn()
        finally:
            if enabled:
                gc.enable()
        self.graph.replay()  # NOTE: capture records without running; fill the outputs once

    def __call__(self):
        if self.graph is None:
            self.outputs = self.fn()
        else:
            self.graph.replay()
        return self.outputs


def collect_garbage(device: torch.device | str) -> None:
    """Free what dropped graphs and steps still hold (they can sit in reference cycles) before capturing many: one
    full collection, then the allocator's cache returned, on CUDA only."""
    if torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_times(fn, reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls of `fn()`, timed by CUDA events on the current stream."""
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples
