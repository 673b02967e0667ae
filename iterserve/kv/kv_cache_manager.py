"""Per-request block lists on top of the BlockPool: allocation by token count, prefix-cache lookup.

Torch-free. The scheduler asks `allocate_slots(request, n)` before scheduling n more tokens of a
request; `None` means the pool cannot serve them now (the scheduler then preempts or waits).
"""
from __future__ import annotations

import hashlib
import struct
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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 watermark: float = 0.0, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.host_pool = BlockPool(max(num_host_blocks, 1), enable_caching=False)
        self.num_host_blocks = num_host_blocks
        self.req_host_blocks: dict[str, list[Block]] = {}  # swapped-out requests' blocks, in order
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the block table handed to the executor
        self.req_hashes: dict[str, list[bytes]] = {}  # hashes of the request's full blocks, in order
        # Prompt blocks that a running request will compute but has not yet: hash -> that request's id.
        # A request sharing them waits a step or two instead of computing the same prefix twice.
        self.computing: dict[bytes, str] = {}
        self.req_computing: dict[str, list[bytes]] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def max_tokens_per_request(self) -> int:
        """The longest sequence that can ever be admitted alone."""
        return (self.num_blocks - self.watermark_blocks) * self.block_size

    def blocks_of(self, request_id: str) -> list[Block]:
        return self.req_blocks.get(request_id, [])

    def block_table(self, request_id: str) -> list[int]:
        return self.req_block_ids.setdefault(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Cached blocks of the request's longest cached prefix, and the tokens they hold.

        The last token is never served from the cache, so the step that computes it yields logits.
        A request that asks for prompt logprobs is served nothing: a cached block has no logits.
        """
        if not self.pool.enable_caching or request.num_computed_tokens > 0 \
                or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        cached = self.pool.cached
        hits: list[Block] = []
        for h in self.block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
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
        if not self.computing:
            return 0
        bs, computing = self.block_size, self.computing
        hashes = self.block_hashes(request, (request.num_tokens - 1) // bs)
        num_tokens = 0
        for i in range(len(computed), (request.num_tokens - 1) // bs):
            if hashes[i] not in computing:
                break
            num_tokens += bs
        return num_tokens

    def mark_computing(self, request: Request, computed: list[Block]) -> None:
        """Promise the request's uncached full prompt blocks (see `computing`); called on admission."""
        if not self.pool.enable_caching:
            return
        num_blocks = request.num_prompt_tokens // self.block_size
        hashes = self.block_hashes(request, num_blocks)
        promised = []
        for i in range(len(computed), num_blocks):
            h = hashes[i]
            if h not in self.computing and self.pool.lookup(h) is None:
                self.computing[h] = request.request_id
                promised.append(h)
        if promised:
            self.req_computing[request.request_id] = promised

    def _drop_promises(self, request_id: str) -> None:
        for h in self.req_computing.pop(request_id, ()):
            if self.computing.get(h) == request_id:
                del self.computing[h]

    def can_admit(self, request: Request, num_tokens: int, computed: list[Block] = ()) -> bool:
        """Whether `num_tokens` tokens of a new request fit, keeping the watermark free."""
        reusable_free = sum(1 for b in computed if b.ref_cnt == 0)  # cached but sitting in the free queue
        needed = cdiv(num_tokens, self.block_size) - len(computed)
        return self.pool.num_free_blocks - reusable_free - needed >= self.watermark_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[Block] = ()) -> list[Block] | tuple | None:
        """Blocks so that the request's first num_computed + len(computed)*bs + num_new tokens have slots."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is not None and not computed and \
                request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
            return _NO_BLOCKS  # the common decode step: the last block still has room
        blocks = self.req_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed)
        reusable_free = sum(1 for b in computed if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - reusable_free:
            return None
        if computed or num_computed == 0:  # a first admission: count it for the hit rate
            self.num_prefix_queries += request.num_tokens
            self.num_prefix_hits += len(computed) * self.block_size
        if computed:
            self.pool.touch(list(computed))
            blocks.extend(computed)
        new = self.pool.allocate(max(needed, 0))
        blocks.extend(new)
        self.req_block_ids.setdefault(rid, []).extend(b.block_id for b in (*computed, *new))
        return new

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks so later requests can reuse them."""
        if not self.pool.enable_caching:
            return
        bs = self.block_size
        hashes = self.req_hashes.get(request.request_id)
        if hashes is not None and len(hashes) >= request.num_computed_tokens // bs:
            return  # no block filled up since the last call
        hashes = self.req_hashes.setdefault(request.request_id, [])
        blocks = self.req_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // bs, len(blocks))
        own = self.block_hashes(request, num_full)
        for i in range(len(hashes), num_full):
            h = own[i]
            hashes.append(h)
            self.pool.register(blocks[i], h)
            self.computing.pop(h, None)

    def register_hashes(self, request: Request, hashes: list[bytes]) -> None:
        """Blocks filled from outside (disaggregated prefill): adopt the sender's hashes of the full
        blocks, so later requests hit them and cache_full_blocks carries on after them."""
        if not self.pool.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks[rid]
        assert len(hashes) <= min(len(blocks), request.num_computed_tokens // self.block_size), (rid, len(hashes))
        self.req_hashes[rid] = list(hashes)
        if request.block_hashes[:len(hashes)] != hashes:
            request.block_hashes = list(hashes)  # later blocks chain on from the sender's
        for block, h in zip(blocks, hashes):
            self.pool.register(block, h)

    def can_swap_out(self, request: Request) -> bool:
        return len(self.blocks_of(request.request_id)) <= min(self.host_pool.num_free_blocks, self.num_host_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool; returns (device block, host block) copies."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid)
        host = self.host_pool.allocate(len(blocks))
        self.req_host_blocks[rid] = host
        self.req_block_ids.pop(rid, None)
        self.req_hashes.pop(rid, None)
        self._drop_promises(rid)
        self.pool.free(blocks[::-1])
        return [(d.block_id, h.block_id) for d, h in zip(blocks, host)]

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        needed = max(cdiv(request.num_computed_tokens + num_new_tokens, self.block_size),
                     len(self.req_host_blocks[request.request_id]))
        return self.pool.num_free_blocks - needed >= self.watermark_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back; returns (host block, device block) copies."""
        rid = request.request_id
        host = self.req_host_blocks.pop(rid)
        blocks = self.pool.allocate(len(host))
        self.req_blocks[rid] = blocks
        self.req_block_ids[rid] = [b.block_id for b in blocks]
        self.host_pool.free(host[::-1])
        return [(h.block_id, d.block_id) for h, d in zip(host, blocks)]

    def free(self, request: Request) -> None:
        host = self.req_host_blocks.pop(request.request_id, None)
        if host:
            self.host_pool.free(host[::-1])
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.req_hashes.pop(request.request_id, None)
        self._drop_promises(request.request_id)
        self.pool.free(blocks[::-1])
