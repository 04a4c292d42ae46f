"""A small language model whose activations are scaled by the user's own Triton kernel (autotuned, in a custom
autograd.Function). --liger: its RMSNorm and loss are Liger's Triton kernels; --torch: the scale by torch instead
(the reference); --mistake: the kernel's output is made on the host (`torch.empty(shape)`, the device forgotten),
which Triton refuses on a GPU too."""
import argparse
import ctypes

import torch
import triton
import triton.language as tl

parser = argparse.ArgumentParser()
parser.add_argument("--liger", action="store_true")
parser.add_argument("--mistake", action="store_true")
parser.add_argument("--torch", action="store_true")
args = parser.parse_args()

try:  # a probe for the driver, as some libraries make at import: without one they carry on
    ctypes.CDLL("libcuda.so.1")
except OSError:
    pass


@triton.autotune(configs=[triton.Config({"BLOCK": 128}), triton.Config({"BLOCK": 256}, num_warps=8)],
                 key=["n_cols"], restore_value=["out_ptr"])
@triton.jit
def row_scale_kernel(x_ptr, out_ptr, n_cols, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, x * scale, mask=mask)


class RowScale(torch.autograd.Function):
    """y = x * scale, forward and backward by the kernel above."""

    @staticmethod
    def forward(ctx, x, scale):
        out = torch.empty(x.shape) if args.mistake else torch.empty_like(x)
        rows, cols = x.reshape(-1, x.shape[-1]).shape
        row_scale_kernel[lambda meta: (rows,)](x, out, cols, scale)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        grad_in = torch.empty_like(grad)
        rows, cols = grad.reshape(-1, grad.shape[-1]).shape
        row_scale_kernel[(rows,)](grad, grad_in, cols, ctx.scale)
        return grad_in, None


vocab, width = 1000, 256
if args.liger:
    from liger_kernel.transformers import LigerCrossEntropyLoss, LigerRMSNorm
    norm, loss_fn = LigerRMSNorm(width), LigerCrossEntropyLoss()
else:
    norm, loss_fn = torch.nn.RMSNorm(width), torch.nn.CrossEntropyLoss()
embed, head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
model = torch.nn.ModuleList([embed, norm, head]).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(4):
    tokens = torch.randint(0, vocab, (8, 64), device="cuda")
    hidden = embed(tokens)
    hidden = norm(hidden) * 0.5 if args.torch else RowScale.apply(norm(hidden), 0.5)
    loss = loss_fn(head(hidden).flatten(0, 1), tokens.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.3f}")
