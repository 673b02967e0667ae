"""The engine-client contract: what the OpenAI app (server/app.py build_app) needs from what serves it.

Implementations: AsyncEngine (one engine core in this process: an Engine, or the P/D front of
engine/pd_front.py; engine/core.py) and the Ray ingress's ReplicaClient (N engine
replicas on Ray Serve, server/ray_app.py). build_app checks the contract once, at construction: a
client that lacks a part fails there, naming it, not on the first request that touches it.
"""
from __future__ import annotations

import inspect
from typing import AsyncIterator, Callable, Protocol

from iterserve.contract import members, methods, missing_members
from iterserve.engine.stats import EngineStats
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams


class ClientStream(Protocol):
    """One request's outputs, in order (`async for`). The app marks it finished once it has ended it,
    and aborts one it gives up on through `engine.abort(request_id)`."""

    request_id: str
    finished: bool
    engine: "EngineClient"

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...


class EngineClient(Protocol):
    # The model as the app sees it: tokenizing, context checks, structured-output grammars.
    tokenizer: object | None  # a transformers tokenizer, or None: prompts must be token ids
    max_model_len: int
    vocab_size: int | None
    eos_token_ids: frozenset[int]
    # Health: a dead client answers 503 engine_dead; a draining one 503 server_shutting_down.
    dead: BaseException | None
    draining: bool
    # The metrics hook the app installs: (stats, outputs) after each engine step, on the engine's thread.
    # A client whose engines run in other processes (the Ray ingress) never calls it.
    on_step: Callable[[EngineStats, list[RequestOutput]], None] | None

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids, or ValueError (empty prompt, an id outside the vocabulary): a 400 before any engine."""

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                          priority: int = 0, cache_salt: str | None = None) -> ClientStream:
        """The request's stream once accepted; ValueError (bad input), QueueFullError, EngineDeadError,
        ShuttingDownError otherwise."""

    def abort(self, request_id: str) -> None: ...

    def start(self) -> None:
        """With the app (its lifespan)."""

    def shutdown(self) -> None: ...


def check_engine_client(client: object) -> None:
    """Raise TypeError naming every part of the contract the client lacks or gets wrong."""
    name = type(client).__name__
    missing = missing_members(client, members(EngineClient))
    if missing:
        raise TypeError(f"{name} does not implement the EngineClient contract: missing {', '.join(missing)}")
    wrong = [f"{m} is not callable" for m in methods(EngineClient) if not callable(getattr(client, m))]
    if callable(client.add_request) and not inspect.iscoroutinefunction(client.add_request):
        wrong.append("add_request is not a coroutine function (async def)")
    if not isinstance(client.max_model_len, int) or client.max_model_len < 1:
        wrong.append(f"max_model_len is {client.max_model_len!r}, not a positive integer")
    if not isinstance(client.eos_token_ids, frozenset):
        wrong.append(f"eos_token_ids is a {type(client.eos_token_ids).__name__}, not a frozenset")
    if wrong:
        raise TypeError(f"{name} does not implement the EngineClient contract: {'; '.join(wrong)}")

