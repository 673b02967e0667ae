"""Per-request block lists on top of the BlockPool: allocation by token count, prefix-cache lookup.

Torch-free. The scheduler asks `allocate_slots(request, n)` before scheduling n more tokens of a
request; `None` means the pool cannot serve them now (the scheduler then preempts or waits).
The pools and the per-request lists are private: callers use the methods, and read counters from `stats`.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from functools import lru_cache

from iterserve.kv.block_pool import Block, BlockPool
from iterserve.request import Request


_NO_BLOCKS: tuple = ()  # allocate_slots' answer when no new block is needed (never mutated)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    """128-bit chained hash of a full block: equal hashes mean equal prefixes, not just equal blocks."""
    data = (parent or b"") + _int64s(len(token_ids)).pack(*token_ids)
    if salt:
        data += salt.encode()
    return hashlib.blake2b(data, digest_size=16).digest()


@lru_cache(maxsize=None)
def _int64s(n: int) -> struct.Struct:
    """n native int64s: the bytes of array('q', ids), packed without building an array first."""
    return struct.Struct(f"{n}q")


@dataclass(slots=True, frozen=True)
class KVCacheStats:
    """The KV manager's counters, handed to the engine's stats (engine/stats.py)."""

    usage: float  # fraction of device blocks in use
    num_blocks: int
    num_free_blocks: int
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    num_prefix_hits: int  # of those, tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 watermark: float = 0.0, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self._pool = BlockPool(num_blocks, enable_caching)
        self._host_pool = BlockPool(max(num_host_blocks, 1), enable_caching=False)
        self._num_host_blocks = num_host_blocks
        self._req_host_blocks: dict[str, list[Block]] = {}  # swapped-out requests' blocks, in order
        self._watermark_blocks = int(watermark * num_blocks)
        self._req_blocks: dict[str, list[Block]] = {}
        self._req_block_ids: dict[str, list[int]] = {}  # the block table handed to the executor
        # How many of the request's leading full blocks are registered in the prefix cache; their
        # hashes are the request's own (Request.block_hashes).
        self._req_num_cached: dict[str, int] = {}
        # Prompt blocks that a running request will compute but has not yet: hash -> that request's id.
        # A request sharing them waits a step or two instead of computing the same prefix twice.
        self._computing: dict[bytes, str] = {}
        self._req_computing: dict[str, list[bytes]] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self._pool.usage

    @property
    def stats(self) -> KVCacheStats:
        return KVCacheStats(usage=self.usage, num_blocks=self.num_blocks, num_free_blocks=self.num_free_blocks,
                            num_prefix_queries=self.num_prefix_queries, num_prefix_hits=self.num_prefix_hits)

    @property
    def max_tokens_per_request(self) -> int:
        """The longest sequence that can ever be admitted alone."""
        return (self.num_blocks - self._watermark_blocks) * self.block_size

    def blocks_of(self, request_id: str) -> list[Block]:
        return self._req_blocks.get(request_id, [])

    def block_table(self, request_id: str) -> list[int]:
        return self._req_block_ids.setdefault(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Cached blocks of the request's longest cached prefix, and the tokens they hold.

        The last token is never served from the cache, so the step that computes it yields logits.
        A request that asks for prompt logprobs is served nothing: a cached block has no logits.
        """
        if not self._pool.enable_caching or request.num_computed_tokens > 0 \
                or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        cached = self._pool.cached
        hits: list[Block] = []
        for h in self._block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's block hashes, at least its first `num_blocks` (all full blocks); each is
        hashed once in the request's life, however often it waits, is preempted or is looked up."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            bs, tokens, salt = self.block_size, request.token_ids, request.prefix_salt
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_blocks):
                parent = hash_block(parent, tokens[i * bs:(i + 1) * bs], salt)
                hashes.append(parent)
        return hashes

    def prefix_in_flight(self, request: Request, computed: list[Block]) -> int:
        """Tokens just past the cached prefix that another running request is computing right now."""
        if not self._computing:
            return 0
        bs, computing = self.block_size, self._computing
        hashes = self._block_hashes(request, (request.num_tokens - 1) // bs)
        num_tokens = 0
        for i in range(len(computed), (request.num_tokens - 1) // bs):
            if hashes[i] not in computing:
                break
            num_tokens += bs
        return num_tokens

    def mark_computing(self, request: Request, computed: list[Block]) -> None:
        """Promise the request's uncached full prompt blocks (see `_computing`); called on admission."""
        if not self._pool.enable_caching:
            return
        num_blocks = request.num_prompt_tokens // self.block_size
        hashes = self._block_hashes(request, num_blocks)
        promised = []
        for i in range(len(computed), num_blocks):
            h = hashes[i]
            if h not in self._computing and self._pool.lookup(h) is None:
                self._computing[h] = request.request_id
                promised.append(h)
        if promised:
            self._req_computing[request.request_id] = promised

    def _drop_promises(self, request_id: str) -> None:
        for h in self._req_computing.pop(request_id, ()):
            if self._computing.get(h) == request_id:
                del self._computing[h]

    def can_admit(self, request: Request, num_tokens: int, computed: list[Block] = ()) -> bool:
        """Whether `num_tokens` tokens of a new request fit, keeping the watermark free."""
        reusable_free = sum(1 for b in computed if b.ref_cnt == 0)  # cached but sitting in the free queue
        needed = cdiv(num_tokens, self.block_size) - len(computed)
        return self._pool.num_free_blocks - reusable_free - needed >= self._watermark_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[Block] = ()) -> list[Block] | tuple | None:
        """Blocks so that the request's first num_computed + len(computed)*bs + num_new tokens have slots."""
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        if blocks is not None and not computed and \
                request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
            return _NO_BLOCKS  # the common decode step: the last block still has room
        blocks = self._req_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed)
        reusable_free = sum(1 for b in computed if b.ref_cnt == 0)
        if needed > self._pool.num_free_blocks - reusable_free:
            return None
        if computed or num_computed == 0:  # a first admission: count it for the hit rate
            self.num_prefix_queries += request.num_tokens
            self.num_prefix_hits += len(computed) * self.block_size
        if computed:
            self._pool.touch(list(computed))
            blocks.extend(computed)
        new = self._pool.allocate(max(needed, 0))
        blocks.extend(new)
        self._req_block_ids.setdefault(rid, []).extend(b.block_id for b in (*computed, *new))
        return new

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks so later requests can reuse them."""
        if not self._pool.enable_caching:
            return
        rid, bs = request.request_id, self.block_size
        num_cached = self._req_num_cached.get(rid, 0)
        if num_cached >= request.num_computed_tokens // bs:
            return  # no block filled up since the last call
        blocks = self._req_blocks.get(rid, [])
        num_full = min(request.num_computed_tokens // bs, len(blocks))
        hashes = self._block_hashes(request, num_full)
        for i in range(num_cached, num_full):
            self._pool.register(blocks[i], hashes[i])
            self._computing.pop(hashes[i], None)
        self._req_num_cached[rid] = max(num_cached, num_full)

    def cached_hashes(self, request: Request) -> list[bytes]:
        """The prefix hashes of the request's leading blocks registered in the cache (none without caching)."""
        return request.block_hashes[:self._req_num_cached.get(request.request_id, 0)]

    def register_hashes(self, request: Request, hashes: list[bytes]) -> None:
        """Blocks filled from outside (disaggregated prefill): adopt the sender's hashes of the full
        blocks, so later requests hit them and cache_full_blocks carries on after them."""
        if not self._pool.enable_caching:
            return
        rid = request.request_id
        blocks = self._req_blocks[rid]
        assert len(hashes) <= min(len(blocks), request.num_computed_tokens // self.block_size), (rid, len(hashes))
        self._req_num_cached[rid] = len(hashes)
        if request.block_hashes[:len(hashes)] != hashes:
            request.block_hashes = list(hashes)  # later blocks chain on from the sender's
        for block, h in zip(blocks, hashes):
            self._pool.register(block, h)

    def can_swap_out(self, request: Request) -> bool:
        return len(self.blocks_of(request.request_id)) <= min(self._host_pool.num_free_blocks, self._num_host_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool; returns (device block, host block) copies."""
        rid = request.request_id
        blocks = self._req_blocks.pop(rid)
        host = self._host_pool.allocate(len(blocks))
        self._req_host_blocks[rid] = host
        self._req_block_ids.pop(rid, None)
        self._req_num_cached.pop(rid, None)
        self._drop_promises(rid)
        self._pool.free(blocks[::-1])
        return [(d.block_id, h.block_id) for d, h in zip(blocks, host)]

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        needed = max(cdiv(request.num_computed_tokens + num_new_tokens, self.block_size),
                     len(self._req_host_blocks[request.request_id]))
        return self._pool.num_free_blocks - needed >= self._watermark_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back; returns (host block, device block) copies."""
        rid = request.request_id
        host = self._req_host_blocks.pop(rid)
        blocks = self._pool.allocate(len(host))
        self._req_blocks[rid] = blocks
        self._req_block_ids[rid] = [b.block_id for b in blocks]
        self._host_pool.free(host[::-1])
        return [(h.block_id, d.block_id) for h, d in zip(host, blocks)]

    def free(self, request: Request) -> None:
        host = self._req_host_blocks.pop(request.request_id, None)
        if host:
            self._host_pool.free(host[::-1])
        blocks = self._req_blocks.pop(request.request_id, [])
        self._req_block_ids.pop(request.request_id, None)
        self._req_num_cached.pop(request.request_id, None)
        self._drop_promises(request.request_id)
        self._pool.free(blocks[::-1])
