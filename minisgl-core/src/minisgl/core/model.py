"""The interface model plugins implement, with a generic checkpoint loader."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minisgl.core.attention import AttentionBackend, ForwardContext
from minisgl.core.config import ModelConfig
from minisgl.core.distributed import Communicator
from minisgl.core.weights import WeightSource, default_weight_loader


class CausalLM(nn.Module):
    """Base class of model plugins.

    Subclasses build their layers in ``__init__(config, comm)`` (parameters are created under the
    target dtype/device, so no ``.to()`` afterwards), implement ``forward`` and ``compute_logits``,
    and describe merged projections in ``stacked_params``: checkpoint name fragment ->
    (parameter name fragment, shard id).
    """

    stacked_params: dict[str, tuple[str, int]] = {}
    # checkpoint tensors that are not parameters (e.g. rotary caches some exporters save)
    ignored_weights: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(self, config: ModelConfig, comm: Communicator) -> None:
        super().__init__()
        self.config, self.comm = config, comm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] for the T flattened tokens of a batch, or only the rows
        ``ctx.out_rows`` lists, in its order, where it is given (see ForwardContext)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] (full vocabulary on every rank) for the rows of ``hidden``."""
        raise NotImplementedError

    def bind(self, backend: AttentionBackend) -> None:
        """Called by the engine once the weights are final (loaded, then packed or quantized)
        and the attention backend is built, before any step: set up what depends on both (the
        Llama family asks for its layers' one call here, core/layers/fused.py). Default: nothing."""

    @property
    def layers_in_one_call(self) -> bool:
        """True where ``bind`` gave the decoder layers of every step to one backend call: then
        ``compile="auto"`` stays eager, whose steps measured as fast as the compiled graph's
        (core/compile.py). Default: False."""
        return False

    def skip_weight(self, name: str) -> bool:
        if any(s in name for s in self.ignored_weights):
            return True
        return self.config.tie_word_embeddings and name.startswith("lm_head.")

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy checkpoint tensors into parameters; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, src in weights:
            if self.skip_weight(name):
                continue
            shard: int | None = None
            for ckpt_part, (param_part, shard_id) in self.stacked_params.items():
                if ckpt_part in name:
                    name, shard = name.replace(ckpt_part, param_part), shard_id
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                                 f"{type(self).__name__}")
            # TP layers define weight_loader(param, src, shard_id) to read only their slice
            loader = getattr(modules[name.rpartition(".")[0]], "weight_loader", None)
            if loader is None:
                default_weight_loader(param, src)
            else:
                loader(param, src, shard or 0)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
