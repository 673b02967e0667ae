"""1P1D across two processes, with both KV transports: the same greedy tokens as a colocated engine,
no leaked blocks, and a decode process killed mid-stream ends its requests with an error while the
prefill process carries on."""
from __future__ import annotations

import socket
import time

import pytest

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.sampling_params import SamplingParams
from iterserve.server.pd_engines import PDEngines
from tests.engine.test_disagg import CONFIG, NEW_TOKENS, prompts  # noqa: F401
from tests.engine.test_greedy_reference import generate
from tests.engine.test_greedy_reference import prompts as reference_prompts  # noqa: F401

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_until_finished(pd: PDEngines, ids: list[str], timeout_s: float = 240.0) -> dict:
    finished = {}
    deadline = time.monotonic() + timeout_s
    while any(i not in finished for i in ids):
        assert time.monotonic() < deadline, f"not finished: {[i for i in ids if i not in finished]}"
        for o in pd.get_outputs(0.05):
            if o.finished:
                finished[o.request_id] = o
    return finished


def assert_no_blocks_held(pd: PDEngines, role: str) -> None:
    stats = pd.fetch_stats(role)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, f"{role} engine leaked blocks"


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_1p1d_processes_token_identical_to_colocated(prompts, transport):
    colocated, _ = generate(ModelRunner(EngineConfig(**CONFIG)), prompts, one_at_a_time=True, num_tokens=NEW_TOKENS)
    pd = PDEngines(CONFIG, transport, port=free_port())
    try:
        tokens = []
        for i, p in enumerate(prompts):
            pd.add_request(p, GREEDY, str(i))
            out = run_until_finished(pd, [str(i)])[str(i)]
            assert out.error is None and out.finish_reason == "length"
            tokens.append(out.token_ids)
        assert tokens == [t for t, _ in colocated]
        assert_no_blocks_held(pd, "prefill")
        assert_no_blocks_held(pd, "decode")
        assert pd.fetch_stats("decode").num_kv_transfers_recomputed == 0
    finally:
        pd.close()
    assert not any(p.is_alive() for p in pd.procs.values())


def test_decode_killed_mid_stream(prompts):
    pd = PDEngines(CONFIG, "shm")
    try:
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        for i in range(2):
            pd.add_request(prompts[i], long, str(i))
        deadline = time.monotonic() + 240
        streamed = 0
        while streamed < 2:  # a decode step has streamed (the prefill side gives one token)
            assert time.monotonic() < deadline
            streamed = max([streamed, *(len(o.token_ids) for o in pd.get_outputs(0.05))])
        pd.kill("decode")
        ended = run_until_finished(pd, ["0", "1"])
        for o in ended.values():
            assert o.finish_reason == "error" and "decode engine died" in o.error
        # the prefill side carries on: a new request still gets its first token, then fails the hand-off
        pd.add_request(prompts[2], long, "late")
        late = run_until_finished(pd, ["late"])["late"]
        assert late.finish_reason == "error" and len(late.token_ids) == 1
        assert pd.procs["prefill"].is_alive()
        assert_no_blocks_held(pd, "prefill")
    finally:
        pd.close()


def test_async_engine_streams_1p1d_with_text(prompts):
    """What `iterserve serve --pd 1P1D` runs: the AsyncEngine driving both processes as one engine."""
    import asyncio

    from iterserve.server.async_engine import AsyncEngine
    from iterserve.server.pd_engines import serving_engines
    colocated, engine = generate(ModelRunner(EngineConfig(**CONFIG)), prompts[:1], num_tokens=NEW_TOKENS)
    async_engine = AsyncEngine(lambda: serving_engines(EngineConfig(**CONFIG)))
    try:
        async def run():
            outs = [o async for o in async_engine.generate(prompts[0], GREEDY, request_id="a")]
            return outs
        outs = asyncio.run(run())
        assert outs[-1].finished and outs[-1].token_ids == colocated[0][0]
        streamed = [t for o in outs for t in o.new_token_ids]
        assert streamed == colocated[0][0], "each token streamed once: the first from prefill, the rest from decode"
        assert outs[-1].text and "".join(o.new_text for o in outs) == outs[-1].text
        assert async_engine.engine.stats.num_free_kv_blocks == async_engine.engine.stats.num_kv_blocks
    finally:
        async_engine.shutdown()


def test_serve_pd_refuses_what_it_does_not_run(capsys):
    from iterserve.server.cli import main as serve_main
    with pytest.raises(SystemExit):
        serve_main(["--pd", "2P1D", "--port", str(free_port())])
    assert "--pd serves 1P1D" in capsys.readouterr().err
