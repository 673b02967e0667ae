"""The start-up cache of a GGUF model: what loading it computes, kept on disk so that a warm start
reads no GGUF at all.

A cold start parses the GGUF header (the vocabulary arrays), dequantizes every tensor with gguf's
numpy code and has transformers convert the GGUF vocabulary to a fast tokenizer. All three are
pure functions of the file, so their results are kept beside the kernels' build cache:

    <XDG_CACHE_HOME or ~/.cache>/iterserve/weights/<file stem>-<path hash>-<key>/
        tensors.json        each GGUF tensor's name, type and shape: the served format and bytes
        model.safetensors   the dequantized float32 weights (HF names; q/k/v and gate/up fused as the
                            model runs them), the ModelArch in its header; floats served only
        native.safetensors  int8/int4 served from the file's codes (gguf_quant.py): the weights the model
                            keeps as given (norms, biases; a quantized embedding as int8 rows + scales),
                            the ModelArch and every tensor's name; no linear weight, no float32 model
        panels-<dtype>.safetensors   the linear weights packed for the CPU kernel (PanelCache), per dtype
                            and layout; panels-<dtype>-w8a8 / -int8 / -int4 their int8 or int4 panels
                            (--quantization w8a8, or int8 / int4 where the kernel takes them: AVX2);
                            -int8-rows / -int4-tiles torch's int8 and int4 layouts (codes and scales)
        tokenizer/          the tokenizer as transformers' save_pretrained writes it, and beside it what
                            the serving tokenizer reads (model/tokenizer.py: no transformers import)

The floats are read back tensor by tensor as the model packs them (pread, not mmap: a mapping would
keep every page the packing read resident beside the packed copies until the last layer was packed);
where the panels are cached, the model maps them and reads only the small float weights it keeps
(norms, biases). oneDNN's packed weights are never cached: torch.ops.mkldnn._reorder_linear_weight
returns an opaque MKLDNN tensor (no storage, no data pointer) that neither torch.save nor safetensors
can write. So the key holds what decides the float bytes and the tokenizer: the file's size, mtime
and a hash of its first and last MiB (hashing all of a multi-GiB file would cost what the cache
saves), this format's version and the gguf / transformers / tokenizers versions. The CPU's flags do
not change them, nor the panels (PanelCache).

ITERSERVE_WEIGHT_CACHE=0 turns the cache off; ITERSERVE_WEIGHT_CACHE=DIR keeps it in DIR. An entry
that cannot be read is rebuilt with a warning; one that cannot be written leaves the start uncached.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from iterserve.heap import trim_heap
from iterserve.model import gguf_file, gguf_quant, loader
from iterserve.model.cache_entry import _NATIVE, _TABLE, _WEIGHTS, FORMAT, _cacheable, entry_dir
from iterserve.model.llama import FUSED_GATE_UP, FUSED_QKV
from iterserve.model.loader import ModelArch
from iterserve.model.panel_cache import panel_cache  # noqa: F401 - model_runner.py calls it from here
from iterserve.model.quant import Int8Codes
from iterserve.model.tokenizer_cache import load_tokenizer  # noqa: F401 - model_runner.py and others call it from here

logger = logging.getLogger("iterserve.model")

# the weights the model packs or quantizes into its own copies; it keeps every other one as given
_PACKED_SUFFIXES = ("_proj.weight", "lm_head.weight")


# ---------------------------------------------------------------- weights and arch

def load_arch_and_weights(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                          quantization: str | None = None) -> tuple[ModelArch, Mapping]:
    """loader.load_model_arch + loader.load_weights, through the cache where the file is cached; served in
    int8/int4 from a quantized GGUF (serves_codes), the file's codes instead of floats (native_weights).

    A cold start writes the entry and then reads it back like a warm one, so the first run serves
    exactly what every later run serves."""
    if serves_codes(path, quantization):
        return native_weights(path, dtype)
    entry = entry_dir(path)
    if entry is None:
        arch = loader.load_model_arch(path)
        return arch, _own_kept(loader.load_weights(path, arch, dtype, device))
    arch, weights = _through_entry(path, entry)
    if isinstance(weights, dict):  # the entry could not be written: the loader's own copies
        return arch, _own_kept({k: v.to(device=device, dtype=dtype) for k, v in weights.items()})
    return arch, LazyWeights(weights, dtype, torch.device(device))


def load_arch(path: str) -> ModelArch:
    """loader.load_model_arch through the cache: a warm entry's metadata (of its floats or its native weights),
    without parsing the model file (for the GGUF, a few seconds of the gguf reader); the file's own where it is
    not cached yet."""
    entry = entry_dir(path)
    for file in (entry / _WEIGHTS, entry / _NATIVE) if entry is not None else ():
        cached = _read_weights(file, entry.name) if file.exists() else None
        if cached is not None:
            return cached[0]
    return loader.load_model_arch(path)


def _through_entry(path: str, entry: Path):
    """The entry's arch and open file, the entry written first on a miss; the loader's in-memory
    weights (a dict) where it cannot be written."""
    file = entry / _WEIGHTS
    cached = _read_weights(file, entry.name) if file.exists() else None
    if cached is not None:
        logger.info("weight cache: %s read from %s", os.path.basename(path), file)
        return cached
    arch = loader.load_model_arch(path)
    weights = loader.load_weights(path, arch)
    if not _write_weights(file, entry.name, arch, weights):
        return arch, weights
    logger.info("weight cache: %s dequantized into %s", os.path.basename(path), file)
    _prune_siblings(entry)
    del weights  # read back as every later start will
    cached = _read_weights(file, entry.name)
    return cached if cached is not None else (arch, loader.load_weights(path, arch))


def _read_weights(file: Path, key: str):
    """The entry's arch and open file (safetensors checks that its header covers the file); None (with a
    warning, the file removed) if it is not a good one."""
    from safetensors import safe_open
    try:
        f = safe_open(str(file), framework="pt", backend="pread")
        meta = f.metadata() or {}
        if meta.get("key") != key:
            raise ValueError(f"written for key {meta.get('key')!r}, not {key!r}")
        arch = ModelArch(**json.loads(meta["arch"]))
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, it is rebuilt, never fatal
        logger.warning("weight cache: %s is unreadable (%s); rebuilding it", file, exc)
        file.unlink(missing_ok=True)
        return None
    return arch, f


class LazyWeights(Mapping):
    """An entry's tensors by name, each read (pread: the file is never mapped) when the model asks for it,
    in the model's dtype and device. What the model packs is not held here, so a weight's float copy lives
    only until its layer is packed and the load's peak stays near the packed size; what the model keeps
    as given (embedding, norms) is read once."""

    def __init__(self, handle, dtype: torch.dtype, device: torch.device) -> None:
        self._file, self._dtype, self._device = handle, dtype, device
        self._names = set(handle.keys())
        self._kept: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._kept:
            return self._kept[name]
        if name not in self._names:
            raise KeyError(name)
        t = self._file.get_tensor(name).to(device=self._device, dtype=self._dtype)
        if not name.endswith(_PACKED_SUFFIXES):
            self._kept[name] = t
        return t

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def __len__(self) -> int:
        return len(self._names)


# ---------------------------------------------------------------- a quantized GGUF served as it is

def tensor_table(path: str) -> list[tuple[str, str, list[int]]]:
    """loader.gguf_tensor_table through the entry (tensors.json), so a warm start decides the format and the
    bytes without parsing the GGUF."""
    entry = entry_dir(path)
    file = entry / _TABLE if entry is not None else None
    if file is not None and file.exists():
        try:
            return [tuple(t) for t in json.loads(file.read_text())]
        except (OSError, ValueError) as exc:
            logger.warning("weight cache: %s is unreadable (%s); rebuilding it", file, exc)
    table = loader.gguf_tensor_table(path)
    if file is not None:
        tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(table))
            os.replace(tmp, file)
        except OSError as exc:
            logger.warning("weight cache: cannot write %s (%s)", file, exc)
    return table


def resolve_quantization(path: str | None, quantization: str | None, dtype: str) -> str | None:
    """--quantization as the model serves it: "none" is None; "auto" is what a quantized GGUF's linear weights
    hold (gguf_quant.file_format: int4 for Q4_*, int8 for Q8_0 and other K-quants) when --dtype is auto too,
    and floats otherwise: for an explicit --dtype, a float file, weights given in memory (path None), and the
    shipped default model (loader.DEFAULT_GGUF: the test suite's and the headline benchmark's bf16 reference).
    docs/models.md states the rule."""
    if quantization != "auto":
        return None if quantization == "none" else quantization
    if path is None or dtype != "auto" or not _cacheable(path) or os.path.basename(path) == loader.DEFAULT_GGUF:
        return None
    return gguf_quant.file_format(tensor_table(path))


def serves_codes(path: str, quantization: str | None) -> bool:
    """Whether int8/int4 come from the file's own codes, tensor by tensor (a quantized GGUF whose linears are
    one matrix each), rather than from float weights."""
    if quantization not in ("int8", "int4") or not _cacheable(path):
        return False
    table = tensor_table(path)
    return gguf_quant.file_format(table) is not None and loader.gguf_serves_codes(table, load_arch(path).architecture)


def served_bytes(path: str, quantization: str | None, dtype: torch.dtype) -> int | None:
    """The weights' bytes as served (gguf_quant.served_bytes), from the header; None for a Hugging Face directory."""
    if not _cacheable(path):
        return None
    table = tensor_table(path)
    tied = not any(name == "output.weight" for name, _, _ in table)
    return gguf_quant.served_bytes(table, quantization, dtype, tied)


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(path: str, quantization: str | None, dtype: torch.dtype, kv_bytes: int) -> None:
    """Refuse, before anything is read, a model whose served weights and KV pools cannot fit in memory. A cold
    start from floats (not serves_codes) holds every GGUF tensor in float32 before it writes the entry: that
    is its need."""
    weights, available = served_bytes(path, quantization, dtype), available_memory()
    held = f"{quantization or str(dtype).removeprefix('torch.')} weights"
    if weights is not None and not serves_codes(path, quantization) and not _warm_floats(path):
        weights, held = max(weights, served_bytes(path, None, torch.float32)), "weights in float32 as they load"
    if weights is None or available is None or weights + kv_bytes <= available:
        return
    gib = 1 << 30
    raise ValueError(f"{os.path.basename(path)} cannot fit: it needs {(weights + kv_bytes) / gib:.1f} GiB "
                     f"({weights / gib:.1f} GiB of {held} + {kv_bytes / gib:.1f} GiB of KV cache) but "
                     f"{available / gib:.1f} GiB is available (MemAvailable); try a smaller --quantization, "
                     "--kv-cache-memory or model")


def _warm_floats(path: str) -> bool:
    entry = entry_dir(path)
    return entry is not None and (entry / _WEIGHTS).exists()


def native_weights(path: str, dtype: torch.dtype) -> tuple[ModelArch, Mapping]:
    """The arch and weights of a quantized GGUF served from its codes: the kept weights from the entry's
    native.safetensors (written on a miss), each linear weight from the GGUF (loader.GGUFCodes) only when the
    panel cache lacks it."""
    entry = entry_dir(path)
    if entry is None:
        arch = loader.load_model_arch(path)
        return arch, loader.GGUFCodes(path, arch, dtype)
    file = entry / _NATIVE
    cached = _read_weights(file, entry.name) if file.exists() else None
    if cached is None:
        arch = loader.load_model_arch(path)
        codes = loader.GGUFCodes(path, arch, dtype)
        kept = {n: codes[n] for n in codes if not n.endswith(_PACKED_SUFFIXES)}
        if not _write_native(file, entry.name, arch, kept, list(codes)):
            return arch, codes
        logger.info("weight cache: %s's kept weights written to %s", os.path.basename(path), file)
        _prune_siblings(entry)
        del kept
        cached = _read_weights(file, entry.name)
        if cached is None:
            return arch, codes
    arch, handle = cached
    return arch, NativeWeights(handle, dtype, lambda: loader.GGUFCodes(path, arch, dtype))


def _write_native(file: Path, key: str, arch: ModelArch, kept: dict, names: list[str]) -> bool:
    """kept's floats in float32 and its codes as int8 rows + "<name>.scale", written whole or not at all."""
    tensors = {}
    for name, w in kept.items():
        if isinstance(w, torch.Tensor):
            tensors[name] = _owned(w.float())
        else:  # an embedding table: int8 rows, dequantized on lookup (an int4 one re-coded: no int4 lookup)
            w = w if isinstance(w, Int8Codes) else w.to_int8()
            tensors[name], tensors[name + ".scale"] = w.q.contiguous(), w.scale.float().contiguous()
    return _save_entry(file, key, arch, tensors, names=json.dumps(names))


class NativeWeights(LazyWeights):
    """native.safetensors' kept weights (an int8 table as quant.Int8Codes), and every other tensor of the GGUF
    by name, read from the file (open_codes(): a loader.GGUFCodes, made on first use, which parses the GGUF
    header) only when the model asks for one: a warm start with its panel cache never does."""

    def __init__(self, handle, dtype: torch.dtype, open_codes) -> None:
        super().__init__(handle, dtype, torch.device("cpu"))
        stored = self._names
        self._names = set(json.loads(handle.metadata()["names"]))
        self._stored, self._open, self._codes = stored, open_codes, None

    def __getitem__(self, name: str):
        if name in self._kept:
            return self._kept[name]
        if name + ".scale" in self._stored:
            self._kept[name] = Int8Codes(self._file.get_tensor(name), self._file.get_tensor(name + ".scale"))
            return self._kept[name]
        if name in self._stored or name not in self._names:
            return super().__getitem__(name)
        self._codes = self._codes or self._open()
        return self._codes[name]


def _write_weights(file: Path, key: str, arch: ModelArch, weights: dict[str, torch.Tensor]) -> bool:
    return _save_entry(file, key, arch, {k: _owned(v) for k, v in fuse(weights).items()})


def _save_entry(file: Path, key: str, arch: ModelArch, tensors: dict[str, torch.Tensor], **meta: str) -> bool:
    """Written whole or not at all: a temporary file renamed into place."""
    from safetensors.torch import save_file
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    meta |= {"key": key, "format": str(FORMAT),
             "arch": json.dumps(dataclasses.asdict(arch), default=lambda o: o.item())}  # numpy scalars from GGUF
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, file)
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is no reason to fail
        logger.warning("weight cache: cannot write %s (%s); this start is not cached", file, exc)
        tmp.unlink(missing_ok=True)
        return False
    return True


def fuse(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q/k/v and gate/up as the single weights the model runs them as (llama.py FUSED_*): a warm start
    then skips concatenating them, the larger part of building the model from cached floats."""
    out = dict(weights)
    for fused, parts in (FUSED_QKV, FUSED_GATE_UP):
        for name in [k for k in weights if k.endswith("." + parts[0])]:
            prefix = name[: -len(parts[0])]
            if all(prefix + p in out for p in parts):
                out[prefix + fused] = torch.cat([out.pop(prefix + p) for p in parts])
    return out


def _owned(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous tensor of its own storage (a split fused weight shares its parent's; safetensors
    refuses to write shared storage)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _own_kept(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the model keeps as given (embedding, norms, biases, router) copied out of a mapped
    file (a Hugging Face directory's safetensors): each mapped tensor holds the whole mapping, so one
    kept view would keep every page the packing read resident for the process's life. (Copied also
    where they were not mapped: at most the embedding's size, once.)"""
    return {k: v if k.endswith(_PACKED_SUFFIXES) else v.clone() for k, v in weights.items()}


def _prune_siblings(entry: Path) -> None:
    """Older entries of the same model path (the file changed): one entry per path stays on disk."""
    prefix = entry.name[:-16]
    for old in entry.parent.iterdir():
        if old.name.startswith(prefix) and old != entry and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- after loading

def release_load_buffers() -> None:
    """Hand back what loading left behind once the model holds its packed weights: the GGUF reader
    (its mapping and the parsed vocabulary), cycles, and the heap pages the freed float weights held
    (glibc keeps freed chunks below the heap's top mapped until malloc_trim)."""
    gguf_file.forget_gguf_files()
    gc.collect()
    trim_heap()
