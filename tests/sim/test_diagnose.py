"""`iterserve diagnose REPORT`: the server's diagnostics over a simulate/bench --json report, offline."""
from __future__ import annotations

import json
import re

import pytest

from iterserve.cli import main as iterserve

SIM = ["simulate", "--model", "llama-2-7b", "--hardware", "a100-80gb", "--num-requests", "60", "--prompt-len", "100",
       "--output-dist", "fixed", "--output-mean", "200", "--num-kv-blocks", "64", "--targets", "continuous"]


def test_diagnose_a_report_then_apply_its_recommendation(tmp_path, capsys):
    report = tmp_path / "sim.json"
    assert iterserve([*SIM, "--max-num-seqs", "16", "--json", str(report)]) == 0
    capsys.readouterr()
    assert iterserve(["diagnose", str(report), "--json", str(tmp_path / "diag.json")]) == 0
    out = capsys.readouterr().out
    assert "[preemption]" in out, out
    seqs = int(re.search(r"lower --max-num-seqs to (\d+)", out).group(1))
    saved = json.loads((tmp_path / "diag.json").read_text())["continuous"]
    assert saved["diagnostics"][0]["knobs"]["max-num-seqs"] == seqs < 16

    fixed = tmp_path / "fixed.json"
    assert iterserve([*SIM, "--max-num-seqs", str(seqs), "--json", str(fixed)]) == 0
    capsys.readouterr()
    assert iterserve(["diagnose", str(fixed)]) == 0
    assert "continuous: 0 diagnostics" in capsys.readouterr().out


def test_diagnose_says_what_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a report"}))
    with pytest.raises(SystemExit) as exc:
        iterserve(["diagnose", str(bad)])
    assert exc.value.code == 2 and "not a bench or simulate report" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        iterserve(["diagnose", str(tmp_path / "missing.json")])
    assert exc.value.code == 2 and "cannot read" in capsys.readouterr().err


def test_diagnose_a_trace_simulates_it_at_the_given_settings(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    assert iterserve([*SIM, "--max-num-seqs", "16", "--save-trace", str(trace)]) == 0
    capsys.readouterr()
    sim = ["--model", "llama-2-7b", "--hardware", "a100-80gb", "--num-kv-blocks", "64"]
    assert iterserve(["diagnose", str(trace), *sim, "--max-num-seqs", "16"]) == 0
    out = capsys.readouterr().out
    seqs = int(re.search(r"lower --max-num-seqs to (\d+)", out).group(1))
    assert iterserve(["diagnose", str(trace), *sim, "--max-num-seqs", str(seqs)]) == 0
    assert "continuous: 0 diagnostics" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a report ran with its own settings: engine flags would be ignored
        iterserve(["diagnose", str(tmp_path / "x.json"), "--max-num-seqs", "8"])
