"""Top-k / top-p without sorting the vocabulary: a per-row threshold on the scaled logits, found by radix select.

The rule (vLLM / SGLang practice, made exact). Every row's policy works on its scaled logits
s = (l - max l) * (1 / T) in fp32 (s <= 0, s = 0 at the row's argmax; the same s as the unfiltered policy) and
their weights w = exp(s). Filters keep a set {x : s_x >= floor} (a threshold, so ties are never split):
- top-k (0 < k < V): keep x iff s_x >= the k-th largest s of the row (every token tied with it stays, so a
  row may keep more than k tokens); k <= 0 or k >= V keeps every token;
- top-p (p < 1), on what top-k kept: keep x iff M(x) < p * Z, M(x) being the mass of the kept tokens strictly
  more likely than x (s_y > s_x) and Z the kept mass; the most likely tokens (s = 0) always stay; p >= 1 keeps
  all. Tied tokens share M(x), so they are kept or dropped together.
Ties are equal s (two logits that 1 / T rounds to one s tie too). The sort this replaces kept exactly k tokens
and split ties at either boundary by the sort's whim; on bf16 logits ties are common (top_k 50 on Qwen3-sized
random rows keeps 50-57 tokens), and the kept set now never depends on the tokens' order in the vocabulary.
Masses are exact integers: each weight counts as q = floor(w * 2^MASS_BITS) units (int64; w <= 1, so a row
sums below 2^58), added in any order with the same result, and the test M < p * Z compares float64(M) with
float64(p) * float64(Z). So the sorting reference and the radix searches (torch and Triton) agree bit for bit
on the kept set whenever they agree on w; weights below 2^-40 of the top one count as zero mass (top-p then
drops them unless p >= 1: at most V * 2^-40 < 1.4e-7 of the mass).

Paths, all returning the per-row `floor` (fp32, -inf where a row keeps everything):
- `filter_keep_ref`: the definition, by sorting (the oracle; mask [R, V]);
- `filter_floor_radix`: portable torch, capturable (no host reads, static shapes): the order key of x is the
  bit pattern of |s_x| (31 bits; smaller key = more likely), and a search finds the smallest key v with
  F(v) = sum over keys <= v of (1 per token for top-k, q for top-p) reaching the target, in DIGITS rounds of a
  histogram over the next digit of the keys sharing the prefix found so far (three passes over the row per
  filter);
- `filter_floor`: the router; 'triton' runs the same rounds in `triton_filters.py` (imported lazily).
"""

from __future__ import annotations

import torch

from dscale_runtime.kernels.choice import auto_backend, check_backend

MASS_BITS = 40  # a weight w counts as floor(w * 2^MASS_BITS) mass units
KEY_BITS = 31  # order keys: the bits of |s| (sign dropped; s <= 0)
DIGITS = (11, 10, 10)  # bits per radix round, most significant first (sum = KEY_BITS)
KEY_ALL = 0x7F800000  # the key of s = -inf: a threshold there keeps every token
ROW_PROGRAM_VOCAB = 8192  # Triton: rows of at most this many tokens take one program per row (one launch)


def scaled_logits(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (any float dtype), shift [R] (row max), inv_t [R] -> s [R, V] fp32, the policy's own."""
    return (logits.float() - shift.float()[:, None]) * inv_t.float()[:, None]


def order_keys(s: torch.Tensor) -> torch.Tensor:
    """s [R, V] fp32 <= 0 -> int32 keys, bits of |s|: key order = likelihood order (0: the argmax)."""
    return s.contiguous().view(torch.int32) & 0x7FFFFFFF


def mass_units(s: torch.Tensor) -> torch.Tensor:
    """s [R, V] fp32 -> int64 floor(exp(s) * 2^MASS_BITS) (the scaling is exact in fp32)."""
    return (torch.exp(s) * float(2**MASS_BITS)).long()


def floor_of_key(key: torch.Tensor) -> torch.Tensor:
    """Threshold keys [R] int64 -> fp32 floors: s >= floor  <=>  order key <= key."""
    return -(key.clamp(0, KEY_ALL).to(torch.int32).view(torch.float32))


def _active(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (top_k > 0) & (top_k < vocab), top_p < 1


def filter_keep_ref(s: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition, by sorting: s [R, V] fp32, top_k [R] int64, top_p [R] fp32 -> kept [R, V] bool."""
    r, vocab = s.shape
    keys, q = order_keys(s), mass_units(s)
    sorted_keys, order = keys.sort(dim=-1)  # most likely first; tie order is irrelevant below
    k_on, p_on = _active(top_k, top_p, vocab)
    kth = sorted_keys.gather(1, (torch.where(k_on, top_k, vocab) - 1)[:, None])  # [R, 1] k-th largest's key
    in_k = sorted_keys <= kth  # every token tied with the k-th stays
    q_sorted = q.gather(1, order) * in_k
    z = q_sorted.sum(-1, keepdim=True)  # [R, 1] the kept mass
    group_start = torch.searchsorted(sorted_keys, sorted_keys, right=False)  # first index of each tie group
    mass_before = (q_sorted.cumsum(-1) - q_sorted).gather(1, group_start)  # M(x): strictly more likely tokens
    inside_p = mass_before.double() < top_p.double()[:, None] * z.double()
    keep_sorted = in_k & (inside_p | ~p_on[:, None] | (group_start == 0))  # the top group always stays
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def _radix_search(keys: torch.Tensor, weights: torch.Tensor | None, reached, graph_safe: bool) -> torch.Tensor:
    """Smallest key v per row with reached(F(v)), F(v) = the sum of `weights` [R, V] int64 (None: 1 per token)
    over tokens with keys <= v (keys [R, V] int32; reached: int64 [R, bins] -> bool, monotone in F), or all
    ones (2^31 - 1) where no v reaches -> [R] int64.

    NOTE: `graph_safe` (CUDA): every round reads all R x V tokens (static shapes); else (CPU) the rounds after
    the first keep only the tokens that share the first digit found (a small fraction of the row)."""
    r, device = keys.shape[0], keys.device
    rows = None  # [n] row of each token once compacted (CPU); None: the [R, V] layout
    counted = torch.ones_like(keys) if weights is None else weights
    prefix = torch.zeros(r, dtype=torch.int32, device=device)
    below = torch.zeros(r, 1, dtype=torch.int64, device=device)  # F just below the prefix's range
    high = KEY_BITS
    for i, bits in enumerate(DIGITS):
        low, bins = high - bits, 1 << bits
        if i == 1 and not graph_safe:  # compact: the tokens in the chosen first-digit bin, with weight
            at = (((keys >> high) == prefix[:, None]) & (counted > 0)).nonzero(as_tuple=True)
            rows, keys, counted = at[0], keys[at], counted[at]
        digit = ((keys >> low) & (bins - 1)).long()
        if rows is None:  # [R, V]: round 0 counts every token, later rounds those sharing the prefix
            added = counted if i == 0 else torch.where((keys >> high) == prefix[:, None], counted, 0)
            hist = added.new_zeros(r, bins).scatter_add_(1, digit, added)
        else:
            added = torch.where((keys >> high) == prefix[rows], counted, 0)
            hist = added.new_zeros(r * bins).scatter_add_(0, rows * bins + digit, added).view(r, bins)
        cum = hist.long().cumsum(-1)  # [R, bins]
        hit = reached(below + cum)
        first = torch.where(hit.any(-1, keepdim=True), hit.int().argmax(-1, keepdim=True), bins - 1)
        below = below + torch.where(first > 0, cum.gather(1, (first - 1).clamp_min(0)), 0)
        prefix = (prefix << bits) | first.view(-1).int()
        high = low
    return prefix.long()


def filter_floor_radix(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, graph_safe: bool | None = None) -> torch.Tensor:
    """The portable sort-free path: logits [R, V], shift / inv_t / top_k / top_p [R] -> floor [R] fp32.
    `graph_safe` (default: on CUDA tensors): static shapes and no host reads; off, the CPU shortcuts
    (compaction, skipping a search no row needs), the same floors."""
    s = scaled_logits(logits, shift, inv_t)
    vocab = s.shape[1]
    keys = order_keys(s)
    k_on, p_on = _active(top_k, top_p, vocab)
    graph_safe = s.is_cuda if graph_safe is None else graph_safe
    need_k, need_p = (True, True) if graph_safe else (bool(k_on.any()), bool(p_on.any()))
    key_k = torch.full_like(top_k, KEY_ALL)
    if need_k:
        k = torch.where(k_on, top_k, vocab)[:, None]
        key_k = torch.where(k_on, _radix_search(keys, None, lambda count: count >= k, graph_safe), KEY_ALL)
    if not need_p:
        return floor_of_key(key_k)
    q = torch.where(keys <= key_k[:, None], mass_units(s), 0)  # [R, V] the masses top-k kept
    target = top_p.double()[:, None] * q.sum(-1, keepdim=True).double()  # p * Z
    key_p = _radix_search(keys, q, lambda mass: mass.double() >= target, graph_safe)
    return floor_of_key(torch.where(p_on, torch.minimum(key_p, key_k), key_k))


def filter_floor(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The rows' floors [R] fp32 through the path `backend` names (the sampler's: the target's `fused`)."""
    check_backend(backend, "DSCALE_FUSED")
    if backend == "auto":
        backend = auto_backend(logits.device, logits.dtype)
    if backend == "ref" or logits.shape[0] == 0:
        return filter_floor_radix(logits, shift, inv_t, top_k, top_p)
    from dscale_runtime.kernels.triton_filters import filter_floor_triton

    return filter_floor_triton(logits if logits.stride(-1) == 1 else logits.contiguous(), shift, inv_t, top_k, top_p)
