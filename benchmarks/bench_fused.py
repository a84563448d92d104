"""Micro-benchmark: the fused elementwise kernels (`kernels/triton_fused.py`) against their references
(`kernels/fused.py`) at Qwen3-8B sizes on one GPU.

RMSNorm, add + RMSNorm, q/k norm + RoPE (on strided views of the fused qkv projection) and SiLU x up, at
16 rows (a verify block) and 512 rows (a prefill chunk), each as back-to-back calls in one CUDA graph.

    python benchmarks/bench_fused.py
"""

from __future__ import annotations

import statistics

import torch

from dscale_runtime.kernels import fused
from dscale_runtime.kernels.triton_fused import (
    add_rms_norm_triton,
    qk_norm_rope_triton,
    rms_norm_triton,
    silu_mul_triton,
)


def bench(rows: tuple[int, ...] = (16, 512), dtype: torch.dtype = torch.bfloat16, hidden: int = 4096,
          num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, inter: int = 12288,
          calls: int = 50, repeats: int = 20) -> list[dict]:
    """Microseconds per call of each op through Triton and through its reference, on CUDA at Qwen3-8B sizes:
    `calls` back-to-back calls captured in one CUDA graph (as the verify forward runs), each replay timed with
    CUDA events, median over `repeats`. Needs a CUDA device."""
    assert torch.cuda.is_available(), "bench needs a CUDA device"
    eps, gen = 1e-6, torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    def per_call_us(fn) -> float:
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(samples)

    results = []
    for t in rows:
        x, delta, weight, head_w = randn(t, hidden), randn(t, hidden), randn(hidden), randn(head_dim)
        qkv = randn(t, (num_heads + 2 * num_kv_heads) * head_dim)  # the fused projection's output
        q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(t, num_kv_heads, head_dim)
        cos, sin, gate_up = randn(t, head_dim), randn(t, head_dim), randn(t, 2 * inter)
        ops = {
            "rms_norm": (lambda: rms_norm_triton(x, weight, eps), lambda: fused.rms_norm_ref(x, weight, eps)),
            "add_rms_norm": (lambda: add_rms_norm_triton(x, delta, weight, eps),
                             lambda: fused.add_rms_norm_ref(x, delta, weight, eps)),
            "q_norm_rope": (lambda: qk_norm_rope_triton(q, head_w, cos, sin, eps),
                            lambda: fused.qk_norm_rope_ref(q, head_w, cos, sin, eps)),
            "k_norm_rope": (lambda: qk_norm_rope_triton(k, head_w, cos, sin, eps),
                            lambda: fused.qk_norm_rope_ref(k, head_w, cos, sin, eps)),
            "silu_mul": (lambda: silu_mul_triton(gate_up), lambda: fused.silu_mul_ref(gate_up)),
        }
        for name, (fast, ref) in ops.items():
            fast_us, ref_us = per_call_us(fast), per_call_us(ref)
            results.append({"op": name, "rows": t, "triton_us": round(fast_us, 2), "ref_us": round(ref_us, 2),
                            "speedup": round(ref_us / fast_us, 2)})
    return results


if __name__ == "__main__":  # python benchmarks/bench_fused.py (needs a CUDA device)
    for row in bench():
        print(row)
