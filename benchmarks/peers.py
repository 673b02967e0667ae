"""iterserve against its CPU peers, side by side in one run on this machine: llama.cpp's `llama-server`
(a BF16 GGUF, a Q8_0 GGUF and the Q4_1 GGUF of the same model) and OpenVINO GenAI (fp16, int8 and int4
weights, u8 KV cache), one at a time, never two at once. iterserve runs in its default dtype and, where
the CPU has AVX-512 VNNI, again with --quantization w8a8 (--quantized): int8 weights under int8
activations quantized per token, the like-for-like of llama.cpp's Q8_0 (whose CPU dot products quantize
the activations to 8 bits too) and of OpenVINO's int8 weights (whose CPU plugin quantizes the
activations dynamically).

    python benchmarks/peers.py                                    # the full comparison (builds peers first)
    python benchmarks/peers.py --num-requests 4 --output-len 16   # a smoke run
    python benchmarks/peers.py --setup-only                       # build / install the peers, measure nothing
    python benchmarks/peers.py --skip openvino --llama-server ~/llama.cpp/build/bin/llama-server
    python benchmarks/peers.py --model-shape 1b --num-requests 32      # a real size (benchmarks/model_shapes.py)
    python benchmarks/peers.py --model-shape 8b --shape-format q4_k_m --skip llama-bf16,llama-q8_0

Figures, in one table:
- throughput: --num-requests requests of --prompt-len tokens, --concurrency in flight, --output-len
  tokens each (greedy, ignore_eos, so every request makes them all): output tok/s through HTTP for
  `iterserve serve` and each llama-server (iterserve's own load generator, `iterserve.bench.run_http`,
  the same token-id prompts as `iterserve bench`), and offline for `iterserve.LLM` and OpenVINO GenAI's
  ContinuousBatchingPipeline (the continuous-batching backend its LLMPipeline uses with a
  SchedulerConfig): the like-for-like row, as OpenVINO GenAI has no server here. Ratios iterserve / peer.
- one stream: --stream-requests requests of the same lengths one after another through each server;
  mean TTFT and TPOT (mean inter-token time after the first).
- start-up: spawn to the first 200 from /health; RSS of the server process and its children after the
  runs (for the offline rows: the process's RSS after its run).
- a sanity line per OpenVINO format: how many greedy tokens of the first request equal iterserve's
  (the same model from the same GGUF; they drift apart where the dtypes round differently).

A peer that fails (its server dies before /health answers or mid-run, its load run raises, its child
process fails) costs its own row only: the row says why, the last lines of its log follow the table, the
run goes on with the next peer, and the exit status is 1 once everything is printed (and written, --json).

The KV budget is the same for every engine, in token positions: --max-num-seqs slots (default
--concurrency) and a pool of KVBudget.tokens positions, by default just enough for every slot to hold a
whole request (prompt + output), or what iterserve's --kv-cache-memory holds. iterserve gets
--max-num-seqs and --num-kv-blocks (tokens / its block size), llama-server -np slots -c tokens (it
splits -c evenly over its slots, so each slot must hold a whole request), OpenVINO max_num_seqs and
num_kv_blocks (tokens / its block size); llama-server runs with --cache-ram 0 (no host-RAM prompt
cache beside the pool, 8 GiB by default) and -t/-tb --threads. The bytes differ by design: float32 or
bfloat16 K/V here, f16 in llama.cpp, u8 in OpenVINO.

The peers are built or installed once into --peers-dir (default ~/.cache/iterserve-peers), all under
nice: llama.cpp from the vendor/ tree of PyPI's llama-cpp-python sdist (cmake, GGML_NATIVE, -j2), its
BF16 GGUF by `llama-quantize --allow-requantize` of the Q4_1 file (dequantized, tokenizer metadata kept);
OpenVINO GenAI into a venv of its own (torch==2.13.0 CPU first), the model exported by optimum-intel
from a Hugging Face directory that transformers builds from the GGUF. Give your own with --llama-server,
--llama-quantize, --openvino-python. The OpenVINO run is this file run by that venv's python
(`--openvino-child`: stdlib and openvino_genai only, so nothing at module level imports iterserve).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
OV_PACKAGES = ["openvino-genai==2026.4.1.0", "openvino-tokenizers", "optimum-intel", "nncf", "gguf", "accelerate"]
OV_WEIGHTS = ("fp16", "int8", "int4")
TARGETS = ("iterserve-http", "llama-q4_1", "llama-q4_k_m", "llama-q8_0", "llama-bf16", "iterserve-offline",
           "openvino")
LLAMA_COPIES = {"llama-bf16": "BF16", "llama-q8_0": "Q8_0"}  # made from the shipped Q4_1 by llama-quantize
SHAPE_GGUFS = {"llama-bf16": "bf16", "llama-q8_0": "q8_0", "llama-q4_k_m": "q4_k_m"}  # model_shapes.py's formats
BLOCK_SIZE = 16  # iterserve's default --block-size
OV_CPU_BLOCK_SIZE = 32  # OpenVINO GenAI's DeviceConfig: 32 positions a KV block on CPU (16 on GPU), not settable
NICE = ["nice", "-n", "19"]


# ---------------------------------------------------------------- the KV budget (pure)

@dataclass(frozen=True, slots=True)
class KVBudget:
    """One KV budget for every engine: `slots` sequences at once over a pool of `tokens` positions."""

    slots: int
    tokens: int

    def iterserve_args(self, block_size: int) -> list[str]:
        return ["--max-num-seqs", str(self.slots), "--num-kv-blocks", str(self.tokens // block_size)]

    def llama_server_args(self) -> list[str]:
        return ["-np", str(self.slots), "-c", str(self.tokens)]

    def openvino(self, block_size: int) -> dict[str, int]:
        return {"max_num_seqs": self.slots, "num_kv_blocks": self.tokens // block_size}

    def describe(self, block_size: int, ov_block_size: int) -> str:
        return (f"KV budget {self.tokens:,} positions = {self.slots} slots x {self.tokens // self.slots}: "
                f"iterserve {' '.join(self.iterserve_args(block_size))}; "
                f"llama-server {' '.join(self.llama_server_args())}; "
                f"OpenVINO max_num_seqs={self.slots} num_kv_blocks={self.tokens // ov_block_size} "
                f"(block {ov_block_size})")


def kv_budget(slots: int, tokens_per_request: int, block_size: int = BLOCK_SIZE, kv_cache_memory: int | None = None,
              kv_bytes_per_token: int | None = None, ov_block_size: int = OV_CPU_BLOCK_SIZE) -> KVBudget:
    """The budget from iterserve's --kv-cache-memory (whole blocks, as iterserve sizes its pool) or,
    without it, just enough for every slot to hold a whole request. Positions are rounded down to whole
    blocks of every engine and a multiple of the slots, so each engine gets exactly the same pool and
    llama-server's per-slot share is a whole number."""
    if slots < 1 or tokens_per_request < 1:
        raise ValueError(f"slots and tokens per request must be >= 1, got {slots} and {tokens_per_request}")
    unit = math.lcm(block_size, ov_block_size) * slots
    if kv_cache_memory is None:
        tokens = math.ceil(slots * tokens_per_request / unit) * unit
    else:
        if not kv_bytes_per_token:
            raise ValueError("--kv-cache-memory needs iterserve's K/V bytes per token")
        tokens = int(kv_cache_memory // (block_size * kv_bytes_per_token)) * block_size // unit * unit
    if tokens // slots < tokens_per_request:
        raise ValueError(f"a KV pool of {tokens} positions over {slots} slots gives each {tokens // slots}, less "
                         f"than one request's {tokens_per_request} tokens (llama-server splits -c evenly over "
                         f"-np): raise --kv-cache-memory or lower --max-num-seqs")
    return KVBudget(slots, tokens)


# ---------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> int:
    """VmRSS of a process and all its descendants, in bytes (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total


def self_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def run_logged(cmd: list[str], log: Path, **kw) -> None:
    """Run a set-up step under nice, its output to `log`; on failure, its tail in the error."""
    print(f"  $ {shlex.join(cmd)}", flush=True)
    with open(log, "a") as f:
        done = subprocess.run(NICE + cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"failed ({done.returncode}): {shlex.join(cmd)}\n{log.read_text()[-3000:]}")


class PeerFailed(RuntimeError):
    """A peer that could not be measured: a short reason for its row, and the tail of its log."""

    def __init__(self, reason: str, log: str = ""):
        super().__init__(reason)
        self.reason, self.log = reason, log


def exit_reason(returncode: int) -> str:
    """How a process ended, in words (Popen gives a signal's death as minus its number)."""
    if returncode < 0:
        return f"crashed (signal {-returncode}: {signal.strsignal(-returncode) or 'unknown'})"
    return f"exited with code {returncode}"


def tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.splitlines()[-lines:])


class Server:
    """A server process in its own process group: spawned, waited on until /health answers 200, stopped."""

    def __init__(self, name: str, cmd: list[str], port: int, timeout: float, verbose: bool):
        self.name, self.cmd, self.url = name, cmd, f"http://127.0.0.1:{port}"
        self.log = None if verbose else tempfile.TemporaryFile()
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - start

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerFailed(f"{exit_reason(self.proc.returncode)} before /health answered", self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # llama-server answers 503 while it loads
            time.sleep(0.05)
        raise PeerFailed(f"not ready within {timeout:.0f} s", self.log_tail())

    def died(self) -> str | None:
        """How the server ended, if it did: what a failed load run is reported as, not the client's error.
        A moment's wait, as a dying server drops its connections just before it is gone."""
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return None
        return f"{exit_reason(self.proc.returncode)} mid-run"

    def log_tail(self) -> str:
        if self.log is None:  # --verbose: the log went to the terminal
            return ""
        self.log.seek(0)
        return tail(self.log.read().decode(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.log is not None:
            self.log.close()


# ---------------------------------------------------------------- getting the peers

def build_llama_cpp(peers: Path) -> tuple[Path, Path]:
    """llama-server and llama-quantize from the llama.cpp tree vendored in llama-cpp-python's sdist."""
    src = peers / "llama.cpp-src"
    build, flags = llama_cpp_build(src)
    server, quantize = build / "bin" / "llama-server", build / "bin" / "llama-quantize"
    if server.exists() and quantize.exists():
        return server, quantize
    peers.mkdir(parents=True, exist_ok=True)  # model_shapes.py calls this on a machine that has no peers yet
    log = peers / "llama-build.log"
    print(f"building llama.cpp into {build} (log: {log}); this takes a while on few cores", flush=True)
    if not (src / "CMakeLists.txt").exists():
        tmp = Path(tempfile.mkdtemp(dir=peers))
        run_logged([sys.executable, "-m", "pip", "download", LLAMA_CPP_PYTHON, "--no-binary", ":all:", "--no-deps",
                    "-d", str(tmp)], log)
        sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
        run_logged(["tar", "xzf", str(sdist), "-C", str(tmp)], log)
        shutil.move(str(next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"))), src)
        shutil.rmtree(tmp)
    # No web UI download (no network at run time), no TLS, static binaries.
    run_logged(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *flags,
                "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"], log)
    run_logged(["cmake", "--build", str(build), "-j2", "--target", "llama-server", "llama-quantize"], log)
    return server, quantize


GGML_ISA = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
            "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16"}


def llama_cpp_build(src: Path, cpu_flags: set[str] | None = None) -> tuple[Path, list[str]]:
    """The build folder and its ISA flags: GGML_NATIVE, except on an AMX CPU, where ggml's AMX backend crashes
    on quantized weights (SIGSEGV in ggml_backend_amx_mul_mat, llama.cpp#20824: every Q8_0 and Q4_K_M start
    here) while BF16 never runs on it: there every other extension this CPU has, the AMX backend left out."""
    if cpu_flags is None:
        cpu_flags = set(Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()) \
            if Path("/proc/cpuinfo").exists() else set()
    if "amx_int8" not in cpu_flags:
        return src / "build", ["-DGGML_NATIVE=ON"]
    return src / "build-no-amx", ["-DGGML_NATIVE=OFF", *(f"-DGGML_{name}={'ON' if flag in cpu_flags else 'OFF'}"
                                                          for flag, name in GGML_ISA.items())]


def requantized_gguf(model: Path, quantize: Path, peers: Path, kind: str) -> Path:
    """The model's BF16 or Q8_0 copy: llama-quantize dequantizes every tensor and writes `kind`, metadata kept."""
    out = peers / "models" / f"{model.stem.split('.')[0]}.{kind}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        run_logged([str(quantize), "--allow-requantize", str(model), str(tmp), kind], peers / "quantize.log")
        tmp.rename(out)
    return out


def openvino_python(peers: Path) -> Path:
    """A venv of its own for OpenVINO GenAI and optimum-intel (torch pinned to the CPU wheel first)."""
    venv = peers / "ov-venv"
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import openvino_genai, optimum.intel, nncf, gguf, accelerate"],
                                      capture_output=True).returncode == 0:
        return py
    log = peers / "ov-install.log"
    print(f"installing OpenVINO GenAI into {venv} (log: {log})", flush=True)
    if not py.exists():
        run_logged([sys.executable, "-m", "venv", str(venv)], log)
    run_logged([str(py), "-m", "pip", "install", "-q", "torch==2.13.0"], log)
    run_logged([str(py), "-m", "pip", "install", "-q", *OV_PACKAGES, "torch==2.13.0"], log)
    # optimum-intel pulls PyPI's torchvision, built against CUDA torch: beside the CPU wheel it fails to
    # load and breaks transformers' imports. Exporting a text model does not need it.
    run_logged([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision"], log)
    return py


HF_FROM_GGUF = """
import os, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(gguf), os.path.basename(gguf)
AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype="float32").save_pretrained(out)
"""


def hf_directory(model: Path, py: Path, peers: Path) -> Path:
    """A Hugging Face directory transformers builds from the GGUF (dequantized to float32), for optimum-intel."""
    hf, log = peers / "hf" / model.stem.split(".")[0], peers / "ov-export.log"
    if not (hf / "config.json").exists():
        print(f"building a Hugging Face directory from {model.name} into {hf} (log: {log})", flush=True)
        tmp = hf.with_name(hf.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        run_logged([str(py), "-c", HF_FROM_GGUF, str(model), str(tmp)], log)
        tmp.rename(hf)
    return hf


def openvino_models(name: str, hf: Path, py: Path, peers: Path, weights: list[str]) -> dict[str, Path]:
    """OpenVINO IR of the model at each weight format, exported by optimum-intel from a HF directory."""
    out, log = {}, peers / "ov-export.log"
    for fmt in weights:
        ir = peers / "ov-models" / f"{name}-{fmt}"
        if not (ir / "openvino_model.xml").exists():
            print(f"exporting {name} to OpenVINO {fmt} into {ir}", flush=True)
            # int4 for every layer (ratio 1.0; optimum's default mixes int8 in per model), in groups of 64 as
            # 64 divides every input width of small models (576 here): a layer a group does not divide stays int8.
            extra = ["--group-size", "64", "--ratio", "1.0"] if fmt == "int4" else []
            tmp = ir.with_name(ir.name + ".tmp")  # renamed when whole, so an interrupted export is redone
            shutil.rmtree(tmp, ignore_errors=True)
            run_logged([str(py), "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(hf),
                        "--task", "text-generation-with-past", "--weight-format", fmt, *extra, str(tmp)], log)
            shutil.rmtree(ir, ignore_errors=True)
            tmp.rename(ir)
        out[fmt] = ir
    return out


# ---------------------------------------------------------------- measuring

def http_target(server: Server, trace, stream, progress: bool) -> dict:
    """One server: a warm-up request, the throughput trace, then the single-stream trace."""
    from iterserve.bench import summarize
    from iterserve.bench.runner import run_http
    from iterserve.bench.workload import Trace, TraceRequest

    warm = Trace([TraceRequest("warmup", 16, 4, 0.0, trace.requests[0].prompt_token_ids[:16])], 1)
    run_http(warm, server.url)
    tput = summarize(run_http(trace, server.url, progress=progress), per_request=False)
    one = summarize(run_http(stream, server.url), per_request=False)
    check_complete(server.name, tput, trace)
    check_complete(server.name, one, stream)
    return {"name": server.name, "command": shlex.join(server.cmd), "output_tokens_per_s": tput["output_tokens_per_s"],
            "ttft_mean_s": tput["ttft_s"]["mean"], "tpot_mean_s": tput["tpot_s"]["mean"],
            "stream_ttft_s": one["ttft_s"]["mean"], "stream_tpot_s": one["tpot_s"]["mean"],
            "ready_s": server.ready_s, "rss": tree_rss(server.proc.pid)}


def check_complete(name: str, summary: dict, trace) -> None:
    """Every request finished with all its tokens: otherwise the peers did not do the same work."""
    if summary["failed"] or summary["output_tokens"] != trace.total_output_tokens:
        raise RuntimeError(f"{name}: {summary['failed']} requests failed, {summary['output_tokens']} output tokens "
                           f"of {trace.total_output_tokens} (is ignore_eos honoured? is the context large enough?)")


def as_failure(e: Exception) -> PeerFailed:
    """Any error as a row's failure: its first line the reason, the rest (up to 20 lines) its log."""
    if isinstance(e, PeerFailed):
        return e
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return PeerFailed(lines[0], tail("\n".join(lines[1:])))


def guarded(name: str, measure: Callable[[], dict]) -> dict:
    """A row measured, or recorded as failed with its reason: a peer that crashes costs its own row,
    not the figures of the rest of the run."""
    try:
        return measure()
    except Exception as e:  # whatever broke, it broke this peer's row only
        failure = as_failure(e)
        print(f"{name}: FAILED: {failure.reason}", flush=True)
        return {"name": name, "failed": failure.reason, "log_tail": failure.log}


def run_child(name: str, cmd: list[str], timeout: float) -> dict:
    """An offline run in a child process; its last stdout line is its JSON result."""
    print(f"  $ {shlex.join(cmd)}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise PeerFailed(exit_reason(done.returncode), tail(done.stderr))
    return {"name": name, **json.loads(done.stdout.strip().splitlines()[-1])}


def iterserve_offline_child(args: argparse.Namespace) -> None:
    """iterserve.LLM over the trace's prompts, all submitted at once; JSON on stdout."""
    from iterserve import LLM, SamplingParams
    from iterserve.bench.runner import trace_params
    from iterserve.bench.workload import Trace

    trace = Trace.load(args.trace)
    t = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.slots, num_kv_blocks=args.kv_blocks,
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.child_quantization,
              kv_cache_dtype=args.child_kv_cache_dtype)
    load_s = time.perf_counter() - t
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([trace.requests[0].prompt_token_ids[:16]], warm, use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in trace.requests], [trace_params(r) for r in trace.requests],
                        use_tqdm=False)
    seconds = time.perf_counter() - t
    print(json.dumps({"output_tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds,
                      "load_s": load_s, "rss": self_rss(), "first_output": list(outs[0].token_ids)}))


def openvino_child(args: argparse.Namespace) -> None:
    """Runs under the OpenVINO venv's python. The trace's prompts as token ids through
    ContinuousBatchingPipeline (u8 KV cache, the shared KV budget), all submitted at once; JSON on stdout."""
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    rows = [json.loads(line) for line in Path(args.trace).read_text().splitlines()[1:] if line.strip()]
    sched = genai.SchedulerConfig()
    sched.max_num_seqs, sched.num_kv_blocks = args.slots, args.kv_blocks
    sched.max_num_batched_tokens = args.max_num_batched_tokens
    sched.dynamic_split_fuse, sched.enable_prefix_caching = True, True
    t = time.perf_counter()
    pipe = genai.ContinuousBatchingPipeline(args.model, sched, "CPU", {"KV_CACHE_PRECISION": ov.Type.u8})
    load_s = time.perf_counter() - t

    def config(n: int):
        c = genai.GenerationConfig()
        c.max_new_tokens = c.min_new_tokens = n
        c.ignore_eos, c.do_sample = True, False
        return c

    def ids(tokens: list[int]):
        return ov.Tensor(np.array([tokens], dtype=np.int64))

    pipe.generate([ids(rows[0]["prompt_token_ids"][:16])], [config(4)])
    prompts, configs = [ids(r["prompt_token_ids"]) for r in rows], [config(r["output_len"]) for r in rows]
    t = time.perf_counter()
    outs = pipe.generate(prompts, configs)
    seconds = time.perf_counter() - t
    print(json.dumps({"output_tokens": sum(len(o.m_generation_ids[0]) for o in outs), "seconds": seconds,
                      "load_s": load_s, "rss": self_rss(), "first_output": list(outs[0].m_generation_ids[0]),
                      "settings": {"kv_cache_precision": "u8", "num_kv_blocks": args.kv_blocks,
                                   "max_num_seqs": args.slots, "openvino_genai": genai.__version__}}))


def offline_row(result: dict, trace) -> dict:
    if result["output_tokens"] != trace.total_output_tokens:
        raise RuntimeError(f"{result['name']}: {result['output_tokens']} output tokens of {trace.total_output_tokens}")
    return {**result, "output_tokens_per_s": result["output_tokens"] / result["seconds"]}


# ---------------------------------------------------------------- the run

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the shipped SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--model-shape", default=None, choices=["1b", "3b", "8b"],
                   help="benchmarks/model_shapes.py's random-weight model of this shape instead of --model: "
                        "llama-server runs each of its GGUF files that exists, OpenVINO its HF directory")
    p.add_argument("--shape-format", default="hf", choices=["hf", "bf16", "q8_0", "q4_k_m"],
                   help="with --model-shape: the file iterserve serves (hf: the bf16 safetensors directory)")
    p.add_argument("--models-dir", default=os.path.expanduser("~/.cache/iterserve-models"),
                   help="where benchmarks/model_shapes.py wrote the shapes' files")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--stream-requests", type=int, default=3, help="single-stream requests, one after another")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=None, help="slots for every engine (default: --concurrency)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="iterserve's KV pool in bytes (e.g. 1GiB); every peer gets as many positions. Default: "
                        "just enough for every slot to hold a whole request")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="iterserve's and OpenVINO's step budget")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t / -tb")
    p.add_argument("--skip", default="", help=f"comma-separated, of: {', '.join(TARGETS)}")
    p.add_argument("--openvino-weights", default=",".join(OV_WEIGHTS), help="OpenVINO weight formats to run")
    p.add_argument("--peers-dir", default=os.path.expanduser("~/.cache/iterserve-peers"))
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: build one in --peers-dir)")
    p.add_argument("--llama-quantize", default=None, help="a llama-quantize binary (for the BF16 copy)")
    p.add_argument("--bf16-gguf", default=None, help="the model's BF16 GGUF (default: made by llama-quantize)")
    p.add_argument("--openvino-python", default=None, help="python of a venv with openvino_genai and optimum-intel")
    p.add_argument("--serve-args", default="", help="more `iterserve serve` flags, one shell-quoted string")
    p.add_argument("--quantized", default="w8a8", help="run iterserve (HTTP and offline) again with --quantization "
                   "this (default w8a8 where the CPU has AVX-512 VNNI); '' for none; bf16: the default weights "
                   "again, for --quantized-kv-cache-dtype")
    p.add_argument("--quantized-kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="the --quantized rows' KV cache (int8: as OpenVINO's u8 default; llama.cpp's is f16)")
    p.add_argument("--llama-args", default="", help="more llama-server flags, one shell-quoted string")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--setup-only", action="store_true", help="build / install / export the peers and stop")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--verbose", action="store_true", help="show the servers' logs and progress bars")
    # The offline runs, in child processes (OpenVINO's in its own venv).
    p.add_argument("--iterserve-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--openvino-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trace", help=argparse.SUPPRESS)
    p.add_argument("--slots", type=int, help=argparse.SUPPRESS)
    p.add_argument("--kv-blocks", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-quantization", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def setup_peers(args: argparse.Namespace, model: Path, skip: set[str]) -> dict:
    """The peers' binaries and models. got["llama_ggufs"]: (target, GGUF) per llama-server row; for the shipped
    model the file itself and its copies by llama-quantize, for a --model-shape model_shapes.py's files."""
    peers = Path(args.peers_dir)
    peers.mkdir(parents=True, exist_ok=True)
    got: dict = {"llama_ggufs": []}
    shape = shape_files(args) if args.model_shape else None
    if not set(TARGETS[1:5]) <= skip:
        server, quantize = build_llama_cpp(peers) if not args.llama_server else (
            Path(args.llama_server), Path(args.llama_quantize or Path(args.llama_server).with_name("llama-quantize")))
        got["llama_server"] = server
        if shape:
            got["llama_ggufs"] = [(t, shape.of(f)) for t, f in SHAPE_GGUFS.items() if shape.of(f).exists()]
        else:
            got["llama_ggufs"] = [("llama-q4_1", model)] + [
                (t, Path(args.bf16_gguf) if kind == "BF16" and args.bf16_gguf else
                 requantized_gguf(model, quantize, peers, kind)) for t, kind in LLAMA_COPIES.items() if t not in skip]
        got["llama_ggufs"] = [(t, g) for t, g in got["llama_ggufs"] if t not in skip]
    if "openvino" not in skip and not (shape and not shape.hf.exists()):
        py = Path(args.openvino_python) if args.openvino_python else openvino_python(peers)
        got["ov_python"] = py
        hf, name = (shape.hf, args.model_shape) if shape else (hf_directory(model, py, peers), model.stem.split(".")[0])
        got["ov_models"] = openvino_models(name, hf, py, peers, args.openvino_weights.split(","))
    return got


def shape_files(args: argparse.Namespace):
    """model_shapes.py's files of --model-shape (made by that script, not here: an 8B shape takes a while)."""
    sys.path.insert(0, str(Path(__file__).parent))  # model_shapes.py beside this file, also when a test loads it
    import model_shapes
    files = model_shapes.paths(args.model_shape, args.models_dir)
    if not files.of(args.shape_format).exists():
        raise ValueError(f"{files.of(args.shape_format)} is missing: run python benchmarks/model_shapes.py "
                         f"--shapes {args.model_shape} --formats {args.shape_format}")
    return files


def weight_flag(flag: str, mode: str) -> list[str]:
    """The --quantized rows' weight flag: none for bf16 (the default weights, another KV cache)."""
    return [] if mode == "bf16" else [flag, mode]


def quantized_mode(name: str) -> str | None:
    """--quantized, or None where it is '' or 'none' or this CPU's build cannot run it (said once, not an error)."""
    if name in ("", "none"):
        return None
    if name == "bf16":  # the default weights again, for the rows' KV cache alone (--quantized-kv-cache-dtype)
        return name
    from iterserve.model.quant import check_supported
    import torch
    try:
        check_supported(name, torch.device("cpu"))
    except ValueError as e:
        print(f"no iterserve {name} rows: {e}", flush=True)
        return None
    return name


def iterserve_kv_bytes_per_token(model: str) -> int:
    from iterserve.executor.dtypes import pick_device, storage_dtype
    from iterserve.sim.model_spec import get_model_spec
    elem = storage_dtype("auto", pick_device("cpu")).itemsize
    return get_model_spec(model, elem).kv_bytes_per_token


def http_row(key: str, name: str, cmd: list[str], args: argparse.Namespace, trace, stream) -> dict:
    """One server started, measured and stopped. A load run that fails because the server died is
    reported as the death (a signal, an exit code), not as the client's connection error."""
    port = free_port()
    flag = ["--port", str(port)] + (["--host", "127.0.0.1"] if key.startswith("llama") else [])
    print(f"{name}: starting", flush=True)
    server = Server(name, cmd + flag, port, args.timeout, args.verbose)
    try:
        row = http_target(server, trace, stream, args.verbose)
    except Exception as e:
        raise PeerFailed(server.died() or as_failure(e).reason, server.log_tail()) from e
    finally:
        server.stop()
    print(f"{name}: {row['output_tokens_per_s']:.1f} out tok/s", flush=True)
    return row


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    from iterserve.bench import LengthDist, make_trace, materialize_prompts
    from iterserve.config import parse_bytes
    from iterserve.model.loader import default_model_path, load_tokenizer

    skip = {s for s in args.skip.split(",") if s}
    if unknown := skip - set(TARGETS):
        raise ValueError(f"unknown --skip {', '.join(sorted(unknown))}: use {', '.join(TARGETS)}")
    if unknown := set(args.openvino_weights.split(",")) - set(OV_WEIGHTS):
        raise ValueError(f"unknown --openvino-weights {', '.join(sorted(unknown))}: use {', '.join(OV_WEIGHTS)}")
    if args.model_shape and args.model:
        raise ValueError("give --model or --model-shape, not both")
    model = shape_files(args).of(args.shape_format) if args.model_shape else Path(args.model or default_model_path())
    model = model.resolve()
    peers = setup_peers(args, model, skip)
    if args.setup_only:
        return {"peers": {k: str(v) for k, v in peers.items()}}
    memory = parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None
    budget = kv_budget(args.max_num_seqs or args.concurrency, args.prompt_len + args.output_len, BLOCK_SIZE, memory,
                       iterserve_kv_bytes_per_token(str(model)) if memory else None, OV_CPU_BLOCK_SIZE)
    tok = load_tokenizer(str(model))
    fixed = lambda n: LengthDist("fixed", n)  # noqa: E731
    trace = materialize_prompts(make_trace(args.num_requests, fixed(args.prompt_len), fixed(args.output_len),
                                           arrivals="closed", concurrency=args.concurrency, seed=args.seed), tok)
    stream = materialize_prompts(make_trace(args.stream_requests, fixed(args.prompt_len), fixed(args.output_len),
                                            arrivals="closed", concurrency=1, seed=args.seed + 1), tok)
    print(budget.describe(BLOCK_SIZE, OV_CPU_BLOCK_SIZE), flush=True)
    http, offline = [], []
    # No host-RAM prompt cache (8 GiB by default): the KV budget is the pool alone, as for the others.
    llama = lambda gguf: [str(peers.get("llama_server")), "-m", str(gguf), *budget.llama_server_args(),  # noqa: E731
                          "-t", str(args.threads), "-tb", str(args.threads), "--cache-ram", "0",
                          *shlex.split(args.llama_args)]
    serve = [sys.executable, "-m", "iterserve.cli", "serve", "--model", str(model), *budget.iterserve_args(BLOCK_SIZE),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), *shlex.split(args.serve_args)]
    quantized = quantized_mode(args.quantized)
    label = f"{quantized}{' int8 KV' if args.quantized_kv_cache_dtype == 'int8' else ''}"  # the quantized rows'
    servers = [("iterserve-http", "iterserve serve", serve)]
    if quantized:
        servers.append(("iterserve-http", f"iterserve serve {label}",
                        serve + [*weight_flag("--quantization", quantized), "--kv-cache-dtype",
                                 args.quantized_kv_cache_dtype]))
    servers += [(t, f"llama-server {gguf.name}", llama(gguf)) for t, gguf in peers["llama_ggufs"]]
    for key, name, cmd in servers:
        if key not in skip:
            http.append(guarded(name, lambda: http_row(key, name, cmd, args, trace, stream)))
    with tempfile.TemporaryDirectory(prefix="iterserve-peers-") as tmp:
        path = os.path.join(tmp, "trace.jsonl")
        trace.save(path)
        child = ["--trace", path, "--slots", str(budget.slots)]
        for mode in ([None, quantized] if quantized else [None]) if "iterserve-offline" not in skip else []:
            cmd = [sys.executable, os.path.abspath(__file__), "--iterserve-child", "--model", str(model), *child,
                   "--kv-blocks", str(budget.tokens // BLOCK_SIZE), "--max-num-batched-tokens",
                   str(args.max_num_batched_tokens),
                   *([*weight_flag("--child-quantization", mode), "--child-kv-cache-dtype",
                      args.quantized_kv_cache_dtype] if mode else [])]
            name = f"iterserve LLM {label}" if mode else "iterserve LLM"
            offline.append(guarded(name, lambda: offline_row(run_child(name, cmd, 3600), trace)))
        for fmt, ir in peers.get("ov_models", {}).items():
            cmd = [str(peers["ov_python"]), os.path.abspath(__file__), "--openvino-child", "--model", str(ir), *child,
                   "--kv-blocks", str(budget.tokens // OV_CPU_BLOCK_SIZE), "--max-num-batched-tokens",
                   str(args.max_num_batched_tokens)]
            name = f"OpenVINO GenAI {fmt}"
            offline.append(guarded(name, lambda: offline_row(run_child(name, cmd, 3600), trace)))
    return {"argv": argv, "model": str(model), "kv_budget": {"slots": budget.slots, "tokens": budget.tokens,
                                                             "mapping": budget.describe(BLOCK_SIZE, OV_CPU_BLOCK_SIZE)},
            "trace": trace.meta, "concurrency": args.concurrency, "http": http, "offline": offline}


def format_report(report: dict) -> str:
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f}"  # noqa: E731
    http, offline = measured(report["http"]), measured(report["offline"])
    head = (f"{'peer':<44}{'out tok/s':>10}{'iterserve/x':>12}{'TTFT s':>8}{'TPOT ms':>9}{'1-stream TTFT ms':>17}"
            f"{'1-stream TPOT ms':>17}{'ready s':>9}{'RSS MiB':>9}")
    out = [report["kv_budget"]["mapping"], head, "-" * len(head)]

    def rows(title: str, items: list[dict], ours: str) -> None:
        if not items:
            return
        out.append(title)
        base = next((r["output_tokens_per_s"] for r in measured(items) if r["name"].startswith(ours)), None)
        for r in items:
            if "failed" in r:
                out.append(f"  {r['name']:<42}  FAILED: {r['failed']}")
                continue
            ratio = base / r["output_tokens_per_s"] if base and not r["name"].startswith(ours) else None
            out.append(f"  {r['name']:<42}{f(r['output_tokens_per_s']):>10}{f(ratio, 2):>12}"
                       f"{f(r.get('ttft_mean_s'), 2):>8}{ms(r.get('tpot_mean_s')):>9}{ms(r.get('stream_ttft_s')):>17}"
                       f"{ms(r.get('stream_tpot_s')):>17}{f(r.get('ready_s', r.get('load_s')), 1):>9}"
                       f"{r['rss'] / MiB:>9.0f}")

    rows("through HTTP (streamed /v1/completions, token-id prompts)", report["http"], "iterserve")
    rows("offline, in process (ready s: the model load)", report["offline"], "iterserve")
    ov = [r for r in offline if r["name"].startswith("OpenVINO")]
    ours = next((r for r in offline if r["name"].startswith("iterserve")), None)
    if ov and ours:
        for r in ov:  # the same model? greedy outputs agree for a while (they drift apart with the dtypes)
            same = common_prefix(ours["first_output"], r["first_output"])
            out.append(f"  {r['name']}: greedy tokens of the first request equal to iterserve's: "
                       f"the first {same} of {len(ours['first_output'])}")
        best = max(ov, key=lambda r: r["output_tokens_per_s"])
        out.append(f"iterserve LLM / best OpenVINO GenAI ({best['name'].split()[-1]}, u8 KV): "
                   f"{ours['output_tokens_per_s'] / best['output_tokens_per_s']:.2f}x")
    out += like_for_like(http, offline)
    for r in failures(report):
        out.append(f"{r['name']} FAILED: {r['failed']}" + ("; the last lines of its log:" if r["log_tail"] else ""))
        out += [f"    | {line}" for line in r["log_tail"].splitlines()]
    return "\n".join(out)


def measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "failed" not in r]


def failures(report: dict) -> list[dict]:
    return [r for r in report["http"] + report["offline"] if "failed" in r]


def like_for_like(http: list[dict], offline: list[dict]) -> list[str]:
    """The w8a8 rows' ratios to the peers' 8-bit ones: llama-server Q8_0 (HTTP), OpenVINO int8 (offline), and the
    best OpenVINO row whatever its format."""
    def find(rows: list[dict], prefix: str, suffix: str = "", has: str = "") -> dict | None:
        return next((r for r in rows if r["name"].startswith(prefix) and r["name"].endswith(suffix)
                     and has in r["name"]), None)

    out = []
    ours, q8 = find(http, "iterserve serve", has="w8a8"), find(http, "llama-server", "Q8_0.gguf")
    if ours and q8:
        out.append(f"8-bit weights and activations: {ours['name']} / llama-server Q8_0: "
                   f"{ours['output_tokens_per_s'] / q8['output_tokens_per_s']:.2f}x")
    ours, ov = find(offline, "iterserve LLM", has="w8a8"), [r for r in offline if r["name"].startswith("OpenVINO")]
    if ours and ov:
        int8 = find(ov, "OpenVINO", "int8")
        best = max(ov, key=lambda r: r["output_tokens_per_s"])
        for row in [best] if int8 in (None, best) else [int8, best]:
            out.append(f"{ours['name']} / OpenVINO GenAI {row['name'].split()[-1]}: "
                       f"{ours['output_tokens_per_s'] / row['output_tokens_per_s']:.2f}x")
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.openvino_child:
        openvino_child(args)
        return 0
    if args.iterserve_child:
        iterserve_offline_child(args)
        return 0
    try:
        report = run(args, argv)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.setup_only:
        print(json.dumps(report, indent=2))
        return 0
    print(f"$ python benchmarks/peers.py {shlex.join(argv)}")
    print(f"{report['trace']['num_requests']} requests x prompt {args.prompt_len} -> {args.output_len} tokens, "
          f"{args.concurrency} concurrent, greedy, ignore_eos; one stream: {args.stream_requests} requests in turn")
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    if failed := failures(report):  # only now, so that one peer's failure loses none of the others' figures
        print(f"error: {len(failed)} peer(s) failed: {', '.join(r['name'] for r in failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
