"""An FSDP training loop that saves the model's state dict after every step, launched by torchrun: two blocks
(Linear(256, 512), GELU, Linear(512, 256)), each an FSDP unit, and a root unit holding the head Linear(256, 16);
AdamW, a batch of 8. After each step the program takes the state dict, saves it (rank 0 alone for a full one) and
drops it. Options (argv):
--api fsdp1|fsdp2: FullyShardedDataParallel (use_orig_params, ModuleWrapPolicy over the blocks) under
  `FSDP.state_dict_type`, or fully_shard under `torch.distributed.checkpoint.state_dict.get_model_state_dict`;
--ac none|inside|around: activation checkpointing of each block (non-reentrant), inside its unit (fsdp1:
  apply_activation_checkpointing after wrapping, so the unit wraps the checkpoint wrapper; fsdp2: the block's forward
  runs under torch.utils.checkpoint) or around it (fsdp1: apply_activation_checkpointing before wrapping, so the
  checkpoint wrapper holds the unit; fsdp2: the parent calls torch.utils.checkpoint on the fully_shard block);
--reshard true|false|N: fully_shard(block, reshard_after_forward=...) (fsdp2);
--mp none|bf16: MixedPrecision / MixedPrecisionPolicy with bf16 parameters;
--kind none|full|sharded: no state dict, FULL_STATE_DICT / SHARDED_STATE_DICT, or StateDictOptions(full_state_dict=
  True / False);
--offload 0|1: the state dict configs' offload_to_cpu, or StateDictOptions(cpu_offload=...);
--rank0 0|1: FullStateDictConfig(rank0_only=...) (fsdp1, full);
--optim 0|1: the optimizer's state dict too, beside the model's (FSDP.optim_state_dict under the same
  state_dict_type, its default optimizer config: offload_to_cpu; or get_optimizer_state_dict with the same options),
  as accelerate saves both;
--save torch|dcp: torch.save on rank 0 (full) or per rank (sharded), or torch.distributed.checkpoint.save."""
import argparse
import functools
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--api", default="fsdp1")
parser.add_argument("--ac", default="none")
parser.add_argument("--reshard", default="true")
parser.add_argument("--mp", default="none")
parser.add_argument("--kind", default="none")
parser.add_argument("--offload", type=int, default=0)
parser.add_argument("--rank0", type=int, default=1)
parser.add_argument("--optim", type=int, default=0)
parser.add_argument("--save", default="torch")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if args.api == "fsdp2" and args.ac == "inside":
            return checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if args.api == "fsdp2" and args.ac == "around" else block(x)
        return self.head(x)


dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = Model().cuda()
wrap_checkpoint = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
if args.api == "fsdp1":
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import (FullStateDictConfig, MixedPrecision, ShardedStateDictConfig,
                                        StateDictType)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    if args.ac == "around":
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap_checkpoint,
                                       check_fn=lambda module: isinstance(module, Block))
    precision = MixedPrecision(param_dtype=torch.bfloat16) if args.mp == "bf16" else None
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                 mixed_precision=precision)
    if args.ac == "inside":
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap_checkpoint,
                                       check_fn=lambda module: isinstance(module, Block))

    def model_state() -> dict:
        if args.kind == "full":
            kind = StateDictType.FULL_STATE_DICT
            config = FullStateDictConfig(offload_to_cpu=bool(args.offload), rank0_only=bool(args.rank0))
        else:
            kind, config = StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=bool(args.offload))
        with FSDP.state_dict_type(model, kind, config):
            state = model.state_dict()
            return {"model": state, "optim": FSDP.optim_state_dict(model, optimizer)} if args.optim else state
else:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if args.mp == "bf16" else MixedPrecisionPolicy()
    reshard = {"true": True, "false": False}[args.reshard] if args.reshard in ("true", "false") else int(args.reshard)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mp_policy=policy)

    def model_state() -> dict:
        options = StateDictOptions(full_state_dict=args.kind == "full", cpu_offload=bool(args.offload))
        state = get_model_state_dict(model, options=options)
        return {"model": state, "optim": get_optimizer_state_dict(model, optimizer, options=options)} if args.optim \
            else state

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
folder = tempfile.mkdtemp()
for step in range(3):
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if args.kind == "none":
        continue
    state = model_state()
    if args.save == "dcp":
        import torch.distributed.checkpoint as dcp
        dcp.save(state, checkpoint_id=os.path.join(folder, f"step{step}"))
    elif args.kind == "sharded" or rank == 0:
        torch.save(state, os.path.join(folder, f"step{step}-rank{rank}.pt"))
    del state
dist.destroy_process_group()
