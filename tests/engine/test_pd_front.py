"""xPyD across processes: the same greedy tokens as a colocated engine (1P1D over torch.distributed,
2P1D over shared memory), the prefill engine chosen by prefix affinity, no leaked blocks, and a decode
process killed mid-stream (1P2D) ends its own requests with an error while the others carry on, even
one killed while writing its outputs."""
from __future__ import annotations

import multiprocessing.connection
import os
import socket
import time

import pytest

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.sampling_params import SamplingParams
from iterserve.outputs import RequestOutput
from iterserve.request import RequestTimes
from iterserve.router.policy import ReplicaLoad
from iterserve.engine.pd_front import PDEngines, PDRoutes
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


def assert_no_blocks_held(pd: PDEngines, name: str) -> None:
    stats = pd.fetch_stats(name)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, f"{name} engine leaked blocks"


def assert_every_pool_empty(pd: PDEngines) -> None:
    for name in pd.procs:
        assert_no_blocks_held(pd, name)
    assert all(pd.fetch_stats(d).num_kv_transfers_recomputed == 0 for d in pd.decode_names)


def finished_with_error(out, name: str) -> bool:
    return out.finish_reason == "error" and f"{name} engine died" in out.error


def one_at_a_time(pd: PDEngines, prompts) -> tuple[list[list[int]], list[tuple[str, str]]]:
    """Each prompt to completion before the next: its tokens, and the (prefill, decode) engines it went to."""
    tokens, routes = [], []
    for i, p in enumerate(prompts):
        pd.add_request(p, GREEDY, str(i))
        routes.append(pd.routes.route[str(i)])
        out = run_until_finished(pd, [str(i)])[str(i)]
        assert out.error is None and out.finish_reason == "length"
        tokens.append(out.token_ids)
    return tokens, routes


def output(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [1, 2, 3], tokens, "", tokens[-1:], "", finished, "length" if finished else None,
                         RequestTimes(0.0))


def test_front_routes_keep_each_stream_in_order_and_a_death_ends_only_its_requests():
    """The front's bookkeeping, without processes: two decode engines chosen in turn (equal KV usage,
    ties by what is in flight); a decode output that beats its prefill output waits for it; a dead
    decode engine's requests are those routed to it in either stage; the routers' counts end at zero."""
    routes = PDRoutes()
    prefill, decode = {"prefill-0": ReplicaLoad()}, {"decode-0": ReplicaLoad(), "decode-1": ReplicaLoad()}
    assert routes.choose("a", [], prefill, decode) == ("prefill-0", "decode-0")
    assert routes.choose("b", [], prefill, decode) == ("prefill-0", "decode-1")
    second = output("a", [7, 8])
    assert routes.on_output("decode-0", second) == []
    first = output("a", [7])
    assert routes.on_output("prefill-0", first) == [first, second]
    assert routes.stage == {"a": "decode-0", "b": "prefill-0"}
    assert routes.routed_to("decode-1") == ["b"] and routes.routed_to("prefill-0") == ["b"]
    assert routes.end("b") == ("prefill-0", "decode-1")
    routes.forget("decode-1")
    assert routes.on_output("prefill-0", output("b", [5])) == [], "an ended request's late output is dropped"
    done = output("a", [7, 8, 9], finished=True)
    assert routes.on_output("decode-0", done) == [done] and not routes.stage and not routes.route
    counts = {**routes.prefill_router.in_flight, **routes.decode_router.in_flight}
    assert all(v == 0 for v in counts.values()), counts


@pytest.mark.slow
def test_1p1d_dist_token_identical_to_colocated(prompts):
    colocated, _ = generate(ModelRunner(EngineConfig(**CONFIG)), prompts, one_at_a_time=True, num_tokens=NEW_TOKENS)
    pd = PDEngines(CONFIG, "dist", port=free_port())
    try:
        assert one_at_a_time(pd, prompts)[0] == [t for t, _ in colocated]
        assert_every_pool_empty(pd)
    finally:
        pd.close()
    assert not any(p.is_alive() for p in pd.procs.values())


@pytest.mark.slow
def test_2p1d_token_identical_and_prefill_engine_by_prefix_affinity(prompts, reference_prompts):
    """2P1D over shared memory: the colocated tokens; then a prompt goes to the prefill engine that
    computed its prefix, and a new prefix to the least-loaded one."""
    colocated, _ = generate(ModelRunner(EngineConfig(**CONFIG)), prompts, one_at_a_time=True, num_tokens=NEW_TOKENS)
    pd = PDEngines(CONFIG, "shm", num_prefill=2)
    try:
        tokens, routes = one_at_a_time(pd, prompts)
        assert tokens == [t for t, _ in colocated]
        home = routes[2][0]  # prompts[2]: 100 tokens, 6 full blocks cached there
        hits = pd.fetch_stats(home).num_prefix_hits
        tail = reference_prompts[4][:10]
        fresh, other = reference_prompts[6], reference_prompts[7]  # 180 and 300 tokens, no prefix in common
        route = {}
        for rid, p in (("fresh", fresh), ("other", other), ("other+", other[:200] + tail), ("x+", prompts[2] + tail)):
            pd.add_request(p, GREEDY, rid)
            route[rid] = pd.routes.route[rid][0]
        assert route["fresh"] != route["other"], "a new prefix goes to the least-loaded prefill engine"
        assert route["other+"] == route["other"], "a shared prefix follows the engine that has it"
        assert route["x+"] == home
        done = run_until_finished(pd, list(route))
        assert all(o.error is None and len(o.token_ids) == NEW_TOKENS for o in done.values())
        assert pd.fetch_stats(home).num_prefix_hits >= hits + 6 * 16, "x+ found its prefix in its engine's cache"
        assert_every_pool_empty(pd)
    finally:
        pd.close()
    assert not any(p.is_alive() for p in pd.procs.values())


@pytest.mark.slow
def test_decode_engine_killed_mid_stream_ends_only_its_requests(prompts):
    """1P2D: the two requests go to different decode engines (least KV usage, a tie spread by what is
    in flight); killing one decode engine ends its request alone, and later requests avoid it."""
    pd = PDEngines(CONFIG, "shm", num_decode=2)
    try:
        pd.add_request(prompts[0], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), "a")
        pd.add_request(prompts[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), "b")
        victim, survivor = pd.routes.route["a"][1], pd.routes.route["b"][1]
        assert {victim, survivor} == {"decode-0", "decode-1"}
        streamed, ended, deadline = {"a": 0, "b": 0}, {}, time.monotonic() + 240
        while min(streamed.values()) < 2:  # both are decoding (the prefill side gives one token)
            assert time.monotonic() < deadline
            for o in pd.get_outputs(0.05):
                streamed[o.request_id] = max(streamed[o.request_id], len(o.token_ids))
                if o.finished:
                    ended[o.request_id] = o
        pd.kill(victim)
        ended.update(run_until_finished(pd, [r for r in ("a", "b") if r not in ended]))
        assert finished_with_error(ended["a"], victim)
        assert ended["b"].error is None and len(ended["b"].token_ids) == 40
        pd.add_request(prompts[2], GREEDY, "late")
        assert pd.routes.route["late"][1] == survivor, "the router never chooses a dead decode engine"
        late = run_until_finished(pd, ["late"])["late"]
        assert late.error is None and len(late.token_ids) == NEW_TOKENS
        assert pd.procs["prefill-0"].is_alive() and pd.procs[survivor].is_alive()
        for name in ("prefill-0", survivor):
            assert_no_blocks_held(pd, name)
        assert pd.stats.num_free_kv_blocks == pd.stats.num_kv_blocks  # merged over the live decode engine
        pd.kill("prefill-0")  # no output comes now: the death alone ends a step's wait, which has no limit
        pd.step()
        assert "prefill-0" in pd.dead
    finally:
        pd.close()


def wchans(pid: int) -> set[str]:
    """Where the process's threads wait in the kernel (Linux's wchan; "0": running, or hidden here)."""
    try:
        return {open(f"/proc/{pid}/task/{tid}/wchan").read() for tid in os.listdir(f"/proc/{pid}/task")}
    except OSError:  # a thread or the process just ended
        return set()


def blocked_writing_to_a_pipe(pid: int) -> bool:
    return any("pipe_write" in w for w in wchans(pid))


@pytest.mark.slow
@pytest.mark.timeout(300)  # a front that no longer hears from its engines hangs in step()
@pytest.mark.skipif(not os.path.exists("/proc/self/wchan"), reason="reads Linux's /proc/<pid>/task/*/wchan")
def test_decode_engine_killed_while_writing_its_outputs_blocks_no_other_engine(prompts):
    """1P2D with the front not reading, so the outputs back up until a decode worker blocks writing
    them; killed there (where a queue written by every worker would keep its write lock held for good),
    its request ends with the error and the other decode engine's outputs and the wakes still come."""
    pd = PDEngines(CONFIG, "shm", num_decode=2)
    try:
        if wchans(pd.procs["prefill-0"].pid) <= {"0"}:  # idle, it waits for a command
            pytest.skip("this kernel hides where a process waits")
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        pd.add_request(prompts[0], params, "a")
        pd.add_request(prompts[1], params, "b")
        decode_of = {rid: pd.routes.route[rid][1] for rid in ("a", "b")}
        assert set(decode_of.values()) == {"decode-0", "decode-1"}
        sentinels, deadline, victim = [p.sentinel for p in pd.procs.values()], time.monotonic() + 240, None
        while victim is None:
            assert time.monotonic() < deadline, "no decode worker blocked writing its outputs"
            assert not multiprocessing.connection.wait(sentinels, 0.05), "an engine died on its own"
            victim = next((d for d in pd.decode_names if blocked_writing_to_a_pipe(pd.procs[d].pid)), None)
        pd.kill(victim)
        ended = run_until_finished(pd, ["a", "b"], timeout_s=120)
        lost = next(rid for rid, decode in decode_of.items() if decode == victim)
        kept = next(rid for rid in decode_of if rid != lost)
        assert finished_with_error(ended[lost], victim)
        assert ended[kept].error is None and len(ended[kept].token_ids) == 300
        pd.wake()
        assert pd.step() == [], "a wake ends a step's wait"
        assert_no_blocks_held(pd, decode_of[kept])
    finally:
        pd.close()


@pytest.mark.slow
def test_async_engine_streams_1p1d_with_text(prompts):
    """What `iterserve serve --pd 1P1D` runs: the AsyncEngine driving both processes as one engine."""
    import asyncio

    from iterserve.server.async_engine import AsyncEngine
    from iterserve.engine.pd_front import serving_engines
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


@pytest.mark.parametrize("argv,message", [
    (["--pd", "2P0D"], "--pd takes xPyD"),
    (["--pd", "2P1D", "--kv-transport", "dist"], "--kv-transport dist runs 1P1D only"),
])
def test_serve_pd_refuses_what_it_does_not_run(capsys, argv, message):
    from iterserve.server.cli import main as serve_main
    with pytest.raises(SystemExit):
        serve_main([*argv, "--port", str(free_port())])
    assert message in capsys.readouterr().err
