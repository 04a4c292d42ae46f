"""Three adapters of one tiny model through peft's public API, trained side by side: LoRA (no FFT), FourierFT (its
weight change is `ifft2` of a sparse spectrum: `_fft_c2c` over the layer's weight shape) and C3A (block-circulant:
`fft`/`ifft` over blocks of the input and the kernel: `_fft_r2c` and `_fft_c2c`). Each model is held by a module of
its own class, so the trace's module paths say whose each event is. One iteration steps all three optimizers.

    python tests/scripts/peft_fft_adapters.py
"""

import peft
import torch
from torch import nn

WIDTH, BATCH = 256, 32


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.v = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.q(x)) + self.v(x))


def holder(name: str, config: peft.PeftConfig) -> nn.Module:
    """The adapted model inside a module whose class is `name` (the first part of its events' module paths)."""
    kind = type(name, (nn.Module,), {"forward": lambda self, x: self.inner(x)})
    module = kind()
    module.inner = peft.get_peft_model(Tiny(), config)
    return module.cuda()


models = [
    holder("LoraNet", peft.LoraConfig(r=8, target_modules=["q", "v"])),
    holder("FourierNet", peft.FourierFTConfig(n_frequency=100, target_modules=["q", "v"])),
    holder("C3ANet", peft.C3AConfig(block_size=64, target_modules=["q", "v"])),
]
optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in models]
x = torch.randn(BATCH, WIDTH, device="cuda")
for _ in range(3):
    for model, optimizer in zip(models, optimizers):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
