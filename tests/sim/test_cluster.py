"""The simulator's multi-replica mode: N real schedulers behind the routing policy, one timeline."""
from __future__ import annotations

import pytest

from iterserve.bench.runner import run_trace
from iterserve.bench.workload import LengthDist, make_trace, materialize_prompts, multi_tenant_trace
from iterserve.config import EngineConfig
from iterserve.router import make_router
from iterserve.sim.cli import main as simulate_main, make_engine
from iterserve.sim.cluster import SharedHost, run_cluster
from iterserve.sim.hardware import get_hardware
from iterserve.sim.model_spec import get_model_spec

MODEL, HW = get_model_spec("llama-2-7b"), get_hardware("a100-80gb")


def engines(n: int, **kw) -> list:
    return [make_engine(EngineConfig(max_num_seqs=16, **kw), MODEL, HW) for _ in range(n)]


def test_one_replica_is_the_single_engine_run():
    """The event loop adds nothing of its own: one replica gives the bench driver's figures exactly."""
    trace = make_trace(60, LengthDist("uniform", 64, 8, 200), LengthDist("exponential", 40, high=120),
                       arrivals="poisson", request_rate=30, seed=3)
    materialize_prompts(trace, None)
    single = run_trace(engines(1)[0], trace)
    cluster, stats = run_cluster(engines(1), trace, make_router("round-robin"))
    key = lambda m: (m.request_id, m.ttft, m.e2e, m.output_len)  # noqa: E731
    assert [key(m) for m in cluster.requests] == [key(m) for m in single.requests]
    assert stats.requests_per_replica == [60]


def test_replicas_share_the_work_and_all_requests_finish():
    trace = make_trace(200, LengthDist("fixed", 96), LengthDist("fixed", 32), arrivals="poisson",
                       request_rate=200, seed=1)
    result, stats = run_cluster(engines(4), trace, make_router("power-of-two", seed=1))
    assert len(result.requests) == 200 and all(m.e2e is not None for m in result.requests)
    assert sum(stats.requests_per_replica) == 200 and min(stats.requests_per_replica) >= 30
    # parallel replicas: the run takes far less modelled time than one engine's busy time for all of it
    busy = sum(s.end - s.start for s in result.steps)
    assert result.duration < 0.6 * busy


def test_a_shared_host_stretches_steps_only_while_its_cores_are_oversubscribed():
    assert SharedHost(2, 1, 0.4).stretch(1) == 1.0  # one busy replica and the background fit in 2 cores
    assert SharedHost(2, 1, 0.4).stretch(2) == pytest.approx(1.25)  # two share the 1.6 cores left
    assert SharedHost(4, 2, 0.0).stretch(2) == 1.0
    # two replicas given the same work at once, both busy throughout: every step takes 1.25x as long
    trace = make_trace(16, LengthDist("fixed", 96), LengthDist("fixed", 32), arrivals="offline", seed=2)
    alone, _ = run_cluster(engines(2), trace, make_router("round-robin"))
    shared, _ = run_cluster(engines(2), trace, make_router("round-robin"), host=SharedHost(2, 1, 0.4))
    assert shared.duration == pytest.approx(1.25 * alone.duration, rel=0.01)
    stretched = [(b.end - b.start) / (a.end - a.start) for a, b in zip(alone.steps, shared.steps)]
    # all but the very last step, which a replica may take when the other has just finished
    assert stretched[:-2] == pytest.approx([1.25] * (len(stretched) - 2))
    # requests one after another, never two busy replicas: nothing stretches
    spaced = make_trace(4, LengthDist("fixed", 96), LengthDist("fixed", 8), arrivals="poisson", request_rate=0.01,
                        seed=2)
    alone, _ = run_cluster(engines(2), spaced, make_router("round-robin"))
    shared, _ = run_cluster(engines(2), spaced, make_router("round-robin"), host=SharedHost(2, 1, 0.4))
    assert [m.e2e for m in shared.requests] == pytest.approx([m.e2e for m in alone.requests])


def test_prefix_affinity_beats_round_robin_on_a_multi_tenant_trace():
    """8 tenants on 2 replicas whose caches hold about half the system prompts each: affinity
    keeps each tenant on one replica, round-robin makes both replicas compute (and evict) all."""
    trace = multi_tenant_trace(8, 512, 160, user_len=32, output_len=16, request_rate=40, seed=0)
    hit = {}
    ttft = {}
    for policy in ("prefix-affinity", "round-robin"):
        result, stats = run_cluster(engines(2, num_kv_blocks=200), trace, make_router(policy))
        hit[policy] = stats.prefix_hit_rate
        ttft[policy] = sum(m.ttft for m in result.requests) / len(result.requests)
        assert len(result.requests) == 160
    assert hit["prefix-affinity"] > hit["round-robin"] + 0.1, hit
    assert ttft["prefix-affinity"] < ttft["round-robin"], ttft


def simulate(argv: list[str]) -> int:
    try:
        return simulate_main(argv)
    except SystemExit as exc:  # a user error: one line on stderr and a status
        return exc.code


def test_cli_replicas(capsys):
    assert simulate(["--num-requests", "40", "--request-rate", "50", "--targets", "continuous",
                          "--replicas", "3", "--router", "round-robin"]) == 0
    out = capsys.readouterr().out
    assert "continuous x3 round-robin" in out and "requests per replica 13..14" in out


def test_cli_closed_loop_is_a_clear_error(capsys):
    assert simulate(["--num-requests", "10", "--concurrency", "4", "--replicas", "2"]) == 2
    assert "open-loop" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_cli_bad_replica_count(bad, capsys):
    assert simulate(["--num-requests", "10", "--replicas", bad, "--router", "round-robin"]) == 2
    assert "data_parallel_size: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_replicas_in_worker_processes_give_the_same_figures():
    from iterserve.sim.cluster import run_cluster_parallel
    trace = multi_tenant_trace(4, 96, 120, user_len=24, output_len=12, request_rate=300, seed=5)
    make = lambda: engines(1, num_kv_blocks=120)[0]  # noqa: E731
    one, one_stats = run_cluster([make() for _ in range(5)], trace, make_router("prefix-affinity"))
    par, par_stats = run_cluster_parallel(make, 5, 2, trace, make_router("prefix-affinity"))
    key = lambda m: (m.request_id, m.ttft, m.e2e, m.output_len, tuple(m.itl))  # noqa: E731
    assert [key(m) for m in par.requests] == [key(m) for m in one.requests]
    assert par_stats == one_stats and len(par.steps) == len(one.steps)
    assert simulate(["--num-requests", "30", "--request-rate", "60", "--targets", "continuous",
                     "--replicas", "3", "--sim-workers", "2"]) == 0


def test_load_reports_every_interval_keep_arrivals_in_time_and_workers_agree():
    """With polled load reports the router decides on stale loads, but no replica sees a request before
    it arrives, every request finishes, and worker processes still give the same figures."""
    from iterserve.sim.cluster import run_cluster_parallel
    trace = multi_tenant_trace(4, 96, 120, user_len=24, output_len=12, request_rate=300, seed=5)
    make = lambda: engines(1, num_kv_blocks=120)[0]  # noqa: E731
    exact, _ = run_cluster([make() for _ in range(5)], trace, make_router("prefix-affinity"))
    one, one_stats = run_cluster([make() for _ in range(5)], trace, make_router("prefix-affinity"), report_interval=0.05)
    par, par_stats = run_cluster_parallel(make, 5, 2, trace, make_router("prefix-affinity"), report_interval=0.05)
    assert len(one.requests) == 120 and all(m.e2e is not None and m.ttft > 0 for m in one.requests)
    key = lambda m: (m.request_id, m.ttft, m.e2e, tuple(m.itl))  # noqa: E731
    assert [key(m) for m in par.requests] == [key(m) for m in one.requests] and par_stats == one_stats
    assert [key(m) for m in one.requests] != [key(m) for m in exact.requests]  # the staleness shows
    with pytest.raises(ValueError, match="report interval"):
        run_cluster([make()], trace, make_router("round-robin"), report_interval=-1)
