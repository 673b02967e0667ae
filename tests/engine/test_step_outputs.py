"""Engine.step(unfinished=False): only finished requests' outputs, the same as the full step's."""
from __future__ import annotations

import itertools

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor


def finished_outputs(unfinished: bool) -> list[list[tuple]]:
    """Per step, the finished outputs of a small pool's run (preemptions, n > 1, a stop token id)."""
    ticks = itertools.count()
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=4),
                    executor=FakeExecutor(num_kv_blocks=10, block_size=4, max_model_len=64),
                    clock=lambda: float(next(ticks)))  # the same timestamps in both runs
    for i in range(6):
        engine.add_request([i + 1] * (3 + 2 * i), SamplingParams(max_tokens=3 + i, n=1 + i % 2, stop_token_ids=[7]),
                           request_id=f"r{i}")
    steps = []
    while engine.has_unfinished():
        steps.append([(o.request_id, list(o.token_ids), o.new_token_ids, o.finish_reason, list(o.times.token_times),
                       o.index, o.parent_id) for o in engine.step(unfinished) if o.finished])
    return steps


def test_finished_outputs_are_the_full_step_s():
    assert finished_outputs(False) == finished_outputs(True)
    assert sum(len(s) for s in finished_outputs(False)) == 9  # 6 requests, 3 of them with 2 sequences
