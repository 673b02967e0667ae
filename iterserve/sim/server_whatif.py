"""The SLO what-if `iterserve serve` hands its diagnostics (iterserve/cli.py passes `whatif_for` in): the
server never imports the simulator or the bench itself, it only calls what it was given."""
from __future__ import annotations

import logging
import threading

from iterserve.engine.diagnostics import WhatIf
from iterserve.executor.base import DeviceExecutor
from iterserve.sim.executor import SimulatedExecutor

logger = logging.getLogger("iterserve.server")


def whatif_for(engine) -> WhatIf | None:
    """The what-if for this engine's SLO misses, or None where the simulator cannot model what it serves.
    Only cheap checks here, at start-up; the replay itself is built at the first miss."""
    return _LazyWhatIf(engine) if _may_simulate(engine) else None


class _LazyWhatIf:
    """The simulator's what-if, built at the first SLO miss: importing the replay (tune, bench) and
    resolving this CPU's profile would otherwise sit between a loaded model and a ready server."""

    def __init__(self, engine) -> None:
        self._engine, self._whatif, self._built = engine, None, False
        self._lock = threading.Lock()

    def __call__(self, *args):
        with self._lock:
            if not self._built:
                self._built = True
                system = simulated_system(self._engine)
                if system is not None:
                    from iterserve.sim.whatif import SimulatorWhatIf
                    base = {k: v for k, v in self._engine.config.flat().items()
                            if k not in ("max_num_seqs", "max_num_batched_tokens")}
                    self._whatif = SimulatorWhatIf(*system, {**base, "model": system[0].name})
        return self._whatif(*args) if self._whatif is not None else None


def _may_simulate(engine) -> bool:
    """simulated_system's cheap checks, without resolving a profile."""
    executor = engine.executor
    if isinstance(executor, SimulatedExecutor):
        return True
    return (isinstance(executor, DeviceExecutor) and executor.device_type == "cpu"
            and engine.config.speculative_config.speculative_method is None)


def simulated_system(engine):
    """(model spec, hardware spec) for the what-if replay, or None where the simulator has no model of it."""
    executor = engine.executor
    if isinstance(executor, SimulatedExecutor):
        return executor.model, executor.hardware
    if not _may_simulate(engine):  # the CPU profile models only a model run on this CPU; no draft acceptance
        return None
    from iterserve.sim.cli import resolve_cpu_profile
    try:
        return resolve_cpu_profile(model=engine.config.model_config.model or None)
    except (ValueError, OSError) as exc:
        logger.info("diagnostics: no simulator model of this deployment (%s); SLO misses get no what-if", exc)
        return None
