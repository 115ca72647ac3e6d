"""The EAGLE-3 draft directory's tensors as SGLang's (`LlamaForCausalLMEagle3.load_weights`) and
vLLM's (`Eagle3LlamaForCausalLM.load_weights`) loaders read them, written out as literals: the
oracle of every test of a written draft directory (`tests/sidecar/model/test_eagle3_checkpoint.py`, a
run's export in `tests/trainer/rl/test_export.py`)."""

from __future__ import annotations

import torch

LAYOUT = {  # name: (shape with h = 64, heads 4 x 16, intermediate 128, vocab 64, draft vocab 35), dtype
    "fc.weight": ((64, 192), torch.float32),
    "midlayer.input_layernorm.weight": ((64,), torch.float32),
    "midlayer.hidden_norm.weight": ((64,), torch.float32),
    "midlayer.self_attn.q_proj.weight": ((64, 128), torch.float32),
    "midlayer.self_attn.k_proj.weight": ((64, 128), torch.float32),
    "midlayer.self_attn.v_proj.weight": ((64, 128), torch.float32),
    "midlayer.self_attn.o_proj.weight": ((64, 64), torch.float32),
    "midlayer.post_attention_layernorm.weight": ((64,), torch.float32),
    "midlayer.mlp.gate_proj.weight": ((128, 64), torch.float32),
    "midlayer.mlp.up_proj.weight": ((128, 64), torch.float32),
    "midlayer.mlp.down_proj.weight": ((64, 128), torch.float32),
    "norm.weight": ((64,), torch.float32),
    "lm_head.weight": ((35, 64), torch.float32),
    "d2t": ((35,), torch.int64),
    "t2d": ((64,), torch.bool),
}
