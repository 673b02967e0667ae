import pytest

from iterserve.bench.metrics import Slo
from iterserve.bench.workload import LengthDist, make_trace, materialize_prompts
from iterserve.sim.hardware import get_hardware
from iterserve.sim.model_spec import get_model_spec
from iterserve.sim.tune import main as tune_main, parse_seconds, search


def test_parse_seconds():
    assert parse_seconds("1s") == 1.0 and parse_seconds("100ms") == pytest.approx(0.1) and parse_seconds("0.5") == 0.5


def test_search_finds_more_seats_better_under_load():
    trace = materialize_prompts(make_trace(120, LengthDist("fixed", 256), LengthDist("exponential", 64, high=256),
                                           arrivals="poisson", request_rate=20, seed=0), None)
    points = search(trace, get_model_spec("llama-2-7b"), get_hardware("a100-80gb"), Slo(ttft=1.0, tpot=0.1),
                    [2, 64], [2048])
    assert points[0].max_num_seqs == 64 and points[0].goodput_rps > points[1].goodput_rps
    assert points[0].frontier


def test_tune_cli(capsys):
    rc = tune_main(["--slo-ttft", "1s", "--slo-tpot", "100ms", "--rate", "10", "--num-requests", "40",
                    "--prompt-len", "128", "--output-mean", "32", "--search-max-num-seqs", "4,32",
                    "--search-max-num-batched-tokens", "1024"])
    assert rc == 0
    assert "best: --max-num-seqs" in capsys.readouterr().out
