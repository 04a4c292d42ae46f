"""LayerDrop as transformers' encoder-decoder models write it (OPT, BART, Whisper, ... in 4.x): a host-side draw
per layer, `torch.rand([]) < layerdrop`, skips the layer. The configs ship layerdrop = 0.0, so on a GPU every layer
runs; a traced run must run them all too (a valid GPU script)."""
import torch

LAYERDROP = 0.0  # the published configs' value


class Decoder(torch.nn.Module):
    def __init__(self, layers=4, dim=64):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < LAYERDROP:
                    continue
            x = torch.relu(layer(x))
        return x


model = Decoder().cuda()
optimizer = torch.optim.AdamW(model.parameters())
for step in range(3):
    loss = model(torch.randn(8, 64, device="cuda")).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
