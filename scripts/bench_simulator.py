#!/usr/bin/env python
"""Measure the allocator simulator's replay speed (ops/s) on a synthetic transformer-like training trace.

The trace mimics what the trace stage records for a decoder transformer trained with AdamW: parameters created
once; per iteration a forward pass whose activations are kept until backward, temporaries freed soon after use,
a backward pass that frees activations in reverse and creates gradients (kept from the first iteration on), and
an optimizer step that creates its state lazily on the first step and uses foreach temporaries. Sizes mix a few
big ones (weights, activations, logits) with many small ones (biases, norms, per-token statistics, scalars).
A side stream (stream 1) carries the input batch copies and gradient-bucket buffers.

    .venv/bin/python scripts/bench_simulator.py [--layers 24] [--iterations 250] [--repeat 3] [--vary-seq]
        [--config "expandable_segments:True"] [--limits 8]

Prints the number of ops, the best replay time over the repeats (wall clock and process CPU time), ops/s, and the
simulated peaks. `--limits K` also times K replays under capacities from 10 % to 90 % of the peak reserved (GPU
types too small for the job): one `simulate` each against `simulate_limits` sharing them, which must agree.
"""

from __future__ import annotations

import argparse
import random
import time

from xmem.simulate import ALLOC, EMPTY_CACHE, FREE, AllocatorConfig, simulate, simulate_limits

FLOAT = 4


class TraceBuilder:
    """Hands out block ids and records ops."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, int, int, int]] = []
        self.next_id = 0

    def alloc(self, nbytes: int, stream: int = 0) -> int:
        self.next_id += 1
        self.ops.append((ALLOC, self.next_id, nbytes, stream))
        return self.next_id

    def free(self, block: int) -> None:
        self.ops.append((FREE, block, 0, 0))

    def temporaries(self, sizes: list[int]) -> None:
        """Allocate and free a handful of short-lived buffers (kernel outputs consumed at once)."""
        blocks = [self.alloc(size) for size in sizes]
        for block in reversed(blocks):
            self.free(block)


def transformer_trace(layers: int, iterations: int, batch: int, seq: int, hidden: int, vocab: int,
                      vary_seq: bool = False, seed: int = 0) -> list[tuple[int, int, int, int]]:
    rng = random.Random(seed)
    t = TraceBuilder()
    layer_params = [hidden * 3 * hidden, 3 * hidden, hidden * hidden, hidden, 4 * hidden * hidden, 4 * hidden,
                    4 * hidden * hidden, hidden, hidden, hidden, hidden, hidden]
    param_sizes = [vocab * hidden, seq * hidden] + layer_params * layers + [hidden, hidden]
    params = [t.alloc(n * FLOAT) for n in param_sizes]
    grads: list[int] = []
    optimizer_state: list[int] = []
    for _ in range(iterations):
        # batches padded to their longest row: the sequence length, and every activation size, changes per step
        tokens = batch * (rng.randint(seq // 2, seq) if vary_seq else seq)
        act = tokens * hidden * FLOAT
        batch_block = t.alloc(tokens * 8, stream=1)  # input ids copied on the side stream
        labels = t.alloc(tokens * 8, stream=1)
        kept: list[list[int]] = []
        x = t.alloc(act)
        for _ in range(layers):  # forward: keep what backward needs
            saved = [t.alloc(act), t.alloc(tokens * FLOAT), t.alloc(tokens * FLOAT)]  # norm out, mean, rstd
            qkv = t.alloc(3 * act)
            t.temporaries([act, tokens * FLOAT, 512])
            attn = t.alloc(act)
            lse = t.alloc(16 * tokens * FLOAT)  # attention log-sum-exp, 16 heads
            proj = t.alloc(act)
            t.free(x)
            x = t.alloc(act)
            t.free(proj)
            saved += [qkv, attn, lse, t.alloc(act), t.alloc(tokens * FLOAT), t.alloc(tokens * FLOAT)]
            up = t.alloc(4 * act)
            gelu = t.alloc(4 * act)
            t.temporaries([4 * act, rng.choice([512, 1024, 4096])])
            down = t.alloc(act)
            t.free(x)
            x = t.alloc(act)
            t.free(down)
            saved += [up, gelu]
            kept.append(saved)
        logits = t.alloc(tokens * vocab * FLOAT)
        t.temporaries([tokens * vocab * FLOAT, tokens * FLOAT, 512, 512])
        loss = t.alloc(512)
        grad_x = t.alloc(act)
        t.free(logits)
        first_step = not grads  # gradients are created by the first backward and kept (zero_grad sets to zero)
        new_grads: list[int] = []

        def grad_for(nbytes: int) -> None:
            if first_step:
                new_grads.append(t.alloc(nbytes))

        grad_for(param_sizes[0] * FLOAT)
        for layer in reversed(range(layers)):  # backward: free activations in reverse, make gradients
            for n in reversed(layer_params):
                grad_for(n * FLOAT)
            t.temporaries([4 * act, 4 * act, act, tokens * FLOAT])
            for block in reversed(kept[layer]):
                t.free(block)
            g = t.alloc(act)
            t.temporaries([3 * act, act, rng.choice([512, 2048, 8192])])
            t.free(grad_x)
            grad_x = g
            if layer % 4 == 0:  # a gradient bucket copied on the side stream
                bucket = t.alloc(25 * 1024 * 1024, stream=1)
                t.free(bucket)
        t.free(grad_x)
        t.free(x)
        t.free(loss)
        if first_step:
            grads = new_grads
        if not optimizer_state:  # AdamW state created lazily on the first step
            optimizer_state = [t.alloc(n * FLOAT) for n in param_sizes for _ in range(2)]
        for chunk in range(0, len(param_sizes), 24):  # foreach temporaries, one list per chunk
            t.temporaries([n * FLOAT for n in param_sizes[chunk:chunk + 24]])
        t.free(batch_block)
        t.free(labels)
    for block in params + grads + optimizer_state:
        t.free(block)
    t.ops.append((EMPTY_CACHE, 0, 0, 0))
    return t.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--iterations", type=int, default=250)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--vary-seq", action="store_true", help="a new sequence length (seq/2..seq) every step")
    parser.add_argument("--config", default="", help="allocator settings, as in PYTORCH_CUDA_ALLOC_CONF")
    parser.add_argument("--limits", type=int, default=0, help="also time K limited replays, alone and shared")
    args = parser.parse_args()
    ops = transformer_trace(args.layers, args.iterations, args.batch, args.seq, args.hidden, args.vocab,
                            args.vary_seq)
    config = AllocatorConfig.parse(args.config)
    best = best_cpu = float("inf")
    for _ in range(args.repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = simulate(ops, config)
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    gib = 1024**3
    print(f"ops: {len(ops):,}  config: {args.config or '(defaults)'}{'  varying seq' if args.vary_seq else ''}")
    print(f"replay: {best:.3f} s wall, {best_cpu:.3f} s CPU (best of {args.repeat})  ->  {len(ops) / best:,.0f} ops/s "
          f"wall, {len(ops) / best_cpu:,.0f} ops/s CPU (the CPU figure is steadier on a shared machine)")
    print(f"peak allocated {result.peak_allocated / gib:.2f} GiB, peak reserved {result.peak_reserved / gib:.2f} GiB, "
          f"segments at peak {result.num_segments_at_peak}, fragmentation {result.fragmentation_at_peak:.1%}")
    if args.limits:
        time_limits(ops, config, result.peak_reserved, args.limits)


def time_limits(ops: list, config: AllocatorConfig, peak: int, count: int) -> None:
    limits = {(int(peak * (0.1 + 0.8 * i / max(1, count - 1))), 2 * peak) for i in range(count)}
    start = time.process_time()
    simulate(ops, config)  # an estimate needs the unlimited replay for the GPU types the job fits either way
    alone = {limit: simulate(ops, config, capacity=limit[0], device_total=limit[1]) for limit in limits}
    alone_cpu = time.process_time() - start
    start = time.process_time()
    _, shared = simulate_limits(ops, config, limits)
    shared_cpu = time.process_time() - start
    assert shared == alone, "simulate_limits disagrees with one replay per limit"
    print(f"the unlimited replay and {len(limits)} limited ones: {alone_cpu:.3f} s CPU one by one, "
          f"{shared_cpu:.3f} s CPU shared, same results")


if __name__ == "__main__":
    main()
