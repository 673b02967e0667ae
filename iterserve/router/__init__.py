"""Which replica serves a request: plain-Python policies shared by the Ray Serve app and the simulator."""
from iterserve.router.policy import (
    POLICIES, LeastKVRouter, PowerOfTwoRouter, PrefixAffinityRouter, ReplicaLoad, RoundRobinRouter, Router,
    make_router, prompt_block_hashes,
)

__all__ = ["POLICIES", "LeastKVRouter", "PowerOfTwoRouter", "PrefixAffinityRouter", "ReplicaLoad",
           "RoundRobinRouter", "Router", "make_router", "prompt_block_hashes"]
