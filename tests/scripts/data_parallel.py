"""nn.DataParallel over every visible GPU (a valid single-process multi-GPU script)."""
import torch
import torch.nn as nn

model = nn.DataParallel(nn.Linear(32, 32).cuda())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    loss = model(torch.randn(8, 32).cuda()).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
