"""Large-model style initialisation: build on the meta device, materialise on the GPU, then initialise."""
import torch
import torch.nn as nn

with torch.device("meta"):
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
model.to_empty(device="cuda")
for module in model.modules():
    if isinstance(module, (nn.Linear, nn.LayerNorm)):
        module.reset_parameters()
optimizer = torch.optim.AdamW(model.parameters())
for step in range(5):
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
