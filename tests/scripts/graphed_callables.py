"""Two modules made graphed callables (torch.cuda.make_graphed_callables) and trained through them: each module's
forward and backward are captured into graphs that share one memory pool (a valid GPU script)."""
import torch
import torch.nn as nn

first, second = nn.Linear(256, 1024).cuda(), nn.Linear(1024, 256).cuda()
optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
x = torch.randn(64, 256, device="cuda")
h = torch.randn(64, 1024, device="cuda", requires_grad=True)
first, second = torch.cuda.make_graphed_callables((first, second), ((x,), (h,)))
for step in range(6):
    optimizer.zero_grad(set_to_none=True)
    out = second(torch.relu(first(torch.randn(64, 256, device="cuda"))))
    out.sum().backward()
    optimizer.step()
print("ok")
