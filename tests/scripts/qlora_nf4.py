"""QLoRA as torchtune builds it: frozen NF4 base weights (torchao's to_nf4, as torchtune's FrozenNF4Linear swaps them
in), bf16 LoRA adapters beside them, a bf16 checkpoint loaded from the host into the NF4 weights, AdamW on the
adapters only (a valid GPU script)."""
import argparse
import os
import tempfile

import torch
import torch.nn as nn

try:
    from torchao.dtypes.nf4tensor import linear_nf4, to_nf4
except ImportError:  # torchao 0.1x moved it
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

DIM, RANK = 1024, 8
parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-file", action="store_true", help="save the checkpoint, load it onto the GPU")
args = parser.parse_args()


class FrozenNF4Linear(nn.Linear):
    """A frozen bias-free Linear whose weight is quantized to NF4 at construction (torchtune's FrozenNF4Linear)."""

    def __init__(self, in_dim, out_dim, device=None, dtype=torch.bfloat16):
        super().__init__(in_dim, out_dim, bias=False, device=device, dtype=dtype)
        self.weight.requires_grad_(False)
        self.nf4_weight = to_nf4(self.weight)
        torch.utils.swap_tensors(self.weight, nn.Parameter(self.nf4_weight, requires_grad=False))

    def forward(self, x):
        return linear_nf4(input=x, weight=self.weight)


class LoRALinear(nn.Module):
    def __init__(self, dim, rank):
        super().__init__()
        self.base = FrozenNF4Linear(dim, dim, device="cuda")
        self.lora_a = nn.Linear(dim, rank, bias=False, device="cuda", dtype=torch.bfloat16)
        self.lora_b = nn.Linear(rank, dim, bias=False, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


model = nn.Sequential(LoRALinear(DIM, RANK), LoRALinear(DIM, RANK))
checkpoint = {f"{i}.base.weight": torch.randn(DIM, DIM, dtype=torch.bfloat16) for i in range(2)}
if args.checkpoint_file:
    path = os.path.join(tempfile.mkdtemp(), "base.pt")
    torch.save(checkpoint, path)
    checkpoint = torch.load(path, map_location="cuda")
missing, unexpected = model.load_state_dict(checkpoint, strict=False)
assert not unexpected, unexpected
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
for step in range(5):
    x = torch.randn(8, DIM, device="cuda", dtype=torch.bfloat16)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")
