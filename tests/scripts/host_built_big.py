"""A model built on the host past the host budget, however its tensors are made: a 10 GB nn.Linear (torch.empty in
its constructor, before it is registered) and QLoRA-style frozen layers whose bf16 weight is swapped for torchao's
NF4Tensor (torch.utils.swap_tensors), one built on the host then moved to the GPU, one built on the GPU (under the
default-device context). The host data stays real. Exits 7 on a wrong answer."""
import resource
import sys

import torch
import torch.nn as nn
from torchao.quantization import to_nf4


def expect(condition: bool, what: str) -> None:
    if not condition:
        print(f"wrong: {what}", flush=True)
        sys.exit(7)


class FrozenNF4(nn.Linear):
    def __init__(self, features: int, device: str | None = None) -> None:
        super().__init__(features, features, bias=False, device=device, dtype=torch.bfloat16)
        self.weight.requires_grad_(False)
        torch.utils.swap_tensors(self.weight, nn.Parameter(to_nf4(self.weight), requires_grad=False))
        # nn.Linear's forward: NF4Tensor answers F.linear itself


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = FrozenNF4(512)  # built first: inside the host budget, real
        with torch.device("cuda"):
            self.frozen_on_gpu = FrozenNF4(512)
        self.up = nn.Linear(512, 50_000)
        self.wide = nn.Linear(50_000, 50_000, bias=False)  # 10 GB of fp32
        self.head = nn.Linear(50_000, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.wide(self.up(self.frozen_on_gpu(self.frozen(x)).float())))


samples = torch.randn(20_000, 1024)  # 80 MB of host data: real values
expect(type(samples) is torch.Tensor and samples.std() > 0.5, "host data is real")
model = Model()
expect(type(model.frozen.weight).__name__ == type(model.frozen_on_gpu.weight).__name__ == "NF4Tensor",
       "the NF4 weights swapped in")
expect(model.frozen_on_gpu.weight.device.type == "cuda", "a layer built under torch.device('cuda') is on the GPU")
expect(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 << 20, "the 10 GB layer took no host memory")
model = model.cuda()
expect(all(t.device.type == "cuda" for t in model.frozen.weight.__tensor_flatten__()[0] and
           [getattr(model.frozen.weight, name) for name in model.frozen.weight.__tensor_flatten__()[0]]),
       "the NF4 weight's parts on the GPU")
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
for _ in range(3):
    model(torch.randn(2, 512, dtype=torch.bfloat16, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
