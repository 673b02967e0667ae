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

import ctypes
import dataclasses
import functools
import gc
import hashlib
import json
import logging
import math
import mmap
import os
import shutil
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path

import torch

from iterserve.heap import advise_huge_pages, trim_heap
from iterserve.model import cpu_kernels, cpu_packing, gguf_quant, loader, tokenizer
from iterserve.model.cpu_build import cache_dir
from iterserve.model.llama import FUSED_GATE_UP, FUSED_QKV
from iterserve.model.loader import ModelArch
from iterserve.model.quant import Int8Codes, Weight, from_stored, panel_layout, stored_tensors, weight_only_on_panels

logger = logging.getLogger("iterserve.model")

FORMAT = 5  # bump when what an entry holds changes (2: q/k/v and gate/up fused; 3, 4: int8, int4 panels in
# pairs; 5: int8/int4 from a quantized GGUF's codes, native.safetensors, torch's int8/int4 layouts)
_EDGE = 1 << 20  # bytes hashed at each end of the model file
_WEIGHTS, _NATIVE, _TABLE, _TOKENIZER = "model.safetensors", "native.safetensors", "tensors.json", "tokenizer"
# the weights the model packs or quantizes into its own copies; it keeps every other one as given
_PACKED_SUFFIXES = ("_proj.weight", "lm_head.weight")


def cache_root() -> Path | None:
    """Where entries live, or None when the cache is off or cannot be made."""
    value = os.environ.get("ITERSERVE_WEIGHT_CACHE", "")
    if value == "0":
        return None
    root = Path(value) if value else cache_dir() / "weights"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.warning("weight cache off: cannot make %s (%s)", root, exc)
        return None
    return root


def file_key(path: str) -> str:
    """What the cached bytes depend on: the file (cheaply: size, mtime, both ends) and the code that reads it."""
    st = os.stat(path)
    versions = [_version(p) for p in ("gguf", "transformers", "tokenizers")]
    h = hashlib.sha256(repr((FORMAT, st.st_size, st.st_mtime_ns, versions)).encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        f.seek(max(0, st.st_size - _EDGE))
        h.update(f.read(_EDGE))
    return h.hexdigest()[:16]


@functools.cache
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def entry_dir(path: str) -> Path | None:
    """This model file's entry (made on first use), or None when the file is not cached."""
    root = cache_root()
    if root is None or not _cacheable(path):
        return None
    entry = root / f"{_entry_prefix(path)}{file_key(path)}"
    try:
        entry.mkdir(exist_ok=True)
    except OSError as exc:
        logger.warning("weight cache off for %s: %s", path, exc)
        return None
    return entry


def _cacheable(path: str) -> bool:
    """GGUF files only: a Hugging Face directory's safetensors are read with mmap as they are."""
    return os.path.isfile(path) and path.endswith(".gguf")


def _entry_prefix(path: str) -> str:
    where = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:8]
    return f"{Path(path).stem}-{where}-"


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


# ---------------------------------------------------------------- packed panels

class PanelCache:
    """The model's weights as the CPU linear kernel reads them (cpu_packing.pack_panels), for one dtype,
    kept in the entry as panels-<dtype>.safetensors and mapped, not read, by a warm start: the model then
    neither reads the float weights it packs nor packs them, and its panels are the OS page cache's pages
    (read ahead into 2 MiB folios where the file system has them, so as fast to stream as the huge-page
    arena: docs/performance.md) rather than fresh memory, whose every 2 MiB first touch waits for the
    hypervisor in a virtual machine. A miss packs as before and writes the file for the next start.

    The panels are a pure function of the entry's floats, the dtype, PANEL and the layout: not of the
    CPU, beyond the layout pack_float gives it (panel_layout), which is in the file's name and key."""

    def __init__(self, file: Path, key: str) -> None:
        self.file, self.key = file, key
        self.mapped = _map_panels(file, key) if file.exists() else {}
        self.built: dict[str, Weight] = {}

    def weight(self, name: str, build) -> Weight:
        """The cached panels of `name`, or build() (recorded for save() where it gives panels)."""
        if name in self.mapped:
            return self.mapped[name]
        weight = build()
        if stored_tensors(weight) is not None:
            self.built[name] = weight
        return weight

    def save(self) -> None:
        """After a miss, write every weight packed for the next start: a temporary file renamed into place,
        flushed and dropped from the page cache (written, it sits there in small folios; read back through a
        huge-page mapping it comes in 2 MiB ones). A file that cannot be written leaves the next start
        packing again."""
        if not self.built or self.mapped:
            return
        tmp = self.file.with_name(f"{self.file.name}.{os.getpid()}.tmp")
        stored = {n: stored_tensors(w) for n, w in self.built.items()}
        meta = {"key": self.key, "out_features": json.dumps({n: w.shape[0] for n, w in self.built.items()}),
                "in_features": json.dumps({n: w.shape[1] for n, w in self.built.items()}),
                "kinds": json.dumps({n: kind for n, (kind, _) in stored.items()})}
        # a weight's first tensor under its name, any further one as "<name>:<i>"
        tensors = {n if i == 0 else f"{n}:{i}": t.contiguous() for n, (_, ts) in stored.items()
                   for i, t in enumerate(ts)}
        try:
            save_aligned(tensors, tmp, meta)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.replace(tmp, self.file)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is no reason to fail
            logger.warning("weight cache: cannot write %s (%s)", self.file, exc)
            tmp.unlink(missing_ok=True)
            return
        logger.info("weight cache: packed weights written to %s", self.file)


_ALIGN = 64  # torch's int8 and int4 CPU kernels fault on weights not 16-byte aligned (safetensors aligns to 8)


def save_aligned(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str]) -> None:
    """safetensors' format with every tensor's data _ALIGN-aligned in the file, so in a page-aligned mapping:
    "__pad<i>" uint8 tensors fill the gaps (the format allows no holes) and the header is padded with spaces."""
    header, offset, order = {"__metadata__": metadata}, 0, []
    for i, (name, t) in enumerate(tensors.items()):
        gap = -offset % _ALIGN
        if gap:
            header[f"__pad{i}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            order.append(torch.zeros(gap, dtype=torch.uint8))
            offset += gap
        header[name] = {"dtype": _SAFETENSORS_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        order.append(t)
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()  # compact, as safetensors writes it
    text += b" " * (-(8 + len(text)) % _ALIGN)
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for t in order:
            f.write(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)


def panel_cache(path: str, dtype: torch.dtype, device: torch.device, mixed: bool = False,
                quantization: str | None = None) -> PanelCache | None:
    """The model file's panel cache for weights of `dtype` (mixed: under float32 arithmetic, which takes
    the plain layout whatever the CPU), or for w8a8's int8 panels or weight-only int8/int4's (quantization
    "w8a8", "int8" or "int4", from weights of `dtype`); None where the file is not cached or this CPU's
    kernel takes no panels of that kind."""
    layout = None
    if device.type == "cpu" and quantization == "w8a8":
        layout = "w8a8" if cpu_kernels.linear_int8_supported() else None
    elif device.type == "cpu" and quantization in ("int8", "int4"):  # the panels, or torch's layouts (stored_tensors)
        layout = quantization if weight_only_on_panels(quantization) else \
            {"int8": "int8-rows", "int4": "int4-tiles"}[quantization]
    elif device.type == "cpu" and quantization is None:
        layout = "plain" if mixed and cpu_kernels.linear_kernel() is not None else panel_layout(dtype)
    entry = entry_dir(path) if layout is not None else None
    if entry is None:
        return None
    name = str(dtype).removeprefix("torch.") + (f"-{layout}" if layout not in ("plain", None) else "")
    group = {"w8a8": f"-{cpu_packing.INT8_GROUP}", "int4": f"-{cpu_packing.INT4_GROUP}",
             "int4-tiles": f"-{cpu_packing.INT4_GROUP}"}.get(layout, "")
    return PanelCache(entry / f"panels-{name}.safetensors", f"{entry.name}-{name}-{cpu_packing.PANEL}{group}")


def _map_panels(file: Path, key: str) -> dict[str, Weight]:
    """The file's panels by name, as views of a private mapping of it; empty (with a warning, the file
    removed) if it is not a good one. Mapped here rather than by safetensors, whose reader touches each
    tensor's first page as it hands it out: the mapping is advised for huge pages before any page is read,
    so that the reads come in 2 MiB folios. The format is safetensors' own (save_file wrote it): an 8-byte
    little-endian header length, a JSON header of dtype, shape and data_offsets, then the data."""
    try:
        with open(file, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)  # copy-on-write: never written
        advise_huge_pages(ctypes.addressof(ctypes.c_char.from_buffer(mapping)), len(mapping))
        length = int.from_bytes(mapping[:8], "little")
        header = json.loads(mapping[8:8 + length])
        meta = header.pop("__metadata__", {})
        if meta.get("key") != key:
            raise ValueError(f"written for key {meta.get('key')!r}, not {key!r}")
        out_features = json.loads(meta["out_features"])
        in_features = json.loads(meta.get("in_features", "{}"))  # older files: float panels, whose K is their own
        kinds = json.loads(meta.get("kinds", "{}"))  # older files: "panels" only
        panels = {}
        for name, info in header.items():
            if name.startswith("__pad"):  # save_aligned's filler
                continue
            dtype, shape = _SAFETENSORS_DTYPES[info["dtype"]], info["shape"]
            begin, end = (8 + length + o for o in info["data_offsets"])
            kind = kinds.get(name.split(":")[0], "panels")
            rank_ok = kind in ("int8-rows", "int4-tiles") or (len(shape) == 1 if kind != "panels" else
                                                             len(shape) == 2 if dtype == torch.int8 else len(shape) in (3, 4))
            if not rank_ok or end > len(mapping) or end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{name}: shape {shape} and offsets {info['data_offsets']} disagree")
            panels[name] = torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape), offset=begin).view(shape)
        if {n.split(":")[0] for n in panels} != set(out_features):
            raise ValueError("its panels and their out_features disagree")
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, it is rebuilt, never fatal
        logger.warning("weight cache: %s is unreadable (%s); rebuilding it", file, exc)
        file.unlink(missing_ok=True)
        return {}
    logger.info("weight cache: packed weights mapped from %s", file)
    out = {}
    for name, p in panels.items():
        if ":" in name:
            continue
        parts = [p] + [panels[f"{name}:{i}"] for i in range(1, 1 + sum(n.startswith(name + ":") for n in panels))]
        shape = torch.Size((out_features[name], in_features.get(name) or cpu_packing.panel_in_features(p)))
        out[name] = from_stored(kinds.get(name, "panels"), parts, shape)
    return out


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8,
                      "U8": torch.uint8}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


# ---------------------------------------------------------------- tokenizer

def load_tokenizer(path: str):
    """loader.load_tokenizer through the cache: transformers' GGUF vocabulary conversion runs once per
    file, and a warm start reads the entry without importing transformers (model/tokenizer.py)."""
    entry = entry_dir(path)
    if entry is None:
        return loader.load_tokenizer(path)
    saved = entry / _TOKENIZER
    if (saved / tokenizer.META).is_file():
        light = _read_serving_tokenizer(saved)
        if light is not None:
            return light
    if saved.is_dir():
        tok = _read_tokenizer(saved)
        if tok is not None:
            _describe(tok, saved)  # an entry from before the serving tokenizer: serve it lightly next time
            return tok
    tok = loader.load_tokenizer(path)
    if not _write_tokenizer(tok, saved):
        return tok
    reread = _read_tokenizer(saved)
    if reread is None:
        return tok
    _describe(reread, saved)
    return _read_serving_tokenizer(saved) or reread


def _read_serving_tokenizer(saved: Path):
    try:
        return tokenizer.ServingTokenizer.from_dir(saved)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception; a broken entry is rebuilt
        logger.warning("weight cache: the tokenizer in %s is unreadable (%s); rebuilding it", saved, exc)
        shutil.rmtree(saved, ignore_errors=True)
        return None


def _describe(tok, saved: Path) -> None:
    """Write what the serving tokenizer needs beside transformers' files, only if it then answers as
    transformers does (tokenizer.same_as); otherwise this entry keeps loading through transformers."""
    meta = tokenizer.describe(tok)
    light = tokenizer.ServingTokenizer(tokenizer.Backend.from_str(tok.backend_tokenizer.to_str()), meta)
    differs = tokenizer.same_as(light, tok)
    if differs is not None:
        logger.warning("weight cache: %s loads through transformers (the light tokenizer differs in %s)",
                       saved, differs)
        return
    tmp = saved / f"{os.getpid()}.tmp"
    try:  # the backend as transformers holds it after loading, then the facts: their presence marks the entry done
        tok.backend_tokenizer.save(str(tmp))
        os.rename(tmp, saved / tokenizer.BACKEND)
        tmp.write_text(json.dumps(meta))
        os.rename(tmp, saved / tokenizer.META)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.warning("weight cache: cannot write %s (%s)", saved / tokenizer.META, exc)


def _read_tokenizer(saved: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(saved))
    except Exception as exc:  # noqa: BLE001 - a broken entry is rebuilt, never fatal
        logger.warning("weight cache: the tokenizer in %s is unreadable (%s); rebuilding it", saved, exc)
        shutil.rmtree(saved, ignore_errors=True)
        return None


def _write_tokenizer(tok, saved: Path) -> bool:
    tmp = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
    try:
        tok.save_pretrained(str(tmp))
        os.rename(tmp, saved)  # atomic; fails if a concurrent start got there first, whose copy is as good
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if saved.is_dir():
            return True
        logger.warning("weight cache: cannot write %s (%s); this start is not cached", saved, exc)
        return False
    return True


# ---------------------------------------------------------------- after loading

def release_load_buffers() -> None:
    """Hand back what loading left behind once the model holds its packed weights: the GGUF reader
    (its mapping and the parsed vocabulary), cycles, and the heap pages the freed float weights held
    (glibc keeps freed chunks below the heap's top mapped until malloc_trim)."""
    loader.forget_gguf_files()
    gc.collect()
    trim_heap()
