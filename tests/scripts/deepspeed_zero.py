"""DeepSpeed ZeRO through its own engine (deepspeed.initialize with a config dict), launched by torchrun: an MLP
Linear(256, 512) -> ReLU -> Linear(512, 16) in bf16, AdamW from the config (DeepSpeed's FusedAdam), contiguous
gradients in a reduce bucket of 50 000 elements, no overlap. --stage 1|2|3, --overlap 1 sets overlap_comm,
--contiguous 0 turns contiguous_gradients off; ZeRO-Offload: --offload 1 keeps the optimizer on the host (which makes
the config's AdamW DeepSpeedCPUAdam), --offload-param 1 ZeRO-3's parameters too, --pin 0|1 the offloads'
pin_memory (argv)."""
import argparse

import deepspeed
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--offload", type=int, default=0)
parser.add_argument("--offload-param", type=int, default=0)
parser.add_argument("--pin", type=int, default=1)
parser.add_argument("--overlap", type=int, default=0)
parser.add_argument("--contiguous", type=int, default=1)
parser.add_argument("--local_rank", type=int, default=0)  # deepspeed's launcher passes it
args = parser.parse_args()

model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 16))
config = {"train_micro_batch_size_per_gpu": 8,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "bf16": {"enabled": True},
          "zero_optimization": {"stage": args.stage, "contiguous_gradients": bool(args.contiguous),
                                "overlap_comm": bool(args.overlap),
                                "reduce_bucket_size": 50000, "allgather_bucket_size": 50000,
                                "stage3_prefetch_bucket_size": 50000, "stage3_param_persistence_threshold": 1000}}
if args.offload:
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": bool(args.pin)}
if args.offload_param:
    config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": bool(args.pin)}
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for step in range(3):
    loss = engine(torch.randn(8, 256, device=engine.device, dtype=torch.bfloat16)).float().sum()
    engine.backward(loss)
    engine.step()
