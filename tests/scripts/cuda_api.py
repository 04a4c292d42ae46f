"""Exercises the torch.cuda API that training scripts call around their loop (a valid GPU script)."""
import numpy as np
import torch
import torch.nn as nn

assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
torch.cuda.set_device(0)
torch.manual_seed(0)
torch.cuda.manual_seed_all(0)
props = torch.cuda.get_device_properties(0)
print(torch.cuda.get_device_name(), props.total_memory, props.multi_processor_count, torch.cuda.current_device())
batch = 16 if props.total_memory > 100 * 2**30 else 8  # sized from the GPU, as some scripts do
use_bf16 = torch.cuda.is_bf16_supported()
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.benchmark = True

model = nn.Linear(32, 32).cuda()
torch.cuda.empty_cache()
optimizer = torch.optim.AdamW(model.parameters(), fused=True)
data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 32))
loader = torch.utils.data.DataLoader(data, batch_size=batch, pin_memory=True, num_workers=2)
weights = torch.from_numpy(np.ones(4, dtype=np.float32)).cuda()
table = torch.tensor([1.0, 2.0, 3.0], device="cuda")
scores = torch.randn(128, device="cuda")
top = scores[scores > 0]  # data-dependent shape
print(top.shape, torch.nonzero(scores < 0).shape, scores.tolist()[:2], bool((scores > 5).any()))
side = torch.cuda.Stream()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for epoch in range(3):
    for x, y in loader:
        start.record()
        x, y = x.pin_memory().cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16 if use_bf16 else torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.cuda.stream(side):
            stats = torch.zeros(4, device="cuda")
        torch.cuda.current_stream().wait_stream(side)
        end.record()
        torch.cuda.synchronize()
        print(start.elapsed_time(end), torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.empty_cache()
