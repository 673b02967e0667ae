"""The packed-panels file of a weight-cache entry (weight_cache.py's top): the linear weights as the CPU
kernel reads them, written after a cold start's packing and mapped by a warm one."""
from __future__ import annotations

import ctypes
import json
import logging
import math
import mmap
import os
from pathlib import Path

import torch

from iterserve.heap import advise_huge_pages
from iterserve.model import cpu_kernels, cpu_packing
from iterserve.model.cache_entry import entry_dir
from iterserve.model.quant import (Weight, from_stored, panel_layout, stored_tensors, weight_only_bf16,
                                   weight_only_on_panels)

logger = logging.getLogger("iterserve.model")


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
        layout = quantization if weight_only_on_panels(quantization) or weight_only_bf16(dtype) else \
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
