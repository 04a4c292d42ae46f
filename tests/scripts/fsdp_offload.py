"""FSDP with its parameters offloaded to the host, launched by torchrun: Linear(256, 256), ReLU, Linear(256, 256),
ReLU, Linear(256, 16), each Linear its own FSDP unit under a root that holds no parameter; AdamW over all of them;
the model built on the host, as offloading asks. --fsdp 1: FullyShardedDataParallel(cpu_offload=CPUOffload(
offload_params=True)) with --orig 0|1 (use_orig_params) and --device-id 0|1 (whether FSDP is given the GPU: it then
moves each unit there to flatten and shard it, and back); --fsdp 2: fully_shard(offload_policy=CPUOffloadPolicy(
pin_memory=--pin 0|1)). --mp bf16 adds mixed precision: bf16 parameters, fp32 reduce (FSDP1 MixedPrecision, FSDP2
MixedPrecisionPolicy) (argv)."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--fsdp", type=int, default=1)
parser.add_argument("--orig", type=int, default=0)
parser.add_argument("--device-id", type=int, default=1)
parser.add_argument("--pin", type=int, default=1)
parser.add_argument("--mp", default="none")
args = parser.parse_args()

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))
if args.fsdp == 1:
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mp == "bf16" else None
    model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                     cpu_offload=CPUOffload(offload_params=True), use_orig_params=bool(args.orig),
                                     mixed_precision=precision,
                                     device_id=torch.cuda.current_device() if args.device_id else None)
else:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    policy = CPUOffloadPolicy(pin_memory=bool(args.pin))
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mp == "bf16" \
        else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, offload_policy=policy, mp_policy=precision)
    fully_shard(model, offload_policy=policy, mp_policy=precision)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(3):
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
