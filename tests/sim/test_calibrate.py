"""The calibration fit, on synthetic step times (no model runs here)."""
import json

import pytest

from iterserve.sim.calibrate import MORE_POINTS, QUICK_POINTS
from iterserve.sim.calibrate_fit import fit_profile, predict_rows
from iterserve.sim.calibrate_measure import parse_points
from iterserve.sim.cli import main as simulate_main
from iterserve.sim.hardware import HardwareSpec, get_hardware
from iterserve.sim.model_spec import get_model_spec


def _rows():
    rows = []
    for b, c in [(1, 128), (8, 128), (32, 128), (32, 512), (4, 256), (64, 256)]:
        rows.append({"kind": "decode", "q_lens": [1] * b, "ctx_lens": [c] * b})
    for b, n in [(1, 32), (1, 128), (1, 512), (4, 128)]:
        rows.append({"kind": "prefill", "q_lens": [n] * b, "ctx_lens": [n] * b})
    return rows


def test_fit_recovers_a_known_machine():
    spec = get_model_spec("smollm2-135m")
    base = HardwareSpec("cpu", memory_bytes=16 << 30, mem_bandwidth=10e9, peak_flops=100e9, reserved_bytes=0)
    truth = HardwareSpec(**{**base.to_json(), "mem_efficiency": 0.6, "flops_efficiency": 0.4, "attn_efficiency": 0.2,
                            "step_overhead_s": 0.004, "layer_overhead_s": 0.0, "seq_overhead_s": 0.0002})
    rows = _rows()
    for r, t in zip(rows, predict_rows(spec, truth, rows)):
        r["measured_s"] = t
    fitted, err = fit_profile(spec, base, rows)
    for r, p in zip(rows, predict_rows(spec, fitted, rows)):
        assert p == pytest.approx(r["measured_s"], rel=0.05)
    assert fitted.flops_efficiency == pytest.approx(0.4, rel=0.2)


def test_fit_reaches_weight_reads_faster_than_the_measured_copy():
    """A prefetched read over huge pages outruns the copy the bandwidth is measured with."""
    spec = get_model_spec("smollm2-135m")
    base = HardwareSpec("cpu", memory_bytes=16 << 30, mem_bandwidth=10e9, peak_flops=100e9, reserved_bytes=0)
    truth = HardwareSpec(**{**base.to_json(), "mem_efficiency": 2.0, "flops_efficiency": 0.4, "attn_efficiency": 0.2,
                            "step_overhead_s": 0.004, "seq_overhead_s": 0.0002})
    rows = _rows()
    for r, t in zip(rows, predict_rows(spec, truth, rows)):
        r["measured_s"] = t
    fitted, _ = fit_profile(spec, base, rows)
    assert fitted.mem_efficiency == pytest.approx(2.0, rel=0.15)
    for r, p in zip(rows, predict_rows(spec, fitted, rows)):
        assert p == pytest.approx(r["measured_s"], rel=0.05)


def test_simulate_loads_a_profile(tmp_path, capsys):
    hw = HardwareSpec("cpu-local", memory_bytes=16 << 30, mem_bandwidth=10e9, peak_flops=100e9, reserved_bytes=0)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"hardware": hw.to_json(), "model": {"dtype_bytes": 2}}))
    assert get_hardware("ignored", str(path)) == hw
    assert simulate_main(["--step-time", "--hardware", "cpu-local", "--hardware-profile", str(path),
                          "--batch-sizes", "1,4"]) == 0
    assert "smollm2-135m on 1 x cpu-local" in capsys.readouterr().out


def test_points_parse_and_bad_ones_are_named():
    assert parse_points("decode:16:1024, prefill:1:64@1024") == [("decode", 16, 1024, 0), ("prefill", 1, 64, 1024)]
    assert parse_points("mixed:16:100+496@512") == [("mixed", 16, 100, 0, (1, 496, 512))]
    assert len(parse_points(f"{QUICK_POINTS},{MORE_POINTS}")) == 12
    for bad in ("decode:16", "decode:0:128", "prefill:1:x", "decode:1:8@4", "encode:1:8", ",", "mixed:16:100",
                "mixed:16:100+1", "mixed:4:100+x", "decode:1:8+64"):
        with pytest.raises(ValueError, match="point"):
            parse_points(bad)


def test_mixed_points_fit_the_mixed_overheads_and_leave_the_rest_alone():
    """A machine whose mixed steps cost 20 ms + 3 ms per decode row beyond their parts: the fit without the
    mixed points is the same as before, and the mixed terms are recovered from them."""
    from iterserve.sim.calibrate_measure import _plan
    spec = get_model_spec("smollm2-135m")
    base = HardwareSpec("cpu", memory_bytes=16 << 30, mem_bandwidth=10e9, peak_flops=100e9, reserved_bytes=0,
                        fused_attention=False)
    truth = HardwareSpec(**{**base.to_json(), "mem_efficiency": 0.6, "flops_efficiency": 0.4, "attn_efficiency": 0.2,
                            "step_overhead_s": 0.004, "seq_overhead_s": 0.0002, "mixed_step_overhead_s": 0.02,
                            "mixed_seq_overhead_s": 0.003})
    mixed = []
    for point in parse_points("mixed:4:100+508@512,mixed:16:100+496@1024,mixed:24:100+488"):
        plan = _plan(point, 16)
        assert sum(len(s.token_ids) == 1 for s in plan.scheduled) == point[1]
        blocks = [b for s in plan.scheduled for b in s.block_table]
        assert len(blocks) == len(set(blocks))  # the decode rows and the chunk on disjoint blocks
        mixed.append({"kind": "mixed", "q_lens": [len(s.token_ids) for s in plan.scheduled],
                      "ctx_lens": [s.start_pos + len(s.token_ids) for s in plan.scheduled]})
    rows = _rows() + mixed
    for r, t in zip(rows, predict_rows(spec, truth, rows)):
        r["measured_s"] = t
    pure, _ = fit_profile(spec, base, rows[:-len(mixed)])
    fitted, err = fit_profile(spec, base, rows)
    assert (fitted.mem_efficiency, fitted.flops_efficiency, fitted.step_overhead_s) == \
        (pure.mem_efficiency, pure.flops_efficiency, pure.step_overhead_s)
    assert pure.mixed_step_overhead_s == 0.0 and pure.mixed_seq_overhead_s == 0.0
    for r, p in zip(mixed, predict_rows(spec, fitted, mixed)):
        assert p == pytest.approx(r["measured_s"], rel=0.03)
    assert fitted.mixed_seq_overhead_s == pytest.approx(0.003, rel=0.3)


@pytest.mark.slow
def test_neighbour_flag_takes_one_point_and_a_dead_neighbour_is_named(tmp_path, capsys):
    from iterserve.sim.calibrate import main as calibrate_main
    from iterserve.sim.calibrate_measure import neighbour
    with pytest.raises(SystemExit):
        calibrate_main(["--neighbor", "decode:1:8,prefill:1:8", "--output", str(tmp_path / "x.json")])
    assert "--neighbor takes one point" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        calibrate_main(["--neighbor", "decode:1", "--output", str(tmp_path / "x.json")])
    assert "bad point" in capsys.readouterr().err
    with neighbour(None, {}):  # no point: nothing runs beside
        pass
    with pytest.raises(RuntimeError, match="neighbour process did not start"):
        with neighbour(("decode", 1, 8, 0), {"model": str(tmp_path / "missing-model")}, start_timeout_s=120):
            pass
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_kv_handoff_is_timed_through_the_shared_memory_transport():
    """The runner's own block read and the shm connector, to a second process that writes the blocks
    into a pool of its own: both directions are timed."""
    import torch

    from iterserve.sim.calibrate_measure import measure_kv_handoff

    class Runner:
        block_size = 16
        pool = torch.randn(2, 2, 8, 16, 1, 4)
        reads = 0

        def read_blocks(self, ids):
            Runner.reads += 1
            return self.pool[:, :, ids].clone()

    send, receive = measure_kv_handoff(Runner(), tokens=64, reps=2)
    assert send > 0 and receive > 0
    assert Runner.reads == 3  # a warm-up round, then two timed
