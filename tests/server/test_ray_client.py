"""The ingress's ReplicaClient against a scripted deployment handle: a replica that dies before a
request's first output means a retry elsewhere; one that dies mid-stream ends it with engine_dead;
every relayed stream is timed (TTFT, ITL, e2e) with the replica that served it."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'iterserve[serve]')")

from ray.exceptions import ActorDiedError  # noqa: E402

from iterserve.outputs import RequestOutput  # noqa: E402
from iterserve.request import RequestTimes  # noqa: E402
from iterserve.sampling_params import SamplingParams  # noqa: E402
from iterserve.server.async_engine import EngineDeadError  # noqa: E402
from iterserve.server.engine_client import check_engine_client  # noqa: E402
from iterserve.server.metrics import RelayMetrics  # noqa: E402
from iterserve.server.ray_app import MAX_DISPATCH_ATTEMPTS, ReplicaClient  # noqa: E402


REPLICA = "replica-a"  # what EngineReplica.generate yields first: it took the request


def output(k: int, finished: bool) -> RequestOutput:
    return RequestOutput("r", [1], [7] * k, "", [7], "", finished, "length" if finished else None,
                         RequestTimes(0.0))


class Response:
    """A DeploymentResponseGenerator: yields `items`, raising any exception among them."""

    def __init__(self, items: list) -> None:
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """Hands out the scripted responses in turn, one per dispatch."""

    def __init__(self, responses: list[Response]) -> None:
        self.responses, self.calls = responses, []
        self.generate = self

    def options(self, **kwargs) -> "Handle":
        return self

    def remote(self, *args) -> Response:
        self.calls.append(args)
        return self.responses[len(self.calls) - 1]


async def collect(client: ReplicaClient) -> list[RequestOutput]:
    stream = await client.add_request([1, 2, 3], SamplingParams(max_tokens=2), "r")
    return [out async for out in stream]


def test_a_replica_dying_before_the_first_output_is_retried_elsewhere():
    handle = Handle([Response([ActorDiedError()]), Response([REPLICA, output(1, False), output(2, True)])])
    outs = asyncio.run(collect(ReplicaClient(handle, None, 100)))
    assert [o.finished for o in outs] == [False, True] and len(handle.calls) == 2
    assert handle.calls[0] == handle.calls[1]  # the same request, sent again


def test_no_replica_left_after_the_retries_is_engine_dead():
    handle = Handle([Response([ActorDiedError()]) for _ in range(MAX_DISPATCH_ATTEMPTS)])
    with pytest.raises(EngineDeadError, match="no replica could take the request"):
        asyncio.run(collect(ReplicaClient(handle, None, 100)))


def test_a_replica_dying_mid_stream_ends_the_request_with_engine_dead():
    handle = Handle([Response([REPLICA, output(1, False), ActorDiedError()])])
    seen = []

    async def run():
        stream = await ReplicaClient(handle, None, 100).add_request([1, 2, 3], SamplingParams(max_tokens=5), "r")
        async for out in stream:
            seen.append(out)

    with pytest.raises(EngineDeadError, match="died after 1 outputs"):
        asyncio.run(run())
    assert len(seen) == 1 and len(handle.calls) == 1  # streamed output is never replayed


def test_bad_input_is_the_replicas_own_error_and_not_retried():
    handle = Handle([Response([ValueError("prompt token id 5000 is not in the vocabulary")])])
    with pytest.raises(ValueError, match="vocabulary"):
        asyncio.run(collect(ReplicaClient(handle, None, 100)))
    assert len(handle.calls) == 1


def test_abort_cancels_the_call_and_forgets_the_stream():
    response = Response([REPLICA, output(1, False), output(2, True)])
    client = ReplicaClient(Handle([response]), None, 100)

    async def run():
        await client.add_request([1], SamplingParams(), "r")
        assert set(client.streams) == {"r"}
        client.abort("r")

    asyncio.run(run())
    assert response.cancelled and client.streams == {}


def test_a_finished_stream_is_not_cancelled():
    response = Response([REPLICA, output(1, False), output(2, True)])
    client = ReplicaClient(Handle([response]), None, 100)
    assert len(asyncio.run(collect(client))) == 2
    assert not response.cancelled and client.streams == {}


def test_a_stream_closed_early_cancels_its_call():
    response = Response([REPLICA, output(1, False), output(2, False), output(3, True)])

    async def run():
        stream = await ReplicaClient(Handle([response]), None, 100).add_request([1], SamplingParams(), "r")
        async for _ in stream:
            break  # the client went away after one output
        await asyncio.sleep(0)

    asyncio.run(run())
    assert response.cancelled


def test_the_replica_client_is_an_engine_client():
    check_engine_client(ReplicaClient(Handle([]), None, 100, 1000, frozenset({2})))


def sample(latencies: RelayMetrics, name: str, **labels) -> float:
    return latencies.registry.get_sample_value(name, {"model_name": "m", "replica": REPLICA, **labels}) or 0.0


def test_the_ingress_times_every_stream_it_relays():
    latencies = RelayMetrics("m")
    response = Response([REPLICA, output(1, False), output(2, False), output(3, True)])
    assert len(asyncio.run(collect(ReplicaClient(Handle([response]), None, 100, latencies=latencies)))) == 3
    assert sample(latencies, "iterserve:time_to_first_token_seconds_count") == 1
    assert sample(latencies, "iterserve:inter_token_latency_seconds_count") == 2  # between the 3 deltas
    assert sample(latencies, "iterserve:e2e_request_latency_seconds_count") == 1
    assert sample(latencies, "iterserve:e2e_request_latency_seconds_sum") >= \
        sample(latencies, "iterserve:time_to_first_token_seconds_sum") > 0
    assert sample(latencies, "iterserve:request_success_total", finished_reason="length") == 1


def test_a_replica_dying_mid_stream_counts_an_error():
    latencies = RelayMetrics("m")
    client = ReplicaClient(Handle([Response([REPLICA, output(1, False), ActorDiedError()])]), None, 100,
                           latencies=latencies)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(client))
    assert sample(latencies, "iterserve:request_success_total", finished_reason="error") == 1
    assert sample(latencies, "iterserve:time_to_first_token_seconds_count") == 1


def test_an_abort_from_the_app_cancels_the_call_though_the_app_marked_it_finished():
    response = Response([REPLICA, output(1, False), output(2, False), output(3, True)])
    latencies = RelayMetrics("m")
    client = ReplicaClient(Handle([response]), None, 100, latencies=latencies)

    async def run():
        stream = await client.add_request([1], SamplingParams(), "r")
        stream.finished = True  # what the app's SSE response does before it aborts a stream its client left
        client.abort("r")

    asyncio.run(run())
    assert response.cancelled and client.streams == {}
    assert sample(latencies, "iterserve:request_success_total", finished_reason="abort") == 1


def test_a_consumer_that_stops_at_the_last_output_cancels_nothing():
    response = Response([REPLICA, output(1, False), output(2, True)])

    async def run():
        stream = await ReplicaClient(Handle([response]), None, 100).add_request([1], SamplingParams(), "r")
        async for out in stream:
            if out.finished:
                break
        await asyncio.sleep(0)

    asyncio.run(run())
    assert not response.cancelled


def test_shutdown_cancels_every_open_call():
    responses = [Response([REPLICA, output(1, False), output(2, True)]) for _ in range(2)]
    client = ReplicaClient(Handle(responses), None, 100)

    async def run():
        for request_id in ("a", "b"):
            await client.add_request([1], SamplingParams(), request_id)
        client.shutdown()

    asyncio.run(run())
    assert all(r.cancelled for r in responses) and client.streams == {}
