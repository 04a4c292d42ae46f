#!/usr/bin/env python
"""A 7B local checkpoint fine-tuned under the estimator: seconds, peak RSS and the bytes of weight files read.

Writes a real Hugging Face checkpoint of a Llama-7B shape (bf16, zeros written in 64 MiB chunks, 5 GB safetensors
shards with their index, ~13.5 GB in all; the model is built on the meta device only for its names and shapes),
then runs `xmem-slurm estimate --json` on a fine-tuning script that loads it with `from_pretrained` (with
`device_map="cuda"`, or moving the model with `.cuda()` afterwards) and trains 3 steps with AdamW. Before each run
the shards are dropped from the page cache (fsync, posix_fadvise DONTNEED), so that what is cached afterwards is
what the run read, through read() and memory maps alike (util-linux `fincore`); the block-device reads of the
process tree (/proc/PID/io read_bytes, sampled) are shown beside it. The checkpoint is deleted at the end.
Targets: <= 30 s, <= 2 GiB peak RSS of the process tree, no weight data read.

The case `fsdp70b` (issue 31: "a 70B FSDP fine-tune from a local checkpoint answers within 8 GiB of host memory and
in under 60 s on 2 cores") writes a Llama-2-70B checkpoint (bf16, 5 GB shards, ~138 GB apparent) as sparse files:
each shard's header, and its data a hole of the right size (no disk, nothing to read but the headers), and runs
`torchrun --nnodes=2 --nproc_per_node=8` on a fine-tune under accelerate's FSDP2 (the HF Trainer's `--fsdp` path:
from_pretrained on the host, fp32 master shards, bf16 compute, activation checkpointing, AdamW). The trace runs
cold (no warm tracer, whose forked process is outside the measured tree): imports included. Targets: <= 60 s,
<= 8 GiB peak RSS of the process tree. Its checkpoint folder is `xmem-bench-llama70b`. With `--warm`, the 70B
estimate goes through the warm tracer, the product's default path (a server of its own, in a temporary socket
directory; the estimate is made twice, the first
finding no server for the launcher's environment and starting one): the peak RSS is then the larger of the estimating process's tree and
the warm server's (the traced job is the server's forked child), the CPU seconds the estimating tree's and the
server's together.

    .venv/bin/python scripts/bench_checkpoint.py [--dir /tmp] [--keep] [--case device_map|cuda|fsdp70b] [--warm]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_estimate import WARM_START_S, stop_servers, tree_rss, warm_env, xmem_slurm_command  # noqa: E402

from xmem.bench.page_cache import cached_bytes, evict  # noqa: E402
from xmem.trace import warm  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
SHARD_BYTES = 5 * 10**9  # what save_pretrained's max_shard_size="5GB" makes
CHUNK = 64 * MIB
TARGET_S, TARGET_RSS = 30.0, 2 * GIB
LLAMA_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                intermediate_size=11008, vocab_size=32000)
LLAMA_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 intermediate_size=28672, vocab_size=32000)
FSDP_TARGET_S, FSDP_TARGET_RSS = 60.0, 8 * GIB
# two nodes of 8 GPUs: AdamW over fp32 master weights takes 16 bytes per parameter, 69 GB per GPU at 16
FSDP_LAUNCH = ("--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=node1:29500")

FINETUNE = """
    import sys
    import torch
    from transformers import AutoModelForCausalLM

    path, placement = sys.argv[1], sys.argv[2]
    if placement == "device_map":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    model.gradient_checkpointing_enable()
    model.train()  # from_pretrained gives eval mode, where transformers' checkpointing is off
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for step in range(3):
        ids = torch.randint(0, 32000, (1, 1024), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.3f}")
"""


# the fine-tune of tests/scripts/accelerate_fsdp2_checkpoint.py, with a sequence of 1024 and checkpointing
FINETUNE_FSDP = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "accelerate_fsdp2_checkpoint.py"
FINETUNE_FSDP_ARGS = ("--seq", "1024", "--checkpointing")


def write_checkpoint(folder: Path, shape: dict = LLAMA_7B, sparse: bool = False) -> list[Path]:
    """A Llama checkpoint of `shape` in Hugging Face's layout (zeros written, or holes when `sparse`); returns its
    shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {name: list(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    config.save_pretrained(folder)
    shards: list[dict[str, list[int]]] = [{}]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        path = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_zero_shard(path, shard, sparse)
        paths.append(path)
        weight_map.update({name: path.name for name in shard})
    total = sum(2 * _numel(shape) for shape in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return paths


def _numel(shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _write_zero_shard(path: Path, shapes: dict[str, list[int]], sparse: bool = False) -> None:
    """The safetensors layout: 8-byte header length, JSON header (padded to 8 bytes), then the data (a hole of its
    size when `sparse`: reads as zeros, takes no disk)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    zeros = bytes(CHUNK)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        if sparse:
            file.truncate(8 + len(text) + offset)
            return
        for start in range(0, offset, CHUNK):
            file.write(zeros[: min(CHUNK, offset - start)])
        os.fsync(file.fileno())


def read_bytes_by_pid() -> dict[int, int]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                io = Path(f"/proc/{entry}/io").read_text()
            except OSError:
                continue
            found[int(entry)] = int(next(line.split()[1] for line in io.splitlines() if line.startswith("read_bytes")))
    return found


def server_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of the warm servers and their reaped children so far (/proc/PID/stat: utime, stime, cutime,
    cstime), for the job they forked."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(fields[i]) for i in (11, 12, 13, 14))
    return total / ticks


def run_estimate(script: Path, checkpoint: Path, placement: str, sockets: Path | None = None) -> dict:
    servers = warm.server_pids(sockets) if sockets else []
    if placement == "fsdp70b":  # cold unless --warm: the warm tracer's forked trace is outside the estimate's tree
        program = [str(Path(sys.executable).with_name("torchrun")), *FSDP_LAUNCH, str(FINETUNE_FSDP),
                   str(checkpoint), *FINETUNE_FSDP_ARGS]
        env = warm_env(sockets) if sockets else {**os.environ, "XMEM_WARM_TRACER": "0"}
    else:
        program, env = [sys.executable, str(script), str(checkpoint), placement], None
    command = [*xmem_slurm_command(), "estimate", "--json", "--gpu", "h200", "--iterations", "2", "--",
               *program]
    before = read_bytes_by_pid()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu_before = server_cpu_seconds(servers)
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    peak_tree, reads, done = 0, {}, threading.Event()

    def sample() -> None:
        nonlocal peak_tree
        while not done.is_set():
            peak_tree = max(peak_tree, tree_rss(process.pid), *(tree_rss(pid) for pid in servers))
            for pid, count in read_bytes_by_pid().items():
                reads[pid] = max(reads.get(pid, 0), count - before.get(pid, 0))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = process.communicate()
    seconds = time.perf_counter() - started
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the waited-for tree: the sandboxed trace included
    cpu_seconds = sum(getattr(cpu_after, f) - getattr(cpu_before, f) for f in ("ru_utime", "ru_stime"))
    cpu_seconds += server_cpu_seconds(servers) - server_cpu_before
    done.set()
    sampler.join()
    try:
        result = json.loads(stdout)
    except json.JSONDecodeError:
        result = {"error": "no JSON", "message": stderr.decode()[-2000:]}
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_tree_rss": peak_tree, "sampled_read_bytes": sum(reads.values()),
            "returncode": process.returncode, "result": result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the ~13.5 GB checkpoint is written")
    parser.add_argument("--case", choices=["device_map", "cuda", "fsdp70b"], action="append")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (and reuse one left there)")
    parser.add_argument("--warm", action="store_true", help="the 70B estimate through the warm tracer")
    args = parser.parse_args()
    cases = args.case or ["device_map", "cuda"]
    for placement in ("fsdp70b",) if "fsdp70b" in cases else ():
        if not args.warm:
            bench_case(Path(args.dir) / "xmem-bench-llama70b", [placement], args.keep, LLAMA_70B, "")
            continue
        with tempfile.TemporaryDirectory(prefix="xmem-bench-warm-") as name:
            sockets, folder = Path(name), Path(args.dir) / "xmem-bench-llama70b"
            try:  # the first finds no server for the launcher's environment: it runs cold and starts one
                print("first estimate (starts the warm server for the job's environment):")
                bench_case(folder, [placement], True, LLAMA_70B, "", sockets)
                wait_for_server(sockets)
                print("second estimate (through the warm server):")
                bench_case(folder, [placement], args.keep, LLAMA_70B, "", sockets)
            finally:
                stop_servers(sockets)
    seven_b = [c for c in cases if c != "fsdp70b"]
    if seven_b:
        bench_case(Path(args.dir) / "xmem-bench-llama7b", seven_b, args.keep, LLAMA_7B, FINETUNE)
    return 0


def wait_for_server(sockets: Path) -> None:
    """Until a warm server listens in `sockets` (it loads once the estimate that started it has ended)."""
    deadline = time.monotonic() + WARM_START_S
    while time.monotonic() < deadline and not list(sockets.glob("*.sock")):
        time.sleep(0.5)


def bench_case(folder: Path, placements: list[str], keep: bool, shape: dict, finetune: str,
               sockets: Path | None = None) -> None:
    """Write the checkpoint of `shape` in `folder` (sparse for the 70B), estimate each placement with the fine-tune
    `finetune` (its source; "" for the 70B's, a file of its own), delete the checkpoint."""
    sparse = shape is LLAMA_70B
    target_s, target_rss = (FSDP_TARGET_S, FSDP_TARGET_RSS) if sparse else (TARGET_S, TARGET_RSS)
    try:
        shards = sorted(folder.glob("*.safetensors")) if keep and folder.is_dir() else []
        if not shards:
            folder.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            shards = write_checkpoint(folder, shape, sparse)
            print(f"wrote {sum(p.stat().st_size for p in shards) / GIB:.1f} GiB{' (sparse)' if sparse else ''} in "
                  f"{len(shards)} shards ({time.perf_counter() - started:.0f} s)")
        script = folder / "finetune.py"  # the 70B's is a test's program (FINETUNE_FSDP), run from the folder
        if finetune:
            script.write_text(textwrap.dedent(finetune))
        for placement in placements:
            evict(shards)
            run = run_estimate(script, folder, placement, sockets)
            weight_read = cached_bytes(shards)
            ok = (run["returncode"] == 0 and run["seconds"] <= target_s and run["peak_tree_rss"] <= target_rss)
            print(f"{placement:<10} {run['seconds']:6.1f} s ({run['cpu_seconds']:.1f} s of CPU; load "
                  f"{os.getloadavg()[0]:.1f})  peak tree RSS {run['peak_tree_rss'] / MIB:6.0f} MiB  "
                  f"weight files read {weight_read / MIB:8.1f} MiB (page cache)  block reads of the tree "
                  f"{run['sampled_read_bytes'] / MIB:8.1f} MiB  {'meets' if ok else 'MISSES'} target")
            result = run["result"]
            if run["returncode"] != 0:
                print(f"  exit {run['returncode']}: {result.get('error')}: {result.get('message')}")
            else:
                parts = {k: round(v / GIB, 2) for k, v in result.get("breakdown", {}).items() if v >= GIB // 100}
                print(f"  H200 peak {result['gpus']['H200-141GB']['peak_bytes'] / GIB:.2f} GiB; GiB at the peak: "
                      f"{parts}")
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
