"""Mixed precision: autocast fp16 + GradScaler with unscale_ and gradient clipping (a valid GPU script)."""
import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")
for step in range(10):
    x = torch.randn(32, 256, device="cuda")
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        out = model(x)
        loss = out.float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if not torch.isfinite(norm):
        print("non-finite gradient norm, step will be skipped")
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.3f} scale {scaler.get_scale()}")
