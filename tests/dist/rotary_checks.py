"""zero.Init in bf16 computes rotary inverse frequencies at bf16 precision; the session's load
recomputes them (posttrain.placement.session.recompute_rotary_buffers). One CPU process."""

import json
import sys

import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.placement.session import _skip_shm_comm_op, recompute_rotary_buffers


def main(out: str) -> None:
    _skip_shm_comm_op()  # as a Session does on CPU: no JIT compile of DeepSpeed's shm comm op
    deepspeed.init_distributed("gloo")
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=128)
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}
    with deepspeed.zero.Init(dtype=torch.bfloat16, config_dict_or_path=ds):
        sharded = LlamaForCausalLM(cfg)
    plain = LlamaForCausalLM(cfg)
    want = plain.model.rotary_emb.inv_freq

    def err() -> float:
        return (sharded.model.rotary_emb.inv_freq.float() - want).abs().max().item()

    res = {"before": err(), "fixed": recompute_rotary_buffers(sharded), "after": err(),
           "dtype": str(sharded.model.rotary_emb.inv_freq.dtype),
           "original_after": (sharded.model.rotary_emb.original_inv_freq - want).abs().max().item()}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
