"""Routing policies: which replica gets the next request. Plain Python, no Ray import.

The Ray Serve request router (iterserve/router/ray_router.py) and the simulator's multi-replica
mode (iterserve/sim/cluster.py) call the same objects, so a policy is measured once in both.

A policy sees the prompt as the chained hashes of its leading full blocks (`prompt_block_hashes`,
the KV manager's own `hash_block`, so equal hashes mean a replica can serve that prefix from its
cache) and one `ReplicaLoad` per live replica. A replica missing from `loads` is dead or not yet
started and is never chosen.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from iterserve.kv.kv_cache_manager import hash_block

# Enough blocks to tell tenants' system prompts apart, few enough to hash on every request.
MAX_HASHED_BLOCKS = 128


@dataclass(slots=True)
class ReplicaLoad:
    """What a replica reports after each step (or, on Ray, each stats poll)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                        max_blocks: int = MAX_HASHED_BLOCKS) -> list[bytes]:
    """The hashes the KV manager gives the prompt's leading full blocks. Like its prefix lookup,
    the block holding the last prompt token is left out: it is always recomputed."""
    n = min((len(token_ids) - 1) // block_size, max_blocks)
    hashes, parent = [], None
    for i in range(n):
        parent = hash_block(parent, list(token_ids[i * block_size:(i + 1) * block_size]), cache_salt)
        hashes.append(parent)
    return hashes


class Router(Protocol):
    def choose(self, block_hashes: Sequence[bytes], loads: Mapping[str, ReplicaLoad]) -> str:
        """A replica id among `loads`' keys; ValueError when there is none."""

    def on_routed(self, replica_id: str, block_hashes: Sequence[bytes]) -> None:
        """The request was sent to `replica_id`."""

    def on_finished(self, replica_id: str) -> None:
        """A request routed to `replica_id` ended (finished, failed or aborted)."""


class _Counting:
    """Requests routed and not yet finished, per replica. A replica's report lags the requests just
    sent to it (one step in the simulator, one stats poll on Ray); the router's own count does not."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}

    def load(self, replica_id: str, report: ReplicaLoad) -> int:
        return max(report.num_running + report.num_waiting, self.in_flight.get(replica_id, 0))

    def least_loaded(self, loads: Mapping[str, ReplicaLoad]) -> str:
        _check_live(loads)
        # self.load inlined: this runs over every replica for every request (the simulator's hot loop)
        in_flight = self.in_flight
        return min((max(x.num_running + x.num_waiting, in_flight.get(r, 0)), x.kv_usage, r)
                   for r, x in loads.items())[2]

    def on_routed(self, replica_id: str, block_hashes: Sequence[bytes]) -> None:
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1

    def on_finished(self, replica_id: str) -> None:
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1

    def forget(self, replica_id: str) -> None:
        """A replica died: what it had in flight is gone with it."""
        self.in_flight.pop(replica_id, None)


def _check_live(loads: Mapping[str, ReplicaLoad]) -> None:
    if not loads:
        raise ValueError("no live replica to route to")


class RoundRobinRouter(_Counting):
    """The live replicas in turn (by id order), whatever their load: the baseline. The turn moves on
    when a request is routed, not when asked: Ray may ask again for a request it could not send."""

    def __init__(self) -> None:
        super().__init__()
        self.next = 0

    def choose(self, block_hashes: Sequence[bytes], loads: Mapping[str, ReplicaLoad]) -> str:
        _check_live(loads)
        ids = sorted(loads)
        return ids[self.next % len(ids)]

    def on_routed(self, replica_id: str, block_hashes: Sequence[bytes]) -> None:
        super().on_routed(replica_id, block_hashes)
        self.next += 1


class PowerOfTwoRouter(_Counting):
    """Two replicas drawn at random, the less loaded one taken (Ray Serve's default policy)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def choose(self, block_hashes: Sequence[bytes], loads: Mapping[str, ReplicaLoad]) -> str:
        _check_live(loads)
        ids = list(loads)
        if len(ids) <= 2:
            return self.least_loaded(loads)
        a, b = self.rng.sample(ids, 2)
        return a if (self.load(a, loads[a]), loads[a].kv_usage) <= (self.load(b, loads[b]), loads[b].kv_usage) else b


class PrefixAffinityRouter(_Counting):
    """The replica that last computed the prompt's longest known prefix, unless it is overloaded;
    otherwise (and for a prefix nobody has) the least-loaded replica.

    Overloaded: more than `max_imbalance` requests above the least-loaded replica, or KV usage
    above `max_kv_usage`. The threshold trades hit rate for balance: 0 is least-loaded routing
    that breaks ties by affinity; a large one pins each prefix to one replica however hot it is."""

    def __init__(self, max_imbalance: int = 8, max_kv_usage: float = 0.95, capacity: int = 1 << 20) -> None:
        super().__init__()
        self.max_imbalance = max_imbalance
        self.max_kv_usage = max_kv_usage
        self.capacity = capacity  # block hashes remembered (least recently routed dropped first)
        self.owner: OrderedDict[bytes, str] = OrderedDict()

    def affinity(self, block_hashes: Sequence[bytes], loads: Mapping[str, ReplicaLoad]) -> tuple[str | None, int]:
        """(the live replica holding the longest prefix, how many blocks of it), or (None, 0).
        Hashes are chained, so the owner of the deepest known block computed all before it."""
        target, depth = None, 0
        for i, h in enumerate(block_hashes):
            replica = self.owner.get(h)
            if replica is None:
                break
            if replica in loads:
                target, depth = replica, i + 1
        return target, depth

    def choose(self, block_hashes: Sequence[bytes], loads: Mapping[str, ReplicaLoad]) -> str:
        best = self.least_loaded(loads)
        target, _ = self.affinity(block_hashes, loads)
        if target is None or target == best:
            return best
        report = loads[target]
        if self.load(target, report) - self.load(best, loads[best]) <= self.max_imbalance \
                and report.kv_usage <= self.max_kv_usage:
            return target
        return best

    def on_routed(self, replica_id: str, block_hashes: Sequence[bytes]) -> None:
        super().on_routed(replica_id, block_hashes)
        owner = self.owner
        for h in block_hashes:
            owner[h] = replica_id
            owner.move_to_end(h)
        while len(owner) > self.capacity:
            owner.popitem(last=False)


class LeastKVRouter(_Counting):
    """The replica with the least KV usage: a P/D decode engine is chosen this way, since what a
    decode engine runs out of is blocks for the requests it holds, not compute.

    Reports lag the requests just routed, so usages within `kv_slack` of the least count as equal
    and the least loaded of those (by the router's own in-flight count) is taken: a burst spreads
    over near-equal engines instead of piling onto the one that reported a hair less. 0 is the
    plain argmin of the reports."""

    def __init__(self, kv_slack: float = 0.05) -> None:
        super().__init__()
        if not 0 <= kv_slack <= 1:
            raise ValueError(f"kv_slack must be in [0, 1], got {kv_slack}")
        self.kv_slack = kv_slack

    def choose(self, block_hashes: Sequence[bytes], loads: Mapping[str, ReplicaLoad]) -> str:
        _check_live(loads)
        least = min(x.kv_usage for x in loads.values())
        near = {r: x for r, x in loads.items() if x.kv_usage <= least + self.kv_slack}
        return min((self.load(r, x), x.kv_usage, r) for r, x in near.items())[2]


POLICIES = ("prefix-affinity", "round-robin", "power-of-two", "least-kv")


def make_router(policy: str, seed: int = 0, max_imbalance: int = 8) -> Router:
    """The policy by its CLI name (`iterserve serve` and `iterserve simulate` both take one)."""
    if policy == "round-robin":
        return RoundRobinRouter()
    if policy == "power-of-two":
        return PowerOfTwoRouter(seed)
    if policy == "prefix-affinity":
        return PrefixAffinityRouter(max_imbalance)
    if policy == "least-kv":
        return LeastKVRouter()
    raise ValueError(f"router must be one of {POLICIES}, got {policy!r}")
