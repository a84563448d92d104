"""Where two greedy decodings of one target disagree, how close was the target's choice?

Lossless speculative greedy decoding reproduces target-only greedy decoding exactly in exact arithmetic;
in reduced precision (bf16) a verify forward over many rows and a decode forward over one row round
differently, so the two can part at a near-tie of the target's top two logits. `near_ties` finds the first
differing token of each differing pair and recomputes, in float32 with transformers over the shared
prefix, the target's top-1 minus top-2 logit there: a small margin is a near-tie, a large one a bug.
"""

from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def near_ties(target_folder: str | Path, prompts: list[str], a: list[list[int]], b: list[list[int]],
              device: str = "cpu") -> list[dict]:
    """[{prompt, first_difference, fp32_top2_margin}] for every i with a[i] != b[i] (prompts are text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pairs = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not pairs:
        return []
    tok = AutoTokenizer.from_pretrained(target_folder)
    model = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32).to(device).eval()
    found = []
    for i, x, y in pairs:
        j = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        ids = tok(prompts[i], add_special_tokens=False)["input_ids"] + x[:j]
        top = model(torch.tensor([ids], device=device)).logits[0, -1].topk(2).values
        found.append({"prompt": i, "first_difference": j, "fp32_top2_margin": round((top[0] - top[1]).item(), 4)})
    return found
