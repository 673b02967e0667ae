"""benchmarks/pd_mixed.py's checks without real engines: the host time it adds to the simulation, and
the simulated rows with it and with a separate decode profile."""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

from iterserve.outputs import StepRecord
from iterserve.sim.hardware import HardwareSpec

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "pd_mixed.py"
_spec = importlib.util.spec_from_file_location("benchmarks_pd_mixed", SCRIPT)
pd_mixed = sys.modules["benchmarks_pd_mixed"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pd_mixed)


def _args(tmp_path, **kw):
    args = pd_mixed.build_parser().parse_args(["--duration", "6", "--chat-rate", "2", "--long-len", "256",
                                              "--long-every", "3", "--chat-output", "8"])
    for slow, name in ((0.0, "fast"), (0.05, "slow")):
        hw = HardwareSpec("cpu-local", memory_bytes=16 << 30, mem_bandwidth=20e9, peak_flops=200e9, reserved_bytes=0,
                          kind="cpu", fused_attention=False, step_overhead_s=0.03 + slow, host_link_bandwidth=20e9)
        (tmp_path / f"{name}.json").write_text(json.dumps({"hardware": hw.to_json(), "model": {"dtype_bytes": 4}}))
    args.sim_profile = args.sim_pd_profile = str(tmp_path / "fast.json")
    return argparse.Namespace(**{**vars(args), **kw})


def _rec(start, end, prefill=(), decode=(), tokens=0):
    return StepRecord(start, end, 0, 0, tokens + len(decode), 0.0, list(prefill), list(decode), [], tokens)


def test_host_time_is_the_busy_gaps_plus_the_fronts_cpu_per_engine_step():
    trace = [(0.0, "chat", [1] * 64, 8), (0.1, "chat", [1] * 64, 8)]
    probes = {"colocated": {"records": {"engine": [_rec(0.0, 0.1, ["0"], tokens=64), _rec(0.102, 0.2, decode=["0"]),
                                                   _rec(5.0, 5.1, ["1"], tokens=64)]}, "cpu_s": {}},
              "pd": {"records": {"prefill-0": [_rec(0.0, 0.1, ["0"], tokens=64), _rec(0.2, 0.3, ["1"], tokens=64)],
                                 "decode-0": [_rec(0.1, 0.2, decode=["0"]), _rec(0.204, 0.3, decode=["0"])]},
                     "cpu_s": {"front (this process)": 0.4}}}
    host = pd_mixed.host_time(trace, probes)
    assert abs(host["colocated"] - 0.002 / 3) < 1e-9  # one busy gap over three steps; the idle one not counted
    assert abs(host["prefill"] - 0.1) < 1e-9  # no busy gap (different requests); 0.4 s front CPU over 4 steps
    assert abs(host["decode"] - (0.004 / 2 + 0.1)) < 1e-9


def test_simulated_rows_take_the_host_time_and_the_decode_profile(tmp_path):
    args = _args(tmp_path)
    trace = pd_mixed.make_trace(args)
    plain = pd_mixed.simulated(args, trace)
    assert [r["target"] for r in plain] == ["sim colocated (2 cores)"] * 2 + ["sim 1P1D"] * 2
    hosted = pd_mixed.simulated(args, trace, host={"colocated": 0.0, "prefill": 0.0, "decode": 0.02})
    assert hosted[0]["target"] == "sim colocated (2 cores) + host" and hosted[0]["tpot_p50_s"] == plain[0]["tpot_p50_s"]
    assert hosted[2]["tpot_p50_s"] > plain[2]["tpot_p50_s"] + 0.015  # decode steps 20 ms dearer
    assert hosted[2]["ttft_mean_s"] == plain[2]["ttft_mean_s"]  # the prefill engine's steps unchanged
    slow = pd_mixed.simulated(_args(tmp_path, sim_decode_profile=str(tmp_path / "slow.json")), trace)
    assert slow[2]["tpot_p50_s"] > plain[2]["tpot_p50_s"] + 0.04 and slow[2]["ttft_mean_s"] == plain[2]["ttft_mean_s"]
