"""What training libraries do to a model's tensors before the first step, each checked by the program itself (it
exits 7 on the first wrong answer): accelerate's empty-weights loading (`init_empty_weights`, then
`set_module_tensor_to_device` and `load_checkpoint_and_dispatch`, which rebuild each parameter as its own class), the
object collectives of a 4-rank world, and torch.save / torch.load of host data and of GPU tensors.
Argument: a folder with a tiny Llama checkpoint (config.json + model.safetensors)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from accelerate.utils import set_module_tensor_to_device
from transformers import AutoConfig, AutoModelForCausalLM


def expect(condition: bool, what: str) -> None:
    if not condition:
        print(f"wrong: {what}", flush=True)
        sys.exit(7)


# accelerate: parameters made on meta, then given values on the GPU one by one
with init_empty_weights():
    head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
for name, param in list(head.named_parameters()):
    set_module_tensor_to_device(head, name, "cuda", value=torch.randn(param.shape))
expect(all(isinstance(p, nn.Parameter) and p.device.type == "cuda" for p in head.parameters()), "parameters set")

# ... and a whole checkpoint dispatched onto an empty model built from its config
checkpoint = sys.argv[1]
with init_empty_weights():
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
model = load_checkpoint_and_dispatch(model, checkpoint, device_map={"": 0})
expect(all(p.device.type == "cuda" for p in model.parameters()), "the checkpoint dispatched to the GPU")

# object collectives: rank 0 of 4 sends its objects and gets the others' (stood in for by its own)
os.environ.update(WORLD_SIZE="4", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
dist.init_process_group("nccl")
settings = [{"seed": 7, "run": "a"}, None]
dist.broadcast_object_list(settings, src=0)
expect(settings == [{"seed": 7, "run": "a"}, None], "broadcast_object_list from rank 0")
gathered = [None] * 4
dist.all_gather_object(gathered, {"rank": dist.get_rank(), "norm": torch.ones(3, device="cuda")})
expect([g["rank"] for g in gathered] == [0] * 4 and gathered[3]["norm"].shape == (3,), "all_gather_object")
parts = [None]
dist.scatter_object_list(parts, [f"shard{i}" for i in range(4)], src=0)
expect(parts == ["shard0"], "scatter_object_list")
collected = [None] * 4
dist.gather_object("done", collected, dst=0)
expect(collected == ["done"] * 4, "gather_object")

# torch.save then torch.load: host data with its values, GPU tensors as they were
cache = {"tokens": torch.arange(10), "lengths": [3, 7]}
torch.save(cache, "tokens.pt")
again = torch.load("tokens.pt")
expect(again["tokens"].tolist() == list(range(10)) and again["lengths"] == [3, 7], "host data round-trips")
torch.save({"model": head.state_dict(), "step": torch.tensor(5)}, "head.pt")
loaded = torch.load("head.pt")
expect(loaded["step"].item() == 5, "a host tensor beside GPU ones")
expect({k: (v.shape, v.device.type) for k, v in loaded["model"].items()} ==
       {k: (v.shape, v.device.type) for k, v in head.state_dict().items()}, "GPU tensors load as saved")
head.load_state_dict(loaded["model"])
torch.save(head.state_dict(), "legacy.pt", _use_new_zipfile_serialization=False)  # torch's pre-1.6 format
expect(torch.load("legacy.pt")["0.weight"].shape == (64, 32), "a legacy-format save loads back")

optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()])
for _ in range(3):
    ids = torch.randint(0, model.config.vocab_size, (2, 16), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss + head(torch.randn(4, 32, device="cuda")).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
