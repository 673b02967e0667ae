"""The calibration fit, on synthetic step times (no model runs here)."""
import json

import pytest

from iterserve.sim.calibrate import MORE_POINTS, QUICK_POINTS, fit_profile, parse_points, predict_rows
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
    assert len(parse_points(f"{QUICK_POINTS},{MORE_POINTS}")) == 12
    for bad in ("decode:16", "decode:0:128", "prefill:1:x", "decode:1:8@4", "encode:1:8", ","):
        with pytest.raises(ValueError, match="point"):
            parse_points(bad)
