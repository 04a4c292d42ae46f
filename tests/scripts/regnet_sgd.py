"""torchvision RegNetX-400MF with SGD momentum (a valid GPU script): its widths are computed from CPU tensors."""
import torch
import torchvision

model = torchvision.models.regnet_x_400mf().cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(3):
    model(torch.randn(2, 3, 64, 64, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
