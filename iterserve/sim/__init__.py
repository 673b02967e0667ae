"""The simulator: the real engine, scheduler and KV manager with a modelled executor and a virtual clock."""
from iterserve.sim.cost_model import CostModel
from iterserve.sim.executor import SimulatedExecutor, VirtualClock
from iterserve.sim.hardware import PRESETS as HARDWARE_PRESETS, HardwareSpec, get_hardware
from iterserve.sim.model_spec import MODEL_PRESETS, ModelSpec, get_model_spec, spec_from_arch

__all__ = ["CostModel", "SimulatedExecutor", "VirtualClock", "HardwareSpec", "ModelSpec", "HARDWARE_PRESETS",
           "MODEL_PRESETS", "get_hardware", "get_model_spec", "spec_from_arch"]
