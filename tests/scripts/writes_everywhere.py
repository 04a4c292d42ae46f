"""A training loop that writes into its run directory the way example scripts do: a sample image saved with PIL, a
log file, a checkpoint every step (loaded back) with rotation (the oldest deleted, `latest.txt` replaced), an appended metrics
file (also touched and chmod-ed), `os.makedirs` of an output tree and an `os.replace` into place. After each write
it reads the file back and exits 7 if it does not see what it wrote; it also checks that the user's input data
reads as it was.

Run it in a directory prepared by tests/trace/test_sandbox.py (real_samples.png, checkpoints/old_checkpoint.pt,
latest.txt, metrics.csv, logs/train.log, data/train.txt).
"""
import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
from PIL import Image

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--save-to-file-object", action="store_true",
                    help="torch.save into an open() file instead of a path (which torch writes from C++)")
args = parser.parse_args()


def expect(condition: bool, what: str) -> None:
    if not condition:
        print(f"read-back failed: {what}", flush=True)
        sys.exit(7)


with open("data/train.txt") as data:
    expect(data.read() == "the user's data\n", "the user's input data changed")

logging.basicConfig(filename="logs/train.log", level=logging.INFO, format="%(message)s")
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def save_checkpoint(step: int) -> None:
    """One directory per checkpoint (model weights and a trainer state), the newest only kept, as trainers do."""
    folder = f"checkpoints/checkpoint-{step}"
    os.makedirs(folder, exist_ok=True)
    state = {"model": model.state_dict(), "step": torch.tensor([step]), "seen": torch.arange(float(step + 3))}
    if args.save_to_file_object:
        with open(f"{folder}/model.pt", "wb") as f:
            torch.save(state, f)
    else:
        torch.save(state, f"{folder}/model.pt")
    loaded = torch.load(f"{folder}/model.pt")  # host tensors with their values, the GPU's as they were saved
    expect(loaded["step"].tolist() == [step] and loaded["seen"].tolist() == [float(s) for s in range(step + 3)],
           "the checkpoint's host tensors")
    expect({name: (t.shape, t.device) for name, t in loaded["model"].items()} ==
           {name: (t.shape, t.device) for name, t in model.state_dict().items()}, "the checkpoint's GPU tensors")
    with open(f"{folder}/trainer_state.json", "w") as f:
        json.dump({"global_step": step}, f)
    with open(f"{folder}/trainer_state.json") as f:
        expect(json.load(f) == {"global_step": step}, "the trainer state reads back")
    for old in sorted(os.listdir("checkpoints")):
        path = os.path.join("checkpoints", old)
        if old != f"checkpoint-{step}":
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    expect(os.listdir("checkpoints") == [f"checkpoint-{step}"], "rotation left only the newest checkpoint")
    with open("latest.txt.tmp", "w") as f:
        f.write(f"checkpoint-{step}\n")
    os.replace("latest.txt.tmp", "latest.txt")
    expect(open("latest.txt").read() == f"checkpoint-{step}\n", "latest.txt was replaced")
    expect(not os.path.exists("latest.txt.tmp"), "the replaced temporary is gone")


for step in range(args.steps):
    x = torch.randn(8, 16, device="cuda")
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    if step < 2:
        Image.new("RGB", (8, 8), (step * 100, 0, 0)).save("real_samples.png")
        expect(Image.open("real_samples.png").getpixel((0, 0)) == (step * 100, 0, 0), "the sample image")
        logging.info("step %d", step)
        expect(open("logs/train.log").read().endswith(f"step {step}\n"), "the log file")
        with open("metrics.csv", "a") as metrics:
            metrics.write(f"{step},0.5\n")
        expect(open("metrics.csv").read() == "step,loss\n" + "".join(f"{s},0.5\n" for s in range(step + 1)),
               "metrics.csv was appended to")
        os.chmod("metrics.csv", 0o600)  # metadata too: a touch and a chmod
        Path("metrics.csv").touch()
        expect(os.stat("metrics.csv").st_mode & 0o777 == 0o600, "the chmod")
        os.makedirs(f"outputs/exp1/step{step}", exist_ok=True)
        expect(os.path.isdir(f"outputs/exp1/step{step}"), "os.makedirs")
        save_checkpoint(step)
        print(f"step {step}: wrote and read back everything", flush=True)
    optimizer.step()
