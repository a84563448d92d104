"""Prefix caching over the paged KV cache: full pages keyed by a chained hash of their tokens, shared by refcount.

A drop-in `PageAllocator`. A full page i of a token sequence has the key
blake2b(key_{i-1} + int64 little-endian bytes of tokens[i*P:(i+1)*P]), 16-byte digest, key_{-1} = b"", so a key
names the whole prefix up to the end of its page; a partial last page never has a key. Once a request's K/V
(target and drafter: they share page ids) for a prefix is written, `register` maps each full page's key to its
page; a later request with the same prefix gets those pages from `match` instead of recomputing them. Pages are
refcounted: a released page with a key stays cached (evictable, least recently released first) until `allocate`
needs it, a released page without one goes back to the free list.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence

from dscale_runtime.kv_cache import SCRATCH_PAGE, PageAllocator

KEY_BYTES = 16


def _next_key(prev: bytes, tokens: Sequence[int]) -> bytes:
    data = prev + struct.pack(f"<{len(tokens)}q", *tokens)
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


def page_keys(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """One chained key per full page of `token_ids` (a partial last page gets none)."""
    keys, key = [], b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        key = _next_key(key, token_ids[start:start + page_size])
        keys.append(key)
    return keys


class PrefixCachingAllocator(PageAllocator):
    """Refcounted page allocator that keeps released full pages cached by prefix key until they are needed."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}
        """Page -> key, for every page that holds a cached prefix (referenced or evictable)."""
        self._page_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached pages with refcount 0, least recently released first."""
        self._queries = 0
        self._query_tokens = 0
        self._hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: never-cached free pages plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages that hold a key (referenced or evictable)."""
        return len(self._key_of)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def evictable(self) -> list[int]:
        """Cached pages with refcount 0, in eviction order (least recently released first)."""
        return list(self._evictable)

    def _check_page(self, page: int, what: str) -> None:
        if page == SCRATCH_PAGE:
            raise ValueError(f"cannot {what} the scratch page {SCRATCH_PAGE}")
        if not 0 < page < self.num_pages:
            raise ValueError(f"cannot {what} page {page}: not in 1..{self.num_pages - 1}")

    def _uncache(self, page: int) -> None:
        del self._page_of[self._key_of.pop(page)]

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages with refcount 1, or None (and nothing taken) if fewer are free.

        Never-cached pages first (low ids first), then evicted cached pages, least recently released first."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        if count > self.num_free:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._uncache(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drops one reference per page (a page may appear as often as it is referenced).

        A page reaching refcount 0 becomes evictable if it has a key (the last page of `pages` first, so a
        prefix chain is evicted from its tail), else returns to the free list. Raises ValueError, freeing
        nothing, on the scratch page or on a page freed more often than it is referenced."""
        for page, times in Counter(pages).items():
            self._check_page(page, "free")
            if times > self._refs[page]:
                raise ValueError(f"double free: page {page} has refcount {self._refs[page]}, freed {times} times")
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def match(self, token_ids: Sequence[int], max_tokens: int | None = None, count: bool = True) -> list[int]:
        """Pages of the longest run of leading full pages of `token_ids` that are all cached, taking one
        reference on each; only pages entirely within the first `max_tokens` tokens when given.

        Counts one query of len(token_ids) tokens and len(result) * page_size hit tokens (with `count`; a caller
        that may give the match back counts it later with `count_query`)."""
        limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
        pages, key = [], b""
        for start in range(0, limit - self.page_size + 1, self.page_size):
            key = _next_key(key, token_ids[start:start + self.page_size])
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
        if count:
            self.count_query(len(token_ids), len(pages))
        return pages

    def count_query(self, query_tokens: int, hit_pages: int) -> None:
        """Count one query of `query_tokens` tokens that took `hit_pages` cached pages (the hit-rate counters)."""
        self._queries += 1
        self._query_tokens += query_tokens
        self._hit_tokens += hit_pages * self.page_size

    def cached_pages(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` (`page_keys` of a sequence) are cached: what `match` would return, without
        taking references or counting a query."""
        count = 0
        while count < len(keys) and keys[count] in self._page_of:
            count += 1
        return count

    def register(self, token_ids: Sequence[int], pages: list[int]) -> None:
        """Keys the full pages of `token_ids`, whose K/V is written in `pages` (pages[i] holds positions
        i*page_size...), so that `match` can return them.

        A page whose key is already cached at another page stays uncached (a duplicate); a page that already
        has a key keeps it. Every page must be referenced (AssertionError otherwise). Raises ValueError, changing
        nothing, when `pages` is too short, repeats a page, or has a keyed page that holds a different prefix."""
        if len(set(pages)) != len(pages):
            raise ValueError("register: a page appears twice in `pages`")
        for page in pages:
            self._check_page(page, "register")
            assert self._refs[page] > 0, f"register: page {page} is not referenced (refcount 0)"
        keys = page_keys(token_ids, self.page_size)
        if len(keys) > len(pages):
            raise ValueError(f"register: {len(keys)} full pages of tokens but only {len(pages)} pages")
        for page, key in zip(pages, keys):
            if self._key_of.get(page, key) != key:
                raise ValueError(f"register: page {page} already holds a different prefix")
        for page, key in zip(pages, keys):
            if page not in self._key_of and key not in self._page_of:
                self._key_of[page] = key
                self._page_of[key] = page

    def reset(self) -> None:
        """Forgets every cached key: evictable pages return to the free list (low ids handed out first),
        referenced pages stay with their holders, uncached. The hit-rate counters are kept."""
        self._free.extend(sorted(self._evictable, reverse=True))
        self._evictable.clear()
        self._key_of.clear()
        self._page_of.clear()

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens over all `match` calls (0 when none)."""
        return self._hit_tokens / self._query_tokens if self._query_tokens else 0.0

    @property
    def stats(self) -> dict[str, float]:
        """queries (match calls), query_tokens, hit_tokens, hit_rate."""
        return {"queries": self._queries, "query_tokens": self._query_tokens, "hit_tokens": self._hit_tokens,
                "hit_rate": self.hit_rate}
