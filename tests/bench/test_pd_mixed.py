"""benchmarks/pd_mixed.py's checks without real engines: the host time it adds to the simulation, and
the simulated rows with it and with a separate decode profile."""
import argparse
import json

from iterserve.outputs import StepRecord
from iterserve.sim.hardware import HardwareSpec
from tests.bench import load_benchmark

pd_mixed = load_benchmark("pd_mixed")


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


def _specs(args) -> dict:
    return {role: pd_mixed.sim_spec(path) for role, path in pd_mixed.profile_paths(args).items()}


def test_simulated_rows_take_the_host_time_and_the_decode_profile(tmp_path):
    args = _args(tmp_path)
    trace = pd_mixed.make_trace(args)
    plain = pd_mixed.simulated(args, trace, _specs(args))
    assert [r["target"] for r in plain] == ["sim colocated (2 cores)"] * 2 + ["sim 1P1D"] * 2
    hosted = pd_mixed.simulated(args, trace, pd_mixed.with_host(_specs(args), {"colocated": 0.0, "prefill": 0.0,
                                                                               "decode": 0.02}), " + host")
    assert hosted[0]["target"] == "sim colocated (2 cores) + host" and hosted[0]["tpot_p50_s"] == plain[0]["tpot_p50_s"]
    assert hosted[2]["tpot_p50_s"] > plain[2]["tpot_p50_s"] + 0.015  # decode steps 20 ms dearer
    assert hosted[2]["ttft_mean_s"] == plain[2]["ttft_mean_s"]  # the prefill engine's steps unchanged
    slow_args = _args(tmp_path, sim_decode_profile=str(tmp_path / "slow.json"))
    slow = pd_mixed.simulated(slow_args, trace, _specs(slow_args))
    assert slow[2]["tpot_p50_s"] > plain[2]["tpot_p50_s"] + 0.04 and slow[2]["ttft_mean_s"] == plain[2]["ttft_mean_s"]


def test_a_profile_fitted_to_a_runs_steps_reproduces_that_run(tmp_path):
    """Steps run on a slower machine (here: simulated on its profile, whose efficiencies lie on the fit's
    grid) fitted from the fast profile's calibration: the fit finds the slower machine's prices, and
    simulating with them gives its run back."""
    slower = HardwareSpec("cpu-local", memory_bytes=16 << 30, mem_bandwidth=20e9, peak_flops=200e9, reserved_bytes=0,
                          kind="cpu", fused_attention=False, host_link_bandwidth=20e9, mem_efficiency=0.6,
                          flops_efficiency=0.4, attn_efficiency=0.2, step_overhead_s=0.08, layer_overhead_s=0.0)
    (tmp_path / "slower.json").write_text(json.dumps({"hardware": slower.to_json(), "model": {"dtype_bytes": 4}}))
    args = _args(tmp_path, sim_profile=str(tmp_path / "slower.json"))
    trace = pd_mixed.make_trace(args)
    steps: dict = {}
    slow = pd_mixed.simulated(args, trace, _specs(args), sim_steps=steps)
    fast_specs = _specs(_args(tmp_path))
    assert pd_mixed.simulated(args, trace, fast_specs)[0]["tpot_p50_s"] < 0.8 * slow[0]["tpot_p50_s"]
    probes = {"colocated": {"records": {"engine": steps["colocated"]}}}
    fits, errors = pd_mixed.fitted_to_run(trace, probes, {"colocated": fast_specs["colocated"]})
    assert errors["colocated"] < 0.05
    assert abs(fits["colocated"][1].step_overhead_s - 0.08) < 0.01  # the slower machine's 80 ms a step
    refit = pd_mixed.simulated(args, trace, {**fast_specs, **fits}, " fit to run")
    for want, got in zip(slow[:2], refit[:2]):
        assert got["target"] == want["target"] + " fit to run"
        for key in ("tpot_p50_s", "tpot_p99_s", "ttft_mean_s"):
            assert abs(got[key] - want[key]) <= 0.05 * want[key], key
    pd_mixed.save_fits(str(tmp_path / "fits"), fits, errors, pd_mixed.profile_paths(args))
    saved = json.loads((tmp_path / "fits" / "colocated.json").read_text())
    assert HardwareSpec.from_json(saved["hardware"]) == fits["colocated"][1]
    assert saved["fitted_to_run"]["role"] == "colocated"
