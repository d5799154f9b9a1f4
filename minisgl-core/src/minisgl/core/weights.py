"""Reading HF safetensors checkpoints lazily, slice by slice (the basis of per-rank TP loading)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open


class LazySlice(Protocol):
    """What safetensors' ``get_slice`` returns: a shape and indexing that reads only that part."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, idx: Any) -> torch.Tensor: ...


WeightSource = torch.Tensor | LazySlice


def shape_of(src: WeightSource) -> list[int]:
    return list(src.shape) if isinstance(src, torch.Tensor) else src.get_shape()


def read(src: WeightSource, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
    """The whole tensor, or ``size`` rows/cols from ``start`` along ``dim`` (only those are read)."""
    if dim is None:
        return src[...] if not isinstance(src, torch.Tensor) else src
    shape = shape_of(src)
    size = shape[dim] - start if size is None else size
    idx: list[Any] = [slice(None)] * len(shape)
    idx[dim] = slice(start, start + size)
    return src[tuple(idx)]


def default_weight_loader(param: torch.Tensor, src: WeightSource) -> None:
    data = read(src)
    if list(data.shape) != list(param.shape):
        raise ValueError(f"shape mismatch: checkpoint {list(data.shape)} vs model {list(param.shape)}")
    param.data.copy_(data)


def safetensors_files(path: str | Path) -> list[Path]:
    """Single-file checkpoints and sharded ones (model.safetensors.index.json)."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [p / name for name in sorted(set(weight_map.values()))]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {p}")
    return files


def iter_weights(path: str | Path) -> Iterator[tuple[str, LazySlice]]:
    """(name, lazy slice) for every tensor of the checkpoint; files stay open while iterating."""
    with ExitStack() as stack:
        for file in safetensors_files(path):
            f = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in f.keys():
                yield name, f.get_slice(name)
