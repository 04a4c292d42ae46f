"""Uses CUDA (inference only) but never steps an optimizer."""
import torch

model = torch.nn.Linear(8, 1).cuda()
with torch.no_grad():
    print(model(torch.randn(4, 8, device="cuda")).shape)
