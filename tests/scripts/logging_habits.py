"""Logging habits of training scripts (a valid GPU script): tensorboard SummaryWriter scalars and histograms of cuda
tensors, a tqdm bar with a tensor in its postfix, logging with %s and %.3f of a cuda loss."""
import logging, torch, torch.nn as nn
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
logging.basicConfig(level=logging.INFO)
writer = SummaryWriter()
model = nn.Linear(8, 2).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
bar = tqdm(range(10))
for it in bar:
    loss = model(torch.randn(4, 8, device="cuda")).square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
    writer.add_scalar("loss", loss, it)
    writer.add_histogram("w", model.weight, it)
    bar.set_postfix(loss=loss.item(), t=loss)
    logging.info("it %d loss %s %.3f", it, loss, loss)
