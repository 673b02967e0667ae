"""The step loop: schedule -> execute -> update -> outputs, plus tokenization and n > 1.

Each request's text, stop strings and outputs belong to the OutputProcessor (output_processor.py);
its tokens to the scheduler.

n > 1 lives here, at the front (as vLLM's ParentRequest does): a request for n sequences becomes n
child requests with the same prompt, which share its KV blocks through the prefix cache and the
in-flight-prefix wait, so the scheduler and the KV manager never see a parent.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import replace
from typing import Any, Callable

from iterserve.config import EngineConfig
from iterserve.engine.output_processor import OutputProcessor, OutputState
from iterserve.engine.spec_decode import NgramProposer, draftable
from iterserve.engine.stats import EngineStats
from iterserve.executor.base import Executor, ExecutorDeadError, LoRAExecutor, LoRANotFoundError, check_executor
from iterserve.kv_transfer.connector import HandoffMeta, KVTransfer
from iterserve.outputs import RequestOutput, StepRecord
from iterserve.request import Request, RequestStatus, RequestTimes
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("iterserve.engine")


def make_executor(config: EngineConfig) -> Executor:
    if config.parallel_config.tensor_parallel_size > 1:
        from iterserve.executor.tp_executor import TPExecutor
        return TPExecutor(config)
    from iterserve.executor.model_runner import ModelRunner
    return ModelRunner(config)


def make_proposer(config: EngineConfig) -> NgramProposer | None:
    sc = config.speculative_config
    if sc.speculative_method is None:
        return None
    return NgramProposer(sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max)


class Engine:
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or EngineConfig()
        self.executor = executor if executor is not None else make_executor(self.config)
        check_executor(self.executor)
        self.clock = clock
        self.tokenizer = self.executor.tokenizer
        self.eos_token_ids = self.executor.eos_token_ids
        self.vocab_size = self.executor.vocab_size
        spec = self.executor.kv_cache_spec
        if self.config.cache_config.num_kv_blocks:  # may cap a shared executor's pool (tests, what-if runs)
            spec = replace(spec, num_device_blocks=min(spec.num_device_blocks, self.config.cache_config.num_kv_blocks))
        if self.config.scheduler_config.preemption_mode == "auto" and spec.num_host_blocks and \
                min(spec.swap_bytes_per_s, spec.recompute_tokens_per_s) <= 0:
            raise ValueError(f"--preemption-mode auto weighs swap against recompute, but "
                             f"{type(self.executor).__name__} reports no cost for them (its KVCacheSpec)")
        self.scheduler = Scheduler(self.config, spec, self.executor.max_model_len, clock)
        asked = self.config.model_config.max_model_len
        if asked is not None and self.scheduler.max_model_len < asked:
            raise ValueError(f"max_model_len {asked} does not fit the KV pool, which holds "
                             f"{self.scheduler.max_model_len} tokens: raise --kv-cache-memory or lower --max-model-len")
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.parents: dict[str, list[str]] = {}  # n > 1: parent id -> its unfinished children's ids
        self.step_records: deque[StepRecord] = deque(maxlen=200_000)
        self.num_steps = 0
        self.num_kv_transfers_recomputed = 0  # P/D decode side: prompts recomputed after a failed transfer
        self.proposer = make_proposer(self.config)

    @property
    def states(self) -> dict[str, OutputState]:
        """Unfinished requests' output state, by id (the output processor's)."""
        return self.output_processor.states

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_swapped=s.num_swapped,
            kv_usage=s.kv.usage, num_kv_blocks=s.kv.num_blocks, num_free_kv_blocks=s.kv.num_free_blocks,
            num_preemptions=s.num_preemptions, num_prefix_queries=s.kv.num_prefix_queries,
            num_prefix_hits=s.kv.num_prefix_hits, num_steps=self.num_steps, max_model_len=s.max_model_len,
            last_step=self.step_records[-1] if self.step_records else None,
            num_kv_transfers_recomputed=self.num_kv_transfers_recomputed, num_spec_drafts=s.num_spec_drafts,
            num_spec_draft_tokens=s.num_spec_draft_tokens, num_spec_accepted_tokens=s.num_spec_accepted_tokens,
            num_queued_tokens=s.num_waiting_tokens)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Queue a request; returns its id. With n > 1 its outputs carry that id as parent_id."""
        params = params or SamplingParams()
        params.validate()
        self._check_lora(params, cache_salt)
        token_ids = self.encode(prompt)
        if params.logit_bias and self.vocab_size is not None and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary (0..{self.vocab_size - 1})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.parents or request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = self.clock() if arrival_time is None else arrival_time
        if params.n == 1:
            self._add(Request(request_id, token_ids, params, RequestTimes(arrival), self.eos_token_ids, priority,
                              cache_salt), params, 0, None)
            return request_id
        children = [f"{request_id}#{k}" for k in range(params.n)]
        for k, child_id in enumerate(children):
            seed = None if params.seed is None else params.seed + k  # siblings must not draw alike
            child_params = replace(params, n=1, seed=seed)
            try:
                self._add(Request(child_id, token_ids, child_params, RequestTimes(arrival), self.eos_token_ids,
                                  priority, cache_salt), params, k, request_id)
            except ValueError:
                for added in children[:k]:
                    self._finish(added, RequestStatus.FINISHED_ABORTED)
                raise
        self.parents[request_id] = children
        return request_id

    # ---- LoRA adapters (model/lora.py); between steps, as every engine call ----------------------
    @property
    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters, name -> path (none where the executor serves no LoRA)."""
        return self.executor.lora_adapters if isinstance(self.executor, LoRAExecutor) else {}

    def _check_lora(self, params: SamplingParams, cache_salt: str | None) -> None:
        if cache_salt is not None and "\0" in cache_salt:  # reserved for the adapters' salts (Request.prefix_salt)
            raise ValueError("cache_salt must not contain a NUL character")
        if params.lora_name is not None and params.lora_name not in self.lora_adapters:
            raise LoRANotFoundError(f"lora_name: no LoRA adapter named {params.lora_name!r} is loaded "
                                    f"(loaded: {', '.join(self.lora_adapters) or 'none'})")

    def load_lora(self, name: str, path: str) -> None:
        self._lora_executor().load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Refused while a request runs under the adapter: its slot's weights are still being read."""
        users = sum(r.sampling_params.lora_name == name for r in self.scheduler.requests.values())
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s); unload it "
                             "when they finish")
        self._lora_executor().unload_lora(name)

    def _lora_executor(self) -> LoRAExecutor:
        if not isinstance(self.executor, LoRAExecutor):
            raise ValueError(f"{type(self.executor).__name__} serves no LoRA adapters (the single-process model "
                             "runner does)")
        return self.executor

    def _add(self, request: Request, params: SamplingParams, index: int, parent_id: str | None) -> None:
        self.scheduler.add_request(request)  # raises ValueError before touching any state
        self.output_processor.add_request(request, params, index, parent_id)

    # ---- disaggregated prefill (docs/disaggregation.md) ------------------------------------
    def add_computed_request(self, transfer: KVTransfer) -> bool:
        """Decode side: carry on a request whose prompt and first token a prefill engine computed, its
        KV blocks written into this pool. Blocks that did not arrive or do not fit are recomputed here
        (counted in stats.num_kv_transfers_recomputed). False: no room or seat yet; ask again later."""
        m, rid = transfer.meta, transfer.request_id
        if rid in self.output_processor:
            raise ValueError(f"request id {rid!r} is already in use")
        request = Request(rid, list(m.prompt_token_ids), m.sampling_params, RequestTimes(m.arrival_time),
                          self.eos_token_ids, m.priority, m.cache_salt)
        request.append_token(m.first_token)
        request.times.first_token = m.first_token_time
        request.times.token_times.append(m.first_token_time)
        unfit = self._unfit(transfer)
        if unfit:
            self._recompute(request, unfit)
        else:
            placed = self.scheduler.add_computed_request(request, transfer.hashes)
            if placed is None:
                return False
            first, block_ids = placed
            self.executor.write_blocks(block_ids, transfer.blocks[:, :, first:])
        self.output_processor.add_request(request, m.sampling_params)
        self.output_processor.mark_sent(request)  # the prefill engine streamed the first token
        return True

    def _unfit(self, transfer: KVTransfer) -> str | None:
        """Why the transferred blocks cannot be used here (None: they can)."""
        if transfer.blocks is None:
            return transfer.error or "no blocks arrived"
        spec, n = self.executor.kv_cache_spec, len(transfer.meta.prompt_token_ids)
        expected = (spec.num_layers, 2, -(-n // spec.block_size), spec.block_size, spec.num_kv_heads, spec.head_width)
        got = tuple(transfer.blocks.shape)
        return None if got == expected else f"blocks of shape {got}, this pool's layout is {expected}"

    def _recompute(self, request: Request, why: str) -> None:
        logger.warning("request %s: KV transfer failed (%s); recomputing its prompt", request.request_id, why)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.scheduler.add_request(request)
        self.num_kv_transfers_recomputed += 1

    def blocks_to_hand_off(self, request_id: str,
                           decode_target: str | None = None) -> tuple[Any, list[bytes], HandoffMeta]:
        """Prefill side: what a decode engine needs to carry on a request whose first token is out: its
        prompt's KV blocks, the prefix hashes of its full prompt blocks, and the rest (HandoffMeta)."""
        request, block_ids, hashes = self.scheduler.prompt_blocks(request_id)
        blocks = self.executor.read_blocks(block_ids)
        meta = HandoffMeta(request.prompt_token_ids, request.output_token_ids[0], request.sampling_params,
                           request.times.arrival, request.times.first_token, request.priority, request.cache_salt,
                           decode_target)
        return blocks, hashes, meta

    def release(self, request_id: str) -> None:
        """Prefill side: drop a request, with no output, whose blocks were handed to a decode engine."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        self.output_processor.remove(request_id)

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
        # the common case, plain ints in range, checked in C; anything else is checked one by one below
        if set(map(type, token_ids)) == {int} and min(token_ids) >= 0 and (vocab is None or max(token_ids) < vocab):
            return token_ids
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab is not None and t >= vocab):
                raise ValueError(f"prompt token id {t!r} is not in the vocabulary (0..{vocab})")
        return token_ids

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request (every sequence of an n > 1 request); returns the final outputs."""
        ids = list(self.parents.get(request_id, [request_id]))
        return [out for rid in ids if (out := self._finish(rid, RequestStatus.FINISHED_ABORTED)) is not None]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one iteration -------------------------------------------------------------------
    def step(self, unfinished: bool = True) -> list[RequestOutput]:
        """One iteration; the outputs of the requests that got tokens. unfinished=False: only those
        that finished (a caller that reads only results, like the simulator's replicas, is spared
        an object per request per step; the next output starts where a skipped one would have)."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        start = self.clock()
        try:
            result = self.executor.execute(plan)
        except ExecutorDeadError:
            raise  # no later step can run either: the engine's owner must see it
        except Exception as exc:  # fail this step's requests, keep the engine alive
            logger.exception("model execution failed; failing the %d requests of this step",
                             len(plan.scheduled))
            return [o for s in plan.scheduled if not s.is_padding
                    for o in [self._finish(s.request_id, RequestStatus.FINISHED_ERROR, str(exc))] if o]
        progressed = self.scheduler.update(plan, result)
        outputs = self.output_processor.process(progressed, plan, result, unfinished)
        self._forget_finished(outputs)
        if self.proposer is not None:
            for request in progressed:
                if not request.finished:
                    self._propose(request)
        self.num_steps += 1
        self.step_records.append(self._record(plan, start))
        return outputs

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _propose(self, request: Request) -> None:
        """Drafts for the request's next step, never past max_tokens or the context (each accepted draft
        and the model's own token are output tokens)."""
        params = request.sampling_params
        if not draftable(params, request.num_output_tokens):
            return
        room = min(params.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        drafts = self.proposer.propose(request.token_ids, room)
        if drafts:
            self.scheduler.set_drafts(request, drafts)

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        """n > 1: a parent is done when its last child is."""
        for out in outputs:
            children = self.parents.get(out.parent_id) if out.finished and out.parent_id is not None else None
            if children is not None:
                children.remove(out.request_id)
                if not children:
                    del self.parents[out.parent_id]

    def _finish(self, request_id: str, status: RequestStatus, error: str | None = None) -> RequestOutput | None:
        request = self.scheduler.finish_request(request_id, status)
        out = None if request is None else self.output_processor.final_output(request, error)
        if out is not None:
            self._forget_finished([out])
        return out

    def _record(self, plan, start: float) -> StepRecord:
        prefill, decode, starts = [], [], []
        num_prefill_tokens = 0
        for s in plan.scheduled:
            if s.is_padding:
                continue
            if s.output_len > 0 and len(s.token_ids) - s.num_draft_tokens == 1:
                decode.append(s.request_id)
            else:
                prefill.append(s.request_id)
                starts.append(s.start_pos)
                num_prefill_tokens += len(s.token_ids)
        return StepRecord(start, self.clock(), self.scheduler.num_running, self.scheduler.num_waiting,
                          plan.num_batched_tokens, self.scheduler.kv_usage, prefill, decode,
                          list(plan.preempted_ids), num_prefill_tokens, starts)
