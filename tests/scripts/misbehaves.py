"""A small training loop that misbehaves in the way given by --how, as real scripts and their libraries do:

- `spawn MARKER`: starts helper processes and never stops them: a Popen child, a daemon made by a setsid double
  fork, and a fork of the program itself (which inherits every fd). Each sleeps a minute with MARKER in its
  command line, so that a test can see whether it outlived the estimate. Then it trains normally.
- `exit3`, `kill9`, `abort`: its process ends in the first iteration by os._exit(3) (as scripts do to skip a slow
  teardown), a SIGKILL (as from the out-of-memory killer) or an abort() (as a failed C++ check).
- `hold GIB`: first caches GIB of "dataset" in host memory, in 64 MiB pieces.
- `limits`: prints the CPU-time and data-size limits it runs under, and exits 3.
"""
import argparse
import os
import resource
import signal
import subprocess
import sys
import time

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--how", choices=("spawn", "exit3", "kill9", "abort", "hold", "limits"), required=True)
parser.add_argument("value", nargs="?", default="")
args = parser.parse_args()


def spawn_helpers(marker: str) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", marker]
    subprocess.Popen(sleeper, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if os.fork() == 0:  # a daemon: a new session, its parent gone at once, so it is reparented
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, sleeper)
        os._exit(0)
    if os.fork() == 0:  # a worker forked from the program: it holds the progress pipe too
        time.sleep(60)
        os._exit(0)


def end_itself(how: str) -> None:
    print(f"ending with {how}", flush=True)
    if how == "exit3":
        os._exit(3)
    elif how == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    os.abort()


if args.how == "limits":
    print(f"cpu {resource.getrlimit(resource.RLIMIT_CPU)[0]} data {resource.getrlimit(resource.RLIMIT_DATA)[0]}")
    sys.exit(3)
if args.how == "spawn":
    spawn_helpers(args.value)
if args.how == "hold":
    piece = 64 << 20
    # filled, not zeroed: zeroed pages are never touched, and the trace's limit is on resident memory
    dataset = [bytearray(b"\x01") * piece for _ in range(int(float(args.value) * (1 << 30) / piece))]
    print(f"cached {len(dataset) * piece / (1 << 30):.2f} GiB of data", flush=True)

model = nn.Linear(8, 8).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    loss = model(torch.randn(4, 8, device="cuda")).sum()
    optimizer.zero_grad()
    loss.backward()
    if args.how in ("exit3", "kill9", "abort"):
        end_itself(args.how)
    optimizer.step()
