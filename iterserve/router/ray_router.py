"""Our routing policy inside Ray Serve's request-router extension point (RequestRouter, alpha in Ray 2.60).

Ray Serve builds one of these per deployment handle, in the process that holds the handle (our
ingress), and asks it `choose_replicas` for every request. The policy object from
iterserve/router/policy.py does the choosing; this class only translates: Ray's replicas and their
`routing_stats` (what each EngineReplica's `record_routing_stats` returned at the controller's last
poll) into ReplicaLoads, the request's prompt token ids into block hashes, and Ray's completed /
died callbacks into the policy's counters.
"""
from __future__ import annotations

import weakref

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from iterserve.router.policy import ReplicaLoad, make_router, prompt_block_hashes

# The routers alive in this process, so the ingress can show per-replica state on /health and /metrics.
LIVE_ROUTERS: "weakref.WeakSet[IterserveRequestRouter]" = weakref.WeakSet()


def load_from_stats(stats: dict) -> ReplicaLoad:
    return ReplicaLoad(stats.get("num_running", 0), stats.get("num_waiting", 0), stats.get("kv_usage", 0.0))


class IterserveRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix-affinity", block_size: int = 16, max_imbalance: int = 8,
                         seed: int = 0) -> None:
        self.policy = make_router(policy, seed, max_imbalance)
        self.policy_name = policy
        self.block_size = block_size
        self._hashes: dict[str, list[bytes]] = {}  # internal request id -> its prompt's block hashes
        self._chosen: dict[str, str] = {}  # internal request id -> the replica counted for it
        # Ray may ship this class by value, with a copy of this module's globals: register in the module
        # the ingress imports, not in the copy.
        from iterserve.router import ray_router
        ray_router.LIVE_ROUTERS.add(self)

    def replica_stats(self) -> dict[str, dict]:
        """Each live replica's latest report, by replica id (one that has not reported yet is not alive),
        with the requests this router has in flight there."""
        in_flight = self.policy.in_flight
        return {rid.unique_id: {"alive": False, **(r.routing_stats or {}),
                                "routed_in_flight": in_flight.get(rid.unique_id, 0)}
                for rid, r in self.curr_replicas.items()}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: load_from_stats(r.routing_stats or {}) for rid, r in by_id.items()}
        hashes = self._prompt_hashes(pending_request)
        choice = self.policy.choose(hashes, loads)
        if pending_request is not None:
            # Counted now, not in on_request_routed: Ray chooses for several pending requests before it
            # sends any, and a burst must not all see the same idle replica. A request chosen for again
            # (its first choice could not take it) moves its count.
            key = pending_request.metadata.internal_request_id
            previous = self._chosen.pop(key, None)
            if previous is not None:
                self.policy.on_finished(previous)
            self._chosen[key] = choice
            self.policy.on_routed(choice, hashes)
        return [[by_id[choice]]]

    def _prompt_hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """EngineReplica.generate's first argument is the prompt's token ids (the ingress tokenizes)."""
        if pending_request is None or not pending_request.args:
            return []
        key = pending_request.metadata.internal_request_id
        if key not in self._hashes:
            prompt, cache_salt = pending_request.args[0], pending_request.args[4]
            ids = prompt if isinstance(prompt, list) else []
            self._hashes[key] = prompt_block_hashes(ids, self.block_size, cache_salt)
        return self._hashes[key]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._hashes.pop(internal_request_id, None)
        chosen = self._chosen.pop(internal_request_id, None)
        if chosen is not None:
            self.policy.on_finished(chosen)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
