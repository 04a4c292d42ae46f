"""Figures for `xmem-slurm fit` (issue 11 item 2): its limits, traces and seconds on a job, against the limits found
by brute force over full estimates (a bisection on estimates per offer, from nothing: no growth model).

    python scripts/bench_fit.py --vary batch-size=1..256 --gpu a100 --config etc/xmem.toml \\
        [--brute whole] -- python benchmarks/jobs/transformer.py --model openai-community/gpt2 \\
        --optimizer AdamW --batch-size {}

`--brute OPTION` (repeatable) limits the brute force to those offers (it costs about log2(range) estimates each);
`--width W` stops its bisection at a bracket of W values (coarse, when time is short). Prints one JSON line.
The committed figures: benchmarks/results/dev-fit/FIT.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xmem.cli.fit import search  # noqa: E402
from xmem.config import load_site_config  # noqa: E402
from xmem.estimate import estimate  # noqa: E402
from xmem.fit import command_at, parse_vary  # noqa: E402
from xmem.gpus import find_gpu  # noqa: E402
from xmem.policy import job_peak  # noqa: E402


def brute_force(command, vary, site, option, gpu_name, settings, width, cache):
    """Bisection on full estimates: (largest value known to fit, smallest known not to), estimates, seconds."""
    started, used = time.perf_counter(), 0
    low, high = vary.low - 1, vary.high + 1
    while high - low > width:
        mid = (low + high) // 2
        if mid not in cache:
            cache[mid] = estimate(command_at(command, vary, mid), gpus=[gpu_name], **settings)
            used += 1
        fits = site.margin.needed(job_peak(cache[mid].gpus[gpu_name])) <= option.usable_bytes
        low, high = (mid, high) if fits else (low, mid)
    return low, high, used, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vary", required=True)
    parser.add_argument("--gpu", required=True, help="one GPU type")
    parser.add_argument("--config", required=True)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--brute", action="append", help="offers to brute-force (default: all)")
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--no-brute", action="store_true", help="only fit (the brute force known already)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    site, vary = load_site_config(args.config), parse_vary(args.vary)
    settings = {"iterations": args.iterations}
    result, options = search(command, vary, site, [args.gpu], settings)
    if args.no_brute:
        print(json.dumps({"command": command, "gpu": args.gpu, "fit": result.to_json()}))
        return
    catalog = site.catalog()
    gpu_name, cache = find_gpu(args.gpu, catalog).name, {}
    brute = {}
    for option in options:
        if args.brute and option.name not in args.brute:
            continue
        low, high, used, seconds = brute_force(command, vary, site, option, gpu_name,
                                               {**settings, "settings": site.estimate_settings(catalog)}, args.width,
                                               cache)
        brute[option.name] = {"fits": low if low >= vary.low else None, "does_not_fit": high,
                              "estimates": used, "seconds": round(seconds, 1)}
    print(json.dumps({"command": command, "gpu": args.gpu, "fit": result.to_json(), "brute_force": brute,
                      "brute_force_estimates": len(cache), "width": args.width}))


if __name__ == "__main__":
    main()
