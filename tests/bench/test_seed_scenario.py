"""benchmarks/seed_scenario.py end to end on the tiny shape with a few short requests: one model load for
both targets and the curve, and every figure of the report there and positive."""
import json

import pytest

import iterserve.engine.engine as engine_module
from iterserve.sim.hardware import SHIPPED_CPU_PROFILE
from tests.bench import load_benchmark

shapes = load_benchmark("model_shapes")
seed = load_benchmark("seed_scenario")

BATCHES = [1, 2, 4]


@pytest.fixture(scope="module")
def report(tmp_path_factory, default_model_path):
    tmp = tmp_path_factory.mktemp("seed")
    model = shapes.paths("tiny", tmp).hf
    shapes.write_hf("tiny", model)
    loads = []
    make = engine_module.make_executor
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ITERSERVE_WEIGHT_CACHE", "0")  # nothing written beside the kernels
        mp.setattr(engine_module, "make_executor", lambda config: loads.append(config) or make(config))
        assert seed.main(["--model", str(model), "--num-requests", "6", "--prompt-len", "24", "--output-len", "8",
                          "--max-num-seqs", "4", "--batches", ",".join(map(str, BATCHES)), "--repeats", "1",
                          "--num-threads", "1", "--hardware-profile", str(SHIPPED_CPU_PROFILE),
                          "--json", str(tmp / "seed.json")]) == 0
    return json.loads((tmp / "seed.json").read_text()), len(loads)


@pytest.mark.slow
def test_both_targets_and_the_curve_share_one_model_load(report):
    _, loads = report
    assert loads == 1


@pytest.mark.slow
def test_measured_and_simulated_targets_have_every_figure(report):
    r, _ = report
    for section in ("real", "simulated"):
        assert [t["name"] for t in r[section]] == ["continuous", "static"]
        for t in r[section]:
            assert t["completed"] == 6 and t["output_tokens"] == 6 * 8, (section, t["name"])
            for _, key in seed.FIGURES:
                assert seed.figure(t, key) > 0, (section, t["name"], key)


@pytest.mark.slow
def test_the_curve_has_a_measured_and_a_modelled_time_per_batch(report):
    r, _ = report
    assert [c["batch"] for c in r["step_curve"]] == BATCHES
    assert all(c["context"] == 24 + 8 // 2 for c in r["step_curve"])
    assert all(c["measured_ms"] > 0 and c["modelled_ms"] > 0 for c in r["step_curve"])


@pytest.mark.slow
def test_why_factors_the_throughput_and_the_ratio(report):
    r, _ = report
    for w in r["why"]:
        assert all(w[k] > 0 for k in w if k != "name"), w
        assert w["tokens_per_step"] / w["seconds_per_step"] == pytest.approx(w["output_tokens_per_s"])
        assert 1 <= w["decode_batch_mean"] <= 4
    ratio = r["ratio"]
    assert all(v > 0 for v in ratio.values()), ratio
    assert ratio["tokens_per_step"] / ratio["seconds_per_step"] == pytest.approx(ratio["measured"])


@pytest.mark.slow
def test_the_model_line_compares_served_and_modelled_weight_bytes(report):
    m = report[0]["model"]
    assert (m["layers"], m["hidden"]) == (shapes.SHAPES["tiny"].layers, shapes.SHAPES["tiny"].hidden)
    assert m["served_weight_bytes"] > 0 and m["modelled_weight_bytes"] > 0


def test_a_pool_too_small_for_the_curve_fails_before_any_model_loads(tmp_path, capsys):
    args = ["--model", str(tmp_path / "never-read"), "--num-kv-blocks", "4", "--batches", "1,8", "--context", "60"]
    assert seed.main(args) == 1
    assert "needs 32 KV blocks" in capsys.readouterr().err


def test_uniform_outputs_vary_around_the_mean_and_the_pool_seats_the_longest():
    args = seed.parse_args(["--num-requests", "64", "--output-len", "100", "--output-dist", "uniform",
                            "--prompt-len", "32", "--max-num-seqs", "4", "--batches", "1"])
    args.context = 64
    lengths = [r.output_len for r in seed.seed_trace(args).requests]
    assert len(set(lengths)) > 10 and 1 <= min(lengths) and max(lengths) <= 199
    assert 70 < sum(lengths) / len(lengths) < 130
    blocks = seed.engine_kwargs(args, None, [1])["num_kv_blocks"]
    assert blocks == 4 * -(-(32 + 199) // 16)
