"""The benchmark model set (issue 41): random-weight checkpoints of real Llama shapes, made here since no hub
can be reached, each written once into --cache-dir/<shape>/ as a Hugging Face directory and as GGUF files
made from it by llama.cpp's own tools (BF16 by convert_hf_to_gguf.py, Q8_0 and Q4_K_M by llama-quantize).
Cost depends on shapes, not on what the weights learned, so the tokenizer is the default model's (49,152
tokens, fewer than the vocabularies here: the ids above it are never asked for).

    nice -n 19 ionice -c3 python benchmarks/model_shapes.py                          # 1b, every format
    nice -n 19 ionice -c3 python benchmarks/model_shapes.py --shapes 8b --formats q4_k_m --drop-intermediates

Other scripts find the files with `paths(shape)`. A file that exists is kept; one being written has a
.tmp name until it is whole, so an interrupted run redoes only that step. llama.cpp comes from
benchmarks/peers.py's build in --peers-dir (built there if missing).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # peers.py beside this file, also when a test loads it
from peers import build_llama_cpp, run_logged  # noqa: E402

GB = 1e9
DEFAULT_CACHE = Path("~/.cache/iterserve-models").expanduser()
FORMATS = ("hf", "bf16", "q8_0", "q4_k_m")
QUANT_TYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}  # llama-quantize's names, made from the BF16 GGUF
SEED, STD = 0, 0.02  # small weights keep activations finite through every layer
CHUNK = 1 << 24  # elements generated at a time: peak RSS stays ~100 MB whatever the model's size
IONICE = ["ionice", "-c3"]  # run_logged adds nice


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 128256
    tied: bool = True
    rope_factor: float = 32.0  # llama3 rope scaling: 32 in Llama 3.2, 8 in Llama 3.1


SHAPES = {
    "tiny": Shape(64, 2, 4, 2, 128, vocab=49152),  # for tests: the tokenizer's vocabulary, a few MB
    "1b": Shape(2048, 16, 32, 8, 8192),  # Llama-3.2-1B
    "3b": Shape(3072, 28, 24, 8, 8192),  # Llama-3.2-3B
    "8b": Shape(4096, 32, 32, 8, 14336, tied=False, rope_factor=8.0),  # Llama-3.1-8B
}


@dataclass(frozen=True, slots=True)
class ModelPaths:
    hf: Path
    bf16: Path
    q8_0: Path
    q4_k_m: Path

    def of(self, fmt: str) -> Path:
        return getattr(self, fmt)


def paths(shape: str, cache_dir: Path | str | None = None) -> ModelPaths:
    """Where a shape's files are (made or not): <cache>/<shape>/hf and <cache>/<shape>/<shape>.<TYPE>.gguf."""
    root = Path(cache_dir or DEFAULT_CACHE).expanduser() / shape
    return ModelPaths(root / "hf", *(root / f"{shape}.{t}.gguf" for t in ("BF16", "Q8_0", "Q4_K_M")))


# ---------------------------------------------------------------- the Hugging Face directory

def hf_config(s: Shape, bos: int, eos: int) -> dict:
    """config.json as Meta's Llama 3 checkpoints have it, with the tokenizer's own BOS / EOS ids."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
            "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.hidden // s.heads, "intermediate_size": s.intermediate, "vocab_size": s.vocab,
            "tie_word_embeddings": s.tied, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": s.rope_factor,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192},
            "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16"}


def tensor_shapes(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight of a Llama checkpoint in its file order, with its shape."""
    head_dim, kv = s.hidden // s.heads, s.kv_heads * (s.hidden // s.heads)
    out = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (s.hidden,)),
                (p + "self_attn.q_proj.weight", (s.heads * head_dim, s.hidden)),
                (p + "self_attn.k_proj.weight", (kv, s.hidden)), (p + "self_attn.v_proj.weight", (kv, s.hidden)),
                (p + "self_attn.o_proj.weight", (s.hidden, s.heads * head_dim)),
                (p + "post_attention_layernorm.weight", (s.hidden,)),
                (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
                (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
                (p + "mlp.down_proj.weight", (s.hidden, s.intermediate))]
    out.append(("model.norm.weight", (s.hidden,)))
    return out if s.tied else out + [("lm_head.weight", (s.vocab, s.hidden))]


def random_bf16(name: str, numel: int, gen) -> Iterator[bytes]:
    """A tensor's bytes in chunks: norms are ones (as trained models start), the rest N(0, STD)."""
    import torch
    for start in range(0, numel, CHUNK):
        n = min(CHUNK, numel - start)
        x = torch.ones(n) if name.endswith("norm.weight") else torch.empty(n).normal_(0.0, STD, generator=gen)
        yield x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]]) -> None:
    """A bf16 safetensors file written tensor by tensor, chunk by chunk (the header first: it only needs
    the shapes), so that no tensor is ever whole in memory. Seeded: the same shape gives the same bytes."""
    import torch
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    gen = torch.Generator().manual_seed(SEED)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in tensors:
            for chunk in random_bf16(name, math.prod(shape), gen):
                f.write(chunk)


def write_hf(shape: str, out: Path) -> None:
    """config.json, the default model's tokenizer files (transformers builds them from its GGUF) and
    random weights."""
    from transformers import AutoTokenizer

    from iterserve.model.loader import default_model_path
    gguf = Path(default_model_path())
    out.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(out)
    config = hf_config(SHAPES[shape], tok.bos_token_id, tok.eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(out / "model.safetensors", tensor_shapes(SHAPES[shape]))


# ---------------------------------------------------------------- the GGUF files and the steps

def write_bf16_gguf(hf: Path, out: Path, llama_src: Path, log: Path) -> None:
    """llama.cpp's converter, by this python (it has torch, gguf, numpy, sentencepiece and transformers)."""
    run_logged(IONICE + [sys.executable, str(llama_src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                         "--outfile", str(out)], log)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def size_of(path: Path) -> float:
    files = path.rglob("*") if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files if f.is_file()) / GB


@contextmanager
def step(what: str, out: Path) -> Iterator[Path]:
    """One file made: under a .tmp name until whole, then timed and sized."""
    tmp = out.with_name(out.name + ".tmp")
    remove(tmp)  # what an interrupted run left
    print(f"{what} -> {out}", flush=True)
    start = time.perf_counter()
    yield tmp
    tmp.rename(out)
    print(f"  done in {time.perf_counter() - start:.1f} s: {size_of(out):.2f} GB", flush=True)


def make(shape: str, fmt: str, p: ModelPaths, llama: tuple[Path, Path] | None) -> Path:
    """One format of a shape unless it is there, and first what it is made from (hf <- bf16 <- q8_0, q4_k_m)."""
    out = p.of(fmt)
    if out.exists():
        return out
    if fmt == "hf":
        with step(f"{shape} {fmt}: random bf16 weights, seed {SEED}, std {STD}", out) as tmp:
            write_hf(shape, tmp)
        return out
    assert llama is not None, "the GGUF formats need llama.cpp"
    src, quantize = llama
    log = out.parent / "llama.log"
    if fmt == "bf16":
        hf = make(shape, "hf", p, llama)
        with step(f"{shape} {fmt}: convert_hf_to_gguf.py (log: {log})", out) as tmp:
            write_bf16_gguf(hf, tmp, src, log)
        return out
    bf16 = make(shape, "bf16", p, llama)
    with step(f"{shape} {fmt}: llama-quantize {QUANT_TYPES[fmt]} (log: {log})", out) as tmp:
        run_logged(IONICE + [str(quantize), str(bf16), str(tmp), QUANT_TYPES[fmt]], log)
    return out


def drop_intermediates(shape: str, formats: list[str], p: ModelPaths) -> None:
    """The HF directory and the BF16 GGUF, when only quantized files were asked for (an 8B shape's are
    16 GB each): said, as a later run makes them again."""
    for fmt in set(FORMATS) - set(formats) - set(QUANT_TYPES):
        path = p.of(fmt)
        if path.exists():
            print(f"{shape} {fmt}: deleting {path} ({size_of(path):.2f} GB), not asked for", flush=True)
            remove(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of " + ", ".join(FORMATS))
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    p.add_argument("--peers-dir", default=os.path.expanduser("~/.cache/iterserve-peers"),
                   help="where benchmarks/peers.py builds llama.cpp")
    p.add_argument("--drop-intermediates", action="store_true",
                   help="delete the HF directory and BF16 GGUF made on the way to a quantized one, if not asked for")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes, formats = args.shapes.split(","), args.formats.split(",")
    for given, known, what in ((shapes, SHAPES, "--shapes"), (formats, FORMATS, "--formats")):
        if unknown := set(given) - set(known):
            print(f"error: unknown {what} {', '.join(sorted(unknown))}: use {', '.join(known)}", file=sys.stderr)
            return 1
    llama = None
    if set(formats) - {"hf"}:
        server, quantize = build_llama_cpp(Path(args.peers_dir))
        llama = (server.parents[2], quantize)  # <src>/build/bin/llama-server
    for shape in shapes:
        p = paths(shape, args.cache_dir)
        p.hf.parent.mkdir(parents=True, exist_ok=True)
        for fmt in formats:
            if p.of(fmt).exists():
                print(f"{shape} {fmt}: {p.of(fmt)} is there ({size_of(p.of(fmt)):.2f} GB)", flush=True)
            make(shape, fmt, p, llama)
        if args.drop_intermediates:
            drop_intermediates(shape, formats, p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
