"""FSDP2 with float8 all-gather, torchtitan's float8 default, launched by torchrun: a stack of Linear layers swapped to
torchao's Float8Linear with `enable_fsdp_float8_all_gather` (each weight a WeightWithDynamicFloat8CastTensor, gathered
as float8 bits and a scale), each layer its own fully_shard unit under a bf16 MixedPrecisionPolicy, fp32 master
weights, AdamW; --precompute: one amax all-reduce for all weights after each step
(precompute_float8_dynamic_scale_for_fsdp), as torchtitan does. A valid script on GPUs of compute capability 8.9+."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

parser = argparse.ArgumentParser()
parser.add_argument("--precompute", action="store_true")
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

DIM, HIDDEN, TOKENS = 256, 512, 256


def main() -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.ReLU(), nn.Linear(HIDDEN, DIM, bias=False),
                          nn.ReLU(), nn.Linear(DIM, HIDDEN, bias=False)).cuda()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        x = torch.randn(TOKENS, DIM, device="cuda")
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if args.precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        print(f"step {step} loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
