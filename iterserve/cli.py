"""`iterserve <command>`: each command lives with its layer and is imported only when used."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("iterserve.entrypoints.generate", "offline generation on a prompt"),
    "serve": ("iterserve.server.cli", "OpenAI-compatible HTTP server"),
    "chat": ("iterserve.server.chat_cli", "interactive chat in the terminal"),
    "bench": ("iterserve.bench.cli", "one workload through static and continuous batching and peers"),
    "simulate": ("iterserve.sim.cli", "the real scheduler on a modelled GPU"),
    "calibrate": ("iterserve.sim.calibrate", "measure this machine for the simulator's cpu-local preset"),
    "tune": ("iterserve.sim.tune", "search engine settings for the best goodput under SLOs"),
    "diagnose": ("iterserve.sim.diagnose", "capacity diagnostics of a bench or simulate report, offline"),
    "env": ("iterserve.entrypoints.env", "this CPU's kernel paths and the versions that matter"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: iterserve <command> [options]\n\ncommands:")
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:<10} {doc}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    handed = {}
    if argv[0] == "serve":  # the server imports no tool: the simulator's SLO what-if is handed in from here
        from iterserve.sim.server_whatif import whatif_for
        handed["whatif_for"] = whatif_for
    try:
        return module.main(argv[1:], **handed) or 0
    except (ValueError, OSError) as exc:  # a user's mistake (a bad path, a bad value): one line, no traceback
        print(f"iterserve {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
