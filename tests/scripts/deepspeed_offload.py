"""DeepSpeed ZeRO-Offload through its own engine (deepspeed.initialize with a config dict), launched by torchrun: an
MLP Linear(256, 512) -> ReLU -> Linear(512, 16) in bf16, AdamW from the config, which the optimizer's offload to the
CPU makes DeepSpeedCPUAdam; contiguous gradients in a reduce bucket of 50 000 elements, no overlap. --stage 2|3,
--param 1: ZeRO-3's offload_param to the CPU as well, --pin 0|1: the offloads' pin_memory (argv)."""
import argparse

import deepspeed
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--param", type=int, default=0)
parser.add_argument("--pin", type=int, default=1)
parser.add_argument("--local_rank", type=int, default=0)  # deepspeed's launcher passes it
args = parser.parse_args()

model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 16))
zero = {"stage": args.stage, "contiguous_gradients": True, "overlap_comm": False, "reduce_bucket_size": 50000,
        "allgather_bucket_size": 50000, "stage3_prefetch_bucket_size": 50000,
        "stage3_param_persistence_threshold": 1000,
        "offload_optimizer": {"device": "cpu", "pin_memory": bool(args.pin)}}
if args.param:
    zero["offload_param"] = {"device": "cpu", "pin_memory": bool(args.pin)}
config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "bf16": {"enabled": True}, "zero_optimization": zero}
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for step in range(3):
    loss = engine(torch.randn(8, 256, device=engine.device, dtype=torch.bfloat16)).float().sum()
    engine.backward(loss)
    engine.step()
