"""A graph-pooling training loop (as chemprop's aggregation does it): a node-to-graph index made on the host, moved to
the GPU, and its max sizing the pooled tensor. A valid GPU script: exits non-zero if a value it reads from a GPU
tensor copied from the host is not the real one. Widths 1000 (pooled) and 777 (pooled after an unknown write)
let the test find the two allocations; the weights' positive entries (2 * 8 bytes for each) show whether the weights'
values were followed (they must not be: a stand-in selects every entry)."""
import sys

import torch

batch = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 4, 5])  # 10 nodes in 6 graphs
model = torch.nn.Linear(1000, 1000).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def check(what, got, real):
    if got != real:
        sys.exit(f"{what}: {got!r}, the real value is {real!r}")


for step in range(3):
    index = batch.to("cuda")
    nodes = model(torch.randn(10, 1000, device="cuda"))
    graphs = index.max().int() + 1  # a GPU tensor computed from the copy
    pooled = torch.zeros(graphs, 1000, device="cuda").index_add_(0, index, nodes)
    check("pooled rows", pooled.shape[0], 6)
    check("tolist", index.tolist()[:3], [0, 0, 1])
    check("sum", (index == 3).sum().item(), 2)
    check("cpu numpy", int(index.cpu().numpy()[-1]), 5)
    check("masked rows", nodes[index > 3].shape[0], 2)  # a known mask selects from an unknown tensor
    check("equal", torch.equal(index, index + 0), True)
    features = torch.arange(8.0).reshape(2, 4)  # float data: known as well
    check("allclose", torch.allclose(features.cuda(), (features + 1).cuda() - 1), True)
    check("float differs", torch.allclose(features.cuda(), features.cuda() * 2), False)
    torch.nonzero(model.weight.detach() > 0)  # a parameter's values are never followed
    shifted = index.clone()
    shifted += 1  # written by an op on known values: still known
    check("after a known write", int(shifted.max()), 6)
    fresh = torch.empty(10, dtype=torch.long, device="cuda")
    fresh.copy_(batch)  # copied into a fresh GPU tensor
    check("copy_", int(fresh.max()), 5)
    shifted[0] = nodes.argmax()  # written from GPU data: no longer known, a stand-in from here on
    unknown = torch.zeros(int(shifted.max()) + 1, 777, device="cuda")
    loss = pooled.sum() + unknown.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
