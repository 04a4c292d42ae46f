"""GAN-style training: a generator and a discriminator, each with its own Adam, stepped once per round."""
import torch
import torch.nn as nn

generator = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32)).cuda()
discriminator = nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1)).cuda()
opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4)
opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4)
bce = nn.BCEWithLogitsLoss()
for step in range(10):
    real = torch.randn(8, 32, device="cuda")
    fake = generator(torch.randn(8, 16, device="cuda"))
    d_loss = bce(discriminator(real), torch.ones(8, 1, device="cuda")) + \
        bce(discriminator(fake.detach()), torch.zeros(8, 1, device="cuda"))
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = bce(discriminator(fake), torch.ones(8, 1, device="cuda"))
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
