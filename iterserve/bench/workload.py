"""A reproducible request trace: prompt length, output length and arrival time of every request.

A trace is generated from a seed, saved to JSONL and loaded back, so every target (and every
rerun) sees exactly the same work. Prompts are real text from a small public-domain corpus cut
to the exact token length; outputs are forced to their target length with ignore_eos.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

# ShareGPT as vLLM's benchmark reads it: mean prompt ~161-230 and mean output ~200-340 tokens
# depending on the tokenizer and filtering; we take the middle of each range. sigma gives the
# heavy right tail of chat lengths (median well below the mean).
SHAREGPT_PROMPT_MEAN = 200
SHAREGPT_OUTPUT_MEAN = 270
SHAREGPT_SIGMA = 0.9
CLASSIFY_MAX = 8  # "classification" requests in the mix: 1-8 output tokens

OUTPUT_DISTS = ("fixed", "uniform", "exponential", "lognormal", "mix")
PROMPT_DISTS = ("fixed", "uniform", "exponential", "lognormal")
ARRIVALS = ("offline", "poisson", "gamma", "closed")

DATA_DIR = Path(__file__).parent / "data"


@dataclass(slots=True)
class LengthDist:
    """One length distribution. kind: fixed (mean) | uniform [low, high] | exponential (mean,
    capped at high) | lognormal (mean, sigma, capped at high) | mix (share `mix` of 1-8 token
    "classification" requests, the rest lognormal "chat")."""

    kind: str = "fixed"
    mean: float = 128
    low: int = 1
    high: int | None = None
    sigma: float = SHAREGPT_SIGMA
    mix: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in OUTPUT_DISTS:
            raise ValueError(f"length distribution must be one of {OUTPUT_DISTS}, got {self.kind!r}")
        if self.mean < 1:
            raise ValueError(f"mean length must be >= 1, got {self.mean}")
        if self.kind == "uniform" and (self.high is None or self.high < self.low):
            raise ValueError(f"uniform lengths need low <= high, got [{self.low}, {self.high}]")

    def sample(self, rng: random.Random) -> int:
        cap = self.high or 1 << 30
        if self.kind == "fixed":
            x = self.mean
        elif self.kind == "uniform":
            return rng.randint(self.low, self.high)
        elif self.kind == "exponential":
            x = rng.expovariate(1 / self.mean)
        elif self.kind == "lognormal":
            x = rng.lognormvariate(math.log(self.mean) - self.sigma**2 / 2, self.sigma)
        else:  # mix
            if rng.random() < self.mix:
                return rng.randint(1, CLASSIFY_MAX)
            x = rng.lognormvariate(math.log(self.mean) - self.sigma**2 / 2, self.sigma)
        return int(min(cap, max(self.low, round(x))))

    def expected_mean(self) -> float:
        """The mean of sample() before rounding: tests compare moments against it."""
        c = self.high or math.inf
        if self.kind == "fixed":
            return min(c, self.mean)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "exponential":  # E[min(X, c)] for X ~ Exp(mean)
            return self.mean * (1 - math.exp(-c / self.mean))
        chat = self.mean if c == math.inf else _capped_lognormal_mean(self.mean, self.sigma, c)
        return chat if self.kind == "lognormal" else self.mix * (1 + CLASSIFY_MAX) / 2 + (1 - self.mix) * chat


def _capped_lognormal_mean(mean: float, sigma: float, cap: float) -> float:
    mu = math.log(mean) - sigma**2 / 2
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    z = (math.log(cap) - mu) / sigma
    return mean * phi(z - sigma) + cap * (1 - phi(z))


@dataclass(slots=True)
class TraceRequest:
    request_id: str
    prompt_len: int
    output_len: int
    arrival_time: float  # seconds after the start of the run; 0 for offline and closed loop
    prompt_token_ids: list[int] | None = None  # filled by materialize_prompts


@dataclass(slots=True)
class Trace:
    requests: list[TraceRequest]
    concurrency: int | None = None  # closed loop: keep this many requests in flight
    meta: dict = field(default_factory=dict)  # how it was made (seed, distributions, rate)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def save(self, path: str | Path) -> None:
        """JSONL: a header line, then one line per request (with its prompt ids when materialized)."""
        with open(path, "w") as f:
            f.write(json.dumps({"trace": self.meta, "concurrency": self.concurrency}) + "\n")
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        if not lines or "trace" not in lines[0]:
            raise ValueError(f"{path} is not an iterserve trace (its first line must be the header)")
        head, rows = lines[0], lines[1:]
        return cls([TraceRequest(**row) for row in rows], head.get("concurrency"), head.get("trace") or {})


def arrival_times(n: int, kind: str, rate: float | None, burstiness: float, rng: random.Random) -> list[float]:
    """offline/closed: all at 0. poisson: exponential gaps at `rate`/s. gamma: gaps with shape
    `burstiness` and the same mean (vLLM's definition: < 1 burstier than Poisson, > 1 smoother)."""
    if kind not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}, got {kind!r}")
    if kind in ("offline", "closed"):
        return [0.0] * n
    if not rate or rate <= 0:
        raise ValueError(f"{kind} arrivals need a request rate > 0, got {rate}")
    shape = 1.0 if kind == "poisson" else burstiness
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape, 1 / (rate * shape))
    return out


def make_trace(num_requests: int, prompt: LengthDist, output: LengthDist, *, arrivals: str = "offline",
               request_rate: float | None = None, burstiness: float = 1.0, concurrency: int | None = None,
               seed: int = 0, shared_prefix_len: int = 0) -> Trace:
    """The same arguments and seed give the same trace, on any machine."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if arrivals == "closed" and not (concurrency and concurrency >= 1):
        raise ValueError("a closed loop needs a concurrency >= 1")
    rng = random.Random(seed)
    times = arrival_times(num_requests, arrivals, request_rate, burstiness, random.Random(seed + 1))
    reqs = [TraceRequest(f"r{i}", prompt.sample(rng), output.sample(rng), round(times[i], 6))
            for i in range(num_requests)]
    meta = {"seed": seed, "num_requests": num_requests, "prompt": asdict(prompt), "output": asdict(output),
            "arrivals": arrivals, "request_rate": request_rate, "burstiness": burstiness,
            "shared_prefix_len": shared_prefix_len}
    return Trace(reqs, concurrency if arrivals == "closed" else None, meta)


# ---------------------------------------------------------------- prompt text

def load_corpus() -> str:
    files = sorted(DATA_DIR.glob("*.txt"))
    assert files, f"the bench corpus is missing from {DATA_DIR}"
    return "\n\n".join(f.read_text() for f in files)


_CORPUS_IDS: dict[int, list[int]] = {}


def corpus_token_ids(tokenizer) -> list[int]:
    """The corpus as token ids: the tokenizer's when there is one; bytes for simulated engines."""
    key = id(tokenizer)
    if key not in _CORPUS_IDS:
        text = load_corpus()
        ids = list(text.encode()) if tokenizer is None else tokenizer.encode(text, add_special_tokens=False)
        _CORPUS_IDS[key] = ids
    return _CORPUS_IDS[key]


def materialize_prompts(trace: Trace, tokenizer, seed: int | None = None) -> Trace:
    """Give every request without prompt ids a window of the corpus, exactly prompt_len tokens
    long, at a seeded offset (wrapping round the corpus for prompts longer than it)."""
    ids = corpus_token_ids(tokenizer)
    rng = random.Random(trace.meta.get("seed", 0) if seed is None else seed)
    # A system prompt every request starts with (prefix caching workloads); the rest is its own.
    prefix = (ids * (trace.meta.get("shared_prefix_len", 0) // len(ids) + 1))[:trace.meta.get("shared_prefix_len", 0)]
    for r in trace.requests:
        start = rng.randrange(len(ids))
        if r.prompt_token_ids is None:
            own = max(0, r.prompt_len - len(prefix))
            reps = (start + own) // len(ids) + 1
            window = (ids * reps)[start:start + own] if reps > 1 else ids[start:start + own]
            r.prompt_token_ids = (prefix + window)[:r.prompt_len]
        assert len(r.prompt_token_ids) == r.prompt_len, (r.request_id, len(r.prompt_token_ids), r.prompt_len)
    return trace


def multi_tenant_trace(num_tenants: int, system_prompt_len: int, num_requests: int, user_len: int = 64,
                       output_len: int = 64, request_rate: float | None = None, seed: int = 0,
                       tokenizer=None) -> Trace:
    """Tenants take turns (interleaved, in a seeded shuffle), each request its tenant's system
    prompt (its own window of the corpus) followed by a question of its own: the trace where
    routing decides how often a replica finds the prefix in its cache."""
    ids = corpus_token_ids(tokenizer)
    rng = random.Random(seed)

    def window(n: int) -> list[int]:
        start = rng.randrange(len(ids))
        return [ids[(start + k) % len(ids)] for k in range(n)]

    systems = [window(system_prompt_len) for _ in range(num_tenants)]
    tenants = [i % num_tenants for i in range(num_requests)]
    rng.shuffle(tenants)
    times = arrival_times(num_requests, "poisson" if request_rate else "offline", request_rate, 1.0,
                          random.Random(seed + 1))
    reqs = []
    for i, t in enumerate(tenants):
        prompt = systems[t] + window(user_len)
        reqs.append(TraceRequest(f"t{t}-r{i}", len(prompt), output_len, round(times[i], 6), prompt))
    meta = {"seed": seed, "num_requests": num_requests, "num_tenants": num_tenants,
            "system_prompt_len": system_prompt_len, "user_len": user_len, "output_len": output_len,
            "arrivals": "poisson" if request_rate else "offline", "request_rate": request_rate}
    return Trace(reqs, None, meta)
