"""The bench's analytic model cost against the bundled checkpoint's own tensors."""

from __future__ import annotations

import torch
from safetensors import safe_open

from minisgl.core.config import ModelConfig
from minisgl.server.bench import ModelCost


def test_decode_bytes_count_the_checkpoint_weights(smollm2_path: str) -> None:
    """Layer weights = every projection matrix in the checkpoint; LM head = the (tied) embedding;
    a decode step reads them at 2 bytes each in bf16 and 1 byte each with int8."""
    mc = ModelConfig.from_pretrained(smollm2_path)
    proj = embed = 0
    with safe_open(f"{smollm2_path}/model.safetensors", "pt") as f:
        for name in f.keys():
            n = f.get_slice(name).get_shape()
            if name.endswith("proj.weight"):
                proj += n[0] * n[1]
            elif name.endswith("embed_tokens.weight"):
                embed += n[0] * n[1]
    bf16 = ModelCost.from_config(mc, torch.bfloat16)
    assert (bf16.layer_params, bf16.lm_head_params) == (proj, embed)
    assert bf16.decode_bytes() == 2 * (proj + embed)
    assert ModelCost.from_config(mc, torch.bfloat16, "int8").decode_bytes() == proj + embed
    assert ModelCost.from_config(mc, torch.float32).decode_bytes() == 4 * (proj + embed)
