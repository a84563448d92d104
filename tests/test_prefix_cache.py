"""Prefix-caching page allocator (dscale_runtime/prefix_cache.py).

Oracles: a brute-force reference allocator (lists and linear scans, matches decided by comparing token tuples of
prefixes, never hashes) driven in lockstep with the real one by random request traffic; the plain `PageAllocator`
for traffic that never registers; blake2b computed here from the key definition for `page_keys`.
"""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from dscale_runtime.kv_cache import SCRATCH_PAGE, PageAllocator
from dscale_runtime.prefix_cache import PrefixCachingAllocator, page_keys


class ReferenceAllocator:
    """Obviously-correct model: a page's cached content is the token tuple of the whole prefix up to its end."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.refs = {page: 0 for page in range(1, num_pages)}
        self.free_list = list(range(num_pages - 1, 0, -1))  # handed out from the end
        self.prefix_of: dict[int, tuple[int, ...]] = {}  # cached page -> prefix tuple it holds
        self.lru: list[int] = []  # refcount-0 cached pages, least recently released first

    @property
    def num_free(self) -> int:
        return len(self.free_list) + len(self.lru)

    def find(self, prefix: tuple[int, ...]) -> int | None:
        found = [page for page, held in self.prefix_of.items() if held == prefix]
        assert len(found) <= 1
        return found[0] if found else None

    def allocate(self, count: int) -> list[int] | None:
        if count > self.num_free:
            return None
        pages = []
        for _ in range(count):
            if self.free_list:
                page = self.free_list.pop()
            else:
                page = self.lru.pop(0)
                del self.prefix_of[page]
            self.refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in reversed(pages):  # within one call the tail page counts as released first
            assert self.refs[page] > 0
            self.refs[page] -= 1
            if self.refs[page] == 0:
                (self.lru if page in self.prefix_of else self.free_list).append(page)

    def match(self, tokens: list[int], max_tokens: int | None) -> list[int]:
        limit = len(tokens) if max_tokens is None else max(0, min(max_tokens, len(tokens)))
        pages = []
        for i in range(limit // self.page_size):
            page = self.find(tuple(tokens[:(i + 1) * self.page_size]))
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self.refs[page] == 0:
                self.lru.remove(page)
            self.refs[page] += 1
        return pages

    def register(self, tokens: list[int], pages: list[int]) -> None:
        for i in range(len(tokens) // self.page_size):
            prefix = tuple(tokens[:(i + 1) * self.page_size])
            page = pages[i]
            if page in self.prefix_of:
                assert self.prefix_of[page] == prefix
            elif self.find(prefix) is None:
                self.prefix_of[page] = prefix

    def reset(self) -> None:
        self.free_list.extend(sorted(self.lru, reverse=True))
        self.lru = []
        self.prefix_of = {}


def assert_same_state(real: PrefixCachingAllocator, ref: ReferenceAllocator, num_pages: int) -> None:
    assert real.num_free == ref.num_free
    assert real.num_cached == len(ref.prefix_of)
    assert real.evictable() == ref.lru
    assert sorted(real._free) == sorted(ref.free_list)
    free, evictable = set(ref.free_list), set(ref.lru)
    for page in range(1, num_pages):
        assert real.refcount(page) == ref.refs[page]
        assert real.is_cached(page) == (page in ref.prefix_of)
        referenced = ref.refs[page] > 0
        assert referenced + (page in free) + (page in evictable) == 1, page
        if page in free:
            assert not real.is_cached(page)
    assert real.refcount(SCRATCH_PAGE) == 0 and not real.is_cached(SCRATCH_PAGE)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 3, 4])
    num_pages = rng.randint(6, 24)
    vocab = rng.choice([2, 3])
    stems = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4 * page_size))] for _ in range(3)]
    real, ref = PrefixCachingAllocator(num_pages, page_size), ReferenceAllocator(num_pages, page_size)
    requests: list[tuple[list[int], list[int]]] = []  # (tokens whose pages the request holds, its pages)
    evictions = hits = 0

    def random_tokens() -> list[int]:
        tokens = list(rng.choice(stems)) if rng.random() < 0.6 else []
        return tokens + [rng.randrange(vocab) for _ in range(rng.randint(0 if tokens else 1, 3 * page_size))]

    for _ in range(2500):
        op = rng.random()
        if op < 0.3:  # admit a request: match its prompt (all but the last token), allocate the rest
            tokens = random_tokens()
            max_tokens = len(tokens) - 1
            stats = real.stats
            peeked = real.cached_pages(page_keys(tokens[:max_tokens], page_size))
            assert real.stats == stats  # a peek counts no query and takes no reference
            matched = real.match(tokens, max_tokens)
            assert peeked == len(matched)
            assert matched == ref.match(tokens, max_tokens)
            assert len(matched) * page_size <= max_tokens
            hits += bool(matched)
            need = real.pages_for(len(tokens)) - len(matched)
            cached_before = real.num_cached
            free_list_before = len(real._free)
            fresh = real.allocate(need)
            assert fresh == ref.allocate(need)
            if fresh is None:
                real.free(matched)
                ref.free(matched)
            else:
                evictions += max(0, need - free_list_before)
                assert real.num_cached == cached_before - max(0, need - free_list_before)
                requests.append((tokens, matched + fresh))
        elif op < 0.4:  # a bare match of any token list; the caller holds what it got
            tokens = random_tokens()
            max_tokens = rng.choice([None, rng.randint(0, len(tokens) + 2)])
            matched = real.match(tokens, max_tokens)
            assert matched == ref.match(tokens, max_tokens)
            requests.append((tokens[:len(matched) * page_size], matched))
        elif op < 0.55 and requests:  # grow a request by a few tokens
            index = rng.randrange(len(requests))
            tokens, pages = requests[index]
            grown = tokens + [rng.randrange(vocab) for _ in range(rng.randint(1, 2 * page_size))]
            need = real.pages_for(len(grown)) - len(pages)
            fresh = real.allocate(need)
            assert fresh == ref.allocate(need)
            if fresh is not None:
                requests[index] = (grown, pages + fresh)
        elif op < 0.75 and requests:  # register what a request has written (all of it or a prefix)
            tokens, pages = rng.choice(requests)
            written = tokens[:rng.randint(0, len(tokens))] if rng.random() < 0.3 else tokens
            real.register(written, pages)
            ref.register(written, pages)
        elif op < 0.99 and requests:  # finish or preempt a request
            tokens, pages = requests.pop(rng.randrange(len(requests)))
            real.free(pages)
            ref.free(pages)
        elif op >= 0.99:
            real.reset()
            ref.reset()
        assert_same_state(real, ref, num_pages)
        assert all(SCRATCH_PAGE not in pages for _, pages in requests)
    # The traffic exercised the interesting paths.
    assert hits > 100 and evictions > 50


def test_without_register_behaves_like_page_allocator() -> None:
    rng = random.Random(7)
    for num_pages, page_size in [(2, 4), (9, 1), (33, 16)]:
        plain, caching = PageAllocator(num_pages, page_size), PrefixCachingAllocator(num_pages, page_size)
        held: list[list[int]] = []
        for _ in range(2000):
            if held and rng.random() < 0.45:
                pages = held.pop(rng.randrange(len(held)))
                plain.free(pages)
                caching.free(pages)
            else:
                count = rng.randint(0, num_pages // 2 + 1)
                got = plain.allocate(count)
                assert caching.allocate(count) == got
                if got is not None:
                    held.append(got)
                tokens = [rng.randrange(3) for _ in range(rng.randint(0, 3 * page_size))]
                assert caching.match(tokens) == []
            assert caching.num_free == plain.num_free
            assert caching.pages_for(37) == plain.pages_for(37)
        assert caching.num_cached == 0


def test_page_keys_definition() -> None:
    tokens = [5, -1, 2**40, 7, 7, 3, 9]
    keys = page_keys(tokens, 3)
    assert len(keys) == 2  # the partial last page [9] gets no key
    key0 = hashlib.blake2b(struct.pack("<3q", 5, -1, 2**40), digest_size=16).digest()
    key1 = hashlib.blake2b(key0 + struct.pack("<3q", 7, 7, 3), digest_size=16).digest()
    assert keys == [key0, key1]
    assert page_keys(tokens[:6], 3) == keys and page_keys(tokens[:5], 3) == keys[:1]
    assert page_keys([1, 2], 3) == [] and page_keys([], 3) == []
    # Chained: the same page content after different prefixes has different keys.
    assert page_keys([1, 2, 9, 9], 2)[1] != page_keys([2, 1, 9, 9], 2)[1]


def test_shared_prompt_shares_pages() -> None:
    alloc = PrefixCachingAllocator(16, 4)
    prompt = list(range(100, 112))  # exactly 3 full pages
    first = alloc.allocate(alloc.pages_for(len(prompt) + 1))
    alloc.register(prompt, first)
    assert alloc.num_cached == 3
    # A second request with the same prompt: all but the last token may come from the cache -> 2 pages.
    shared = alloc.match(prompt, max_tokens=len(prompt) - 1)
    assert shared == first[:2]
    assert [alloc.refcount(p) for p in first] == [2, 2, 1, 1]
    # Without the limit, all three full pages match.
    assert alloc.match(prompt + [1, 2]) == first[:3]
    alloc.free(first)
    assert [alloc.refcount(p) for p in first] == [2, 2, 1, 0]
    assert alloc.evictable() == []  # first[3] had no key: back to the free list
    alloc.free(first[:3])
    alloc.free(shared)
    assert alloc.evictable() == [first[2], first[1], first[0]]  # tail of the chain evicted first
    assert alloc.num_free == 15
    # Registering the same content in other pages leaves those uncached (duplicates).
    other = alloc.allocate(3)
    assert set(other).isdisjoint(first[:3])
    alloc.register(prompt, other)
    assert alloc.num_cached == 3 and not any(alloc.is_cached(p) for p in other)
    assert alloc.match(prompt) == first[:3]


def test_partial_page_never_matches() -> None:
    alloc = PrefixCachingAllocator(8, 4)
    tokens = [1, 2, 3, 4, 5, 6]
    pages = alloc.allocate(2)
    alloc.register(tokens, pages)
    assert alloc.num_cached == 1 and not alloc.is_cached(pages[1])
    assert alloc.match(tokens) == pages[:1]
    assert alloc.match([1, 2, 3]) == []
    assert alloc.match([9, 2, 3, 4, 5, 6, 7, 8]) == []  # first-page miss stops the chain


def test_max_tokens_limits_match() -> None:
    alloc = PrefixCachingAllocator(8, 2)
    tokens = [3, 1, 4, 1, 5, 9]
    pages = alloc.allocate(3)
    alloc.register(tokens, pages)
    assert [len(alloc.match(tokens, max_tokens=m)) for m in range(-1, 9)] == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3]


def test_allocate_evicts_lru_only_when_free_list_empty() -> None:
    alloc = PrefixCachingAllocator(7, 1)  # 6 usable pages
    a, b = alloc.allocate(2), alloc.allocate(2)
    alloc.register([10, 11], a)
    alloc.register([20, 21], b)
    alloc.free(b)  # released first: b[1] then b[0]
    alloc.free(a)
    assert alloc.evictable() == [b[1], b[0], a[1], a[0]]
    assert alloc.num_free == 6 and alloc.num_cached == 4
    fresh = alloc.allocate(2)  # the two never-cached pages
    assert set(fresh).isdisjoint(a + b) and alloc.num_cached == 4
    assert alloc.allocate(3) == [b[1], b[0], a[1]]
    assert alloc.num_cached == 1 and alloc.evictable() == [a[0]]
    assert alloc.match([20, 21]) == [] and alloc.match([10, 11]) == [a[0]]
    assert alloc.num_free == 0


def test_allocate_none_takes_nothing() -> None:
    alloc = PrefixCachingAllocator(5, 2)
    held = alloc.allocate(2)
    alloc.register([1, 2, 3, 4], held)
    alloc.free(held[:1])
    assert alloc.num_free == 3
    before = (alloc.num_free, alloc.evictable(), sorted(alloc._free), alloc.num_cached)
    assert alloc.allocate(4) is None
    assert (alloc.num_free, alloc.evictable(), sorted(alloc._free), alloc.num_cached) == before
    assert alloc.allocate(0) == []
    assert len(alloc.allocate(3)) == 3 and alloc.num_free == 0


def test_double_free_and_scratch_page_raise() -> None:
    alloc = PrefixCachingAllocator(6, 2)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[:1])
    shared = alloc.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(shared + shared)
    assert alloc.refcount(shared[0]) == 1  # the failed call freed nothing
    with pytest.raises(ValueError, match="scratch"):
        alloc.free([SCRATCH_PAGE])
    with pytest.raises(ValueError, match="scratch"):
        alloc.register([1, 2], [SCRATCH_PAGE])
    with pytest.raises(AssertionError, match="not referenced"):
        alloc.register([1, 2], pages[1:])
    with pytest.raises(ValueError, match="only 1 pages"):
        alloc.register([1, 2, 3, 4], shared)
    # All pages out, none of them scratch.
    everything = shared + alloc.allocate(alloc.num_free)
    assert sorted(everything) == list(range(1, 6))
    alloc.register([1, 2] * 5, everything)
    assert SCRATCH_PAGE not in alloc.match([1, 2] * 5)


def test_register_rejects_a_page_holding_another_prefix() -> None:
    alloc = PrefixCachingAllocator(6, 2)
    pages = alloc.allocate(2)
    alloc.register([1, 2, 3, 4], pages)
    with pytest.raises(ValueError, match="different prefix"):
        alloc.register([1, 2, 5, 6], pages)
    alloc.register([1, 2, 3, 4, 5], pages)  # the same prefix again is fine
    assert alloc.match([1, 2, 3, 4]) == pages


def test_reset_forgets_keys() -> None:
    alloc = PrefixCachingAllocator(6, 2)
    held, released = alloc.allocate(1), alloc.allocate(2)
    alloc.register([1, 2], held)
    alloc.register([3, 4, 5, 6], released)
    alloc.free(released)
    alloc.reset()
    assert alloc.num_cached == 0 and alloc.evictable() == [] and alloc.num_free == 4
    assert alloc.match([1, 2]) == [] and alloc.match([3, 4, 5, 6]) == []
    alloc.free(held)  # uncached now: back to the free list
    assert alloc.evictable() == [] and alloc.num_free == 5
    assert alloc.allocate(5) == [1, 2, 3, 4, 5]


def test_hit_rate_counts() -> None:
    alloc = PrefixCachingAllocator(8, 2)
    assert alloc.stats == {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0}
    assert alloc.hit_rate == 0.0
    pages = alloc.allocate(2)
    alloc.register([1, 2, 3, 4], pages)
    alloc.match([7, 7, 7])  # 3 tokens, 0 hits
    alloc.match([1, 2, 3, 4, 5], max_tokens=4)  # 5 tokens, 4 hits
    alloc.match([1, 2, 9])  # 3 tokens, 2 hits
    assert alloc.stats == {"queries": 3, "query_tokens": 11, "hit_tokens": 6, "hit_rate": 6 / 11}
    assert alloc.hit_rate == 6 / 11
    held = alloc.match([1, 2, 3, 4, 5], count=False)  # a match the caller counts itself, if it keeps it
    assert len(held) == 2 and alloc.stats["queries"] == 3
    alloc.count_query(5, len(held))
    assert alloc.stats == {"queries": 4, "query_tokens": 16, "hit_tokens": 10, "hit_rate": 10 / 16}
