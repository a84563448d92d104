"""Paged KV cache for the target and the drafter, and the page allocator that bounds its memory.

Both caches are addressed by the same per-request page table: a request that holds a page holds it in
the target cache and in the drafter cache (the drafter needs room for context + one block, exactly as
the target needs room for context + one verification block). Page 0 is reserved as scratch: rows that
must write somewhere but matter to nobody (padding, DScale tail placeholders) write there.
"""

from __future__ import annotations

import torch

from dscale_runtime.models.layers import KVLayerCache

SCRATCH_PAGE = 0


class PageAllocator:
    """Free-list allocator of fixed-size pages; page 0 is never handed out."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages >= 2, "need at least one usable page besides the scratch page"
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, or None (and nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        assert SCRATCH_PAGE not in pages
        self._free.extend(reversed(pages))


class PagedKVCache:
    """K/V tensors [num_layers, num_pages * page_size, kv_heads, head_dim] with per-layer views."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.layers = [KVLayerCache(self.k[i], self.v[i], page_size) for i in range(num_layers)]
