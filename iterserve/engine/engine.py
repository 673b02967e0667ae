"""The step loop: schedule -> execute -> update, plus tokenization and per-request text."""
from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from iterserve.config import EngineConfig
from iterserve.engine.detokenizer import Detokenizer
from iterserve.outputs import RequestOutput, StepRecord
from iterserve.request import Request, RequestStatus, RequestTimes
from iterserve.sampling_params import MAX_N, SamplingParams
from iterserve.scheduler.output import StepResult, TokenLogprobs
from iterserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("iterserve.engine")


@dataclass(slots=True)
class _TextState:
    detokenizer: Detokenizer | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_tokens_sent: int = 0


class Engine:
    def __init__(self, config: EngineConfig | None = None, executor=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or EngineConfig()
        if executor is None:
            from iterserve.executor.model_runner import ModelRunner
            executor = ModelRunner(self.config)
        self.executor = executor
        self.clock = clock
        self.tokenizer = getattr(executor, "tokenizer", None)
        self.eos_token_id = getattr(executor, "eos_token_id", None)
        self.vocab_size = getattr(executor, "vocab_size", None) or \
            getattr(getattr(executor, "arch", None), "vocab_size", None)
        # config.num_kv_blocks may cap a shared executor's pool (tests, what-if runs)
        num_blocks = min(executor.num_kv_blocks, self.config.num_kv_blocks or executor.num_kv_blocks)
        self.scheduler = Scheduler(self.config, num_blocks, executor.max_model_len, clock,
                                   num_host_blocks=getattr(executor, "num_host_blocks", 0),
                                   bytes_per_block=getattr(executor, "bytes_per_block", 0))
        self.states: dict[str, _TextState] = {}
        self.step_records: deque[StepRecord] = deque(maxlen=200_000)
        self.num_steps = 0

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        params = params or SamplingParams()
        params.validate()
        token_ids = self.encode(prompt)
        if params.logit_bias and self.vocab_size is not None and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary (0..{self.vocab_size - 1})")
        request_id = request_id or uuid.uuid4().hex
        arrival = self.clock() if arrival_time is None else arrival_time
        sequences = [Request(self.sequence_id(request_id, k), token_ids, self._sequence_params(params, k),
                             RequestTimes(arrival=arrival), eos_token_id=self.eos_token_id, priority=priority,
                             cache_salt=cache_salt, index=k, parent_id=request_id) for k in range(params.n)]
        sequences[0].forks = sequences[1:]
        self.scheduler.add_request(sequences[0])  # raises ValueError before touching any state
        for seq in sequences:
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = Detokenizer(self.tokenizer, token_ids, params.stop, params.skip_special_tokens,
                                          params.include_stop_str_in_output)
            self.states[seq.request_id] = _TextState(detokenizer)
        return request_id

    @staticmethod
    def sequence_id(request_id: str, index: int) -> str:
        """Sequence k of a request with n > 1 is its own scheduler request; sequence 0 keeps the id."""
        return request_id if index == 0 else f"{request_id}#{index}"

    @staticmethod
    def _sequence_params(params: SamplingParams, index: int) -> SamplingParams:
        if params.n == 1:
            return params
        seed = None if params.seed is None else params.seed + index  # siblings must not draw alike
        return replace(params, n=1, seed=seed)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this executor has no tokenizer: pass the prompt as token ids")
            return list(self.tokenizer.encode(prompt))
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab is not None and t >= vocab):
                raise ValueError(f"prompt token id {t!r} is not in the vocabulary (0..{vocab})")
        return token_ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all n of its sequences); returns sequence 0's final output."""
        first = self._finish(request_id, RequestStatus.FINISHED_ABORTED)
        for k in range(1, MAX_N):  # siblings finish in any order: look at every possible one
            sid = self.sequence_id(request_id, k)
            if sid in self.states and self._finish(sid, RequestStatus.FINISHED_ABORTED) is None:
                self.states.pop(sid, None)  # never forked: nothing to free
        return first

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- one iteration -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        start = self.clock()
        try:
            result = self.executor.execute(plan)
        except Exception as exc:  # fail this step's requests, keep the engine alive
            logger.exception("model execution failed; failing the %d requests of this step",
                             len(plan.scheduled))
            outputs = [o for s in plan.scheduled if not s.is_padding
                       for o in [self._finish(s.request_id, RequestStatus.FINISHED_ERROR, str(exc))] if o]
            for o in outputs:
                self._drop_unforked(o.request_id)
            return outputs
        logprobs = self._logprobs_by_request(plan, result)
        outputs = []
        for request in self.scheduler.update(plan, result):
            outputs.append(self._output(request, logprobs.get(request.request_id)))
        self.num_steps += 1
        self.step_records.append(self._record(plan, start))
        return outputs

    def _output(self, request: Request, logprobs: TokenLogprobs | None) -> RequestOutput:
        state = self.states[request.request_id]
        if logprobs is not None:
            state.logprobs.append(logprobs)
        if state.detokenizer is not None:
            stop = state.detokenizer.add(request.token_ids[-1],
                                         request.num_output_tokens >= request.sampling_params.min_tokens)
            if stop is not None and not request.finished:
                request.stop_reason = stop
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        return self._emit(request, state)

    def _emit(self, request: Request, state: _TextState, error: str | None = None) -> RequestOutput:
        finished = request.finished
        outputs = request.output_token_ids  # a live list: RequestOutput.token_ids grows with it
        new_text = state.detokenizer.take_new_text(finished) if state.detokenizer else ""
        text = state.detokenizer.text if state.detokenizer else ""
        new_tokens = outputs[state.num_tokens_sent:]
        state.num_tokens_sent = len(outputs)
        if finished:
            self.states.pop(request.request_id, None)
        return RequestOutput(
            request.request_id, request.prompt_token_ids, outputs, text, new_tokens, new_text,
            finished, request.status.value if finished else None, request.times,
            state.logprobs, request.stop_reason, error, request.index, request.parent_id)

    def _drop_unforked(self, request_id: str) -> None:
        """Sibling sequences that never forked (their parent failed first) have nothing to report."""
        for k in range(1, MAX_N):
            sid = self.sequence_id(request_id, k)
            if sid in self.states and sid not in self.scheduler.requests:
                self.states.pop(sid, None)

    def _finish(self, request_id: str, status: RequestStatus, error: str | None = None) -> RequestOutput | None:
        request = self.scheduler.finish_request(request_id, status)
        state = self.states.get(request_id)
        if request is None or state is None:
            return None
        return self._emit(request, state, error)

    @staticmethod
    def _logprobs_by_request(plan, result: StepResult) -> dict[str, TokenLogprobs]:
        if not result.logprobs:
            return {}
        return {s.request_id: lp for s, lp in zip(plan.scheduled, result.logprobs) if lp is not None}

    def _record(self, plan, start: float) -> StepRecord:
        prefill, decode = [], []
        num_prefill_tokens = 0
        for s in plan.scheduled:
            if s.is_padding:
                continue
            if s.output_len > 0 and len(s.token_ids) == 1:
                decode.append(s.request_id)
            else:
                prefill.append(s.request_id)
                num_prefill_tokens += len(s.token_ids)
        return StepRecord(start, self.clock(), self.scheduler.num_running, self.scheduler.num_waiting,
                          plan.num_batched_tokens, self.scheduler.kv_usage, prefill, decode,
                          list(plan.preempted_ids), num_prefill_tokens)
