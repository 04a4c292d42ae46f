"""A training script with the host-side habits of real ones (a valid GPU script): real CPU values decide the model's
shape and the loop, a sampler over a large dataset, a thread pool moving tensors to cuda, every way of reading a
value out of a cuda tensor, the CUDA queries scripts print, a CUDA graph, an LSTM, seeding. Prints `HOST-OK` lines
that the test checks; exits non-zero if a host value is not the real one."""
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.cuda.manual_seed(0)
torch.cuda.manual_seed_all(0)

# Host values are real: the width comes from a CPU computation (as torchvision's RegNet computes its widths).
width = int(torch.tensor([3.0, 4.0]).norm().item()) * 8  # 40
if width != 40:
    sys.exit(f"host value was not real: {width}")

# A CPU-only warm-up loop that stops on a real value.
w = torch.zeros(1, requires_grad=True)
for step in range(1000):
    loss_cpu = (w - 2.0).pow(2).sum()
    if loss_cpu.item() < 1e-3:
        break
    loss_cpu.backward()
    with torch.no_grad():
        w -= 0.1 * w.grad
        w.grad.zero_()
print("HOST-OK warm-up stopped at", step)


class Big(torch.utils.data.Dataset):  # ImageNet-sized index space, tiny items
    def __len__(self):
        return 1281167

    def __getitem__(self, i):
        return torch.full((16,), float(i % 7)), i % 4


started = time.monotonic()
loader = torch.utils.data.DataLoader(Big(), batch_size=8, shuffle=True)
batches = iter(loader)
print(f"HOST-OK sampler {time.monotonic() - started:.1f}s")

with ThreadPoolExecutor(2) as pool:  # from_pretrained(device_map=...) copies weights in threads like this
    moved = list(pool.map(lambda t: t.to("cuda"), [torch.zeros(1000) for _ in range(2)]))
assert all(t.is_cuda for t in moved)


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, value, n=1):
        self.sum += value * n
        self.count += n

    @property
    def avg(self):
        return self.sum / self.count


model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4)).cuda()
rnn = nn.LSTM(16, 32, batch_first=True).cuda()
optimizer = torch.optim.AdamW(list(model.parameters()) + list(rnn.parameters()), lr=1e-3)
try:
    import pynvml
except ImportError:
    pass
else:  # a monitoring line, as launch scripts print
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    assert info.total > info.used > 0, (info.total, info.used)
    print("HOST-OK nvml", pynvml.nvmlDeviceGetName(handle), info.used, pynvml.nvmlDeviceGetCount())
meter = AverageMeter()
graph = torch.cuda.CUDAGraph()
for it in range(5):
    x, y = next(batches)
    x, y = x.cuda(), y.cuda()
    seq, _ = rnn(x.unsqueeze(1))
    loss = nn.functional.cross_entropy(model(x + seq.squeeze(1).sum(-1, keepdim=True)), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    meter.update(loss.item(), x.size(0))
    losses = torch.stack([loss.detach(), loss.detach()])
    guess = model(x).argmax(-1)  # computed on the GPU: no real values (y, copied from the host, has its own)
    print(f"it {it} loss {loss:.4f} mean {losses.mean():.3f} avg {meter.avg:.3f} {losses} {str(loss)[:10]}")
    print(int(y.max()), float(loss), bool(loss > 0), guess.tolist()[:2], np.asarray(losses.cpu()).shape,
          list(range(y.max()))[:1], [float(v) for v in losses], torch.equal(losses, losses),
          torch.allclose(losses, losses))
    if loss.item() < 1e-9:  # a stand-in never ends the loop early
        break
    with torch.inference_mode():  # a validation batch moved as ultralytics' validator does (aten.to arrives whole)
        val_x = torch.full((8, 16), 1.0).to(torch.device("cuda", 0), non_blocking=True)
        val = model(val_x).argmax(-1).eq(y).float().mean().item()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    print(start.elapsed_time(end), free <= total, torch.cuda.memory_allocated() > 0,
          torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
          torch.cuda.get_device_name(), len(torch.cuda.memory_summary()) > 0,
          torch.bincount(guess).shape, torch.repeat_interleave(guess).shape, guess.unique().shape, x[x > 0].shape)
print("HOST-OK done")
