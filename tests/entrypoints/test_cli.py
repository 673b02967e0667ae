"""The command line as a new user meets it: one-line errors, every flag with its help and default,
and one default per engine setting across commands."""
import argparse
import json
import socket
import subprocess
import sys

import pytest

from iterserve.bench.cli import build_parser as bench_parser
from iterserve.server.cli import build_parser as serve_parser
from iterserve.sim.cli import build_parser as simulate_parser
from iterserve.sim.tune import build_parser as tune_parser


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "iterserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    """Exit status 2 and one error line last (argparse may print its usage above it; serve its
    "loading" log line), never a traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    for w in words:
        assert w in errors[0], errors[0]


@pytest.mark.parametrize("args, words", [
    (["serve", "--model", "/no/such/model.gguf"], ["/no/such/model.gguf"]),
    (["serve", "--max-num-seqs", "0"], ["max_num_seqs", "greater than or equal to 1"]),
    (["generate", "--prompt", "hi", "--device", "cuda"], ["--device cuda", "no CUDA device"]),
    (["bench", "--targets", "foo"], ["unknown target 'foo'"]),
    (["calibrate", "--validate-only", "/no/such/profile.json"], ["no profile at /no/such/profile.json"]),
    (["generate", "--prompt", "hi", "--max-model-len", "100000"], ["max_model_len 100000", "8192"]),
    (["serve", "--kv-cache-memory", "lots"], ["cannot read a byte size"]),
])
@pytest.mark.slow
def test_user_mistakes_get_one_line(args, words):
    assert_one_line_error(run_cli(*args), *words)


def test_a_port_in_use_is_reported_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_cli("serve", "--port", str(taken.getsockname()[1]), "--model", "/no/such/model.gguf",
                         timeout=60)
    assert_one_line_error(result, "cannot listen on 127.0.0.1")  # not the model path: nothing loaded


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[-1]: a for a in parser._actions if a.option_strings and a.dest != "help"}


@pytest.mark.parametrize("build", [serve_parser, bench_parser, simulate_parser, tune_parser])
def test_every_flag_has_help_and_shows_its_default(build):
    parser = build()
    shown = parser.formatter_class(parser.prog)
    for flag, action in _flags(parser).items():
        assert action.help, f"{flag} has no help"
        if action.default not in (None, False, True, argparse.SUPPRESS):  # None/flags: the help says it
            assert "(default" in shown._get_help_string(action), f"{flag} hides its default"
    if build is not tune_parser:  # tune searches max-num-seqs instead
        assert "(default: 64)" in " ".join(parser.format_help().split())  # --max-num-seqs, one default


def test_shared_flags_agree_across_commands():
    parsers = {"serve": _flags(serve_parser()), "bench": _flags(bench_parser()),
               "simulate": _flags(simulate_parser())}
    shared = set.intersection(*(set(p) for p in parsers.values())) - {"--model"}  # a path vs a preset
    assert {"--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--preemption-mode"} <= shared
    for flag in shared:
        seen = {(p[flag].default, tuple(p[flag].choices or ())) for p in parsers.values()}
        assert len(seen) == 1, f"{flag}: {seen}"


def test_tune_lists_only_what_it_uses():
    flags = _flags(tune_parser())
    assert not {"--sweep", "--targets", "--plot"} & set(flags)


# What a server holds of the tools: after start-up, and after its diagnostics handled an SLO miss on a CPU
# engine (one the simulator could model) with no what-if handed in. The what-if once imported sim/ there.
SERVER_IMPORTS = """
import json, sys
import iterserve.server.app, iterserve.server.cli
from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.engine.diagnostics import FinishedRequest
from iterserve.server.dashboard import make_diagnostics
tools = lambda: sorted(m for m in sys.modules if m.startswith(("matplotlib", "iterserve.bench", "iterserve.sim")))
at_start = tools()
diagnostics = make_diagnostics(Engine(EngineConfig(num_kv_blocks=64)), slo_ttft=0.001)
for i in range(diagnostics.thresholds.min_requests):
    diagnostics.observe_finished(FinishedRequest(f"r{i}", 1.0, 0.0, 8, 8, 1.0, 0.01, 0))
print(json.dumps({"at_start": at_start, "missed": sorted(diagnostics.evaluate(2.0)), "after_miss": tools()}))
"""


def test_the_server_imports_no_plotting_no_bench_and_no_simulator():
    out = subprocess.run([sys.executable, "-c", SERVER_IMPORTS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"at_start": [], "missed": ["slo_ttft"], "after_miss": []}


def test_serve_is_handed_the_simulators_whatif(monkeypatch):
    from iterserve import cli
    from iterserve.server import cli as serve_cli
    from iterserve.sim.server_whatif import whatif_for
    handed = {}
    monkeypatch.setattr(serve_cli, "main", lambda argv, **kwargs: handed.update(kwargs, argv=argv))
    assert cli.main(["serve", "--port", "1"]) == 0
    assert handed == {"argv": ["--port", "1"], "whatif_for": whatif_for}
