"""What the cluster offers: partitions, their nodes, and each node's GRES (GPU types, MPS, shards).

Owns `ClusterInfo` and two backends behind `query_cluster`: the Slurm command line (always there: `sinfo --json`,
else `scontrol show -o node`, and `scontrol show -o partition`; every call under a timeout) and pyslurm, used only
when it imports and its version matches the cluster's Slurm (pyslurm's major.minor, e.g. 22.5, against
`sinfo -V`'s 22.05). The parsers are pure functions of the commands' text, tested on captured real output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from xmem.jobscript import GresItem
from xmem.slurm.scontrol import parse_scontrol_record
from xmem.text import ascii_whole_number

COMMAND_TIMEOUT_S = 10.0
GPU_GRES = "gpu"
SHARED_GRES = ("mps", "shard")

Runner = Callable[[Sequence[str]], str]


class ClusterError(RuntimeError):
    """Slurm could not be asked (command missing, controller down, timeout, output not understood)."""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    partitions: tuple[str, ...]
    gres: tuple[GresItem, ...]
    state: str = ""
    version: str | None = None  # the node's slurmd release


@dataclass(frozen=True)
class ClusterInfo:
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    partitions: tuple[str, ...] = ()
    default_partition: str | None = None
    slurm_version: str | None = None
    backend: str = "cli"

    @property
    def gpu_types(self) -> dict[str, tuple[str, ...]]:
        """Per partition, the typed `gpu` GRES its nodes offer (MIG slices included), in the order first seen."""
        types: dict[str, list[str]] = {p: [] for p in self.partitions}
        for node in self.nodes.values():
            for partition in node.partitions:
                seen = types.setdefault(partition, [])
                for item in node.gres:
                    if item.name == GPU_GRES and item.type and item.count > 0 and item.type not in seen:
                        seen.append(item.type)
        return {p: tuple(t) for p, t in types.items()}

    def gres_counts(self, partition: str) -> dict[str, dict[str, int]]:
        """Per GRES name and type, the most any one node of `partition` has: {"gpu": {"a100": 2}, "mps": ...}."""
        counts: dict[str, dict[str, int]] = {}
        for node in self.nodes.values():
            if partition not in node.partitions:
                continue
            for item in node.gres:
                per_type = counts.setdefault(item.name, {})
                key = item.type or ""
                per_type[key] = max(per_type.get(key, 0), item.count)
        return counts

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "slurm_version": self.slurm_version, "partitions": list(self.partitions),
                "default_partition": self.default_partition, "gpu_types": {k: list(v) for k, v in
                                                                           self.gpu_types.items()},
                "nodes": {n.name: {"partitions": list(n.partitions), "gres": [str(g) for g in n.gres],
                                   "state": n.state} for n in self.nodes.values()}}


def query_cluster(backend: str = "auto", *, run: Runner | None = None) -> ClusterInfo:
    """Ask Slurm. backend: "auto" (pyslurm if it matches the cluster, else the CLI), "cli" or "pyslurm"."""
    if backend not in ("auto", "cli", "pyslurm"):
        raise ValueError(f"unknown backend {backend!r}; use auto, cli or pyslurm")
    if run is None:
        run = run_command
        conf = os.environ.get("SLURM_CONF")
        if conf and not os.path.isfile(conf):  # the commands would hang on a DNS lookup until their timeout
            raise ClusterError(f"SLURM_CONF={conf} does not exist")
    if backend in ("auto", "pyslurm"):
        pyslurm = _matching_pyslurm(run)
        if pyslurm is not None:
            return from_pyslurm(pyslurm.node().get(), pyslurm.partition().get(), version=pyslurm.version())
        if backend == "pyslurm":
            raise ClusterError("pyslurm is not installed, or does not match this cluster's Slurm version")
    return query_cli(run)


def ask_slurm() -> ClusterInfo | None:
    """What Slurm says; None when it cannot be asked from here (no Slurm client, controller down): the cluster
    source the analysis is handed (`xmem.analyze.analyze_job(cluster=...)`), which never asks Slurm itself."""
    try:
        return query_cluster()
    except ClusterError:
        return None


def query_cli(run: Runner) -> ClusterInfo:
    """Two commands when Slurm answers; one timeout when it does not (a failure stops the queries)."""
    try:
        sinfo = run(["sinfo", "--json"])
    except ClusterError as e:
        if "unrecognized option" not in str(e):
            raise
        sinfo = None  # Slurm before 21.08 has no --json
    if sinfo is not None and sinfo.lstrip().startswith("{"):
        data = _load_sinfo_json(sinfo)  # parsed once: megabytes on a large cluster
        nodes, version = _sinfo_nodes(data), sinfo_json_version(data)
    else:
        nodes, version = parse_scontrol_nodes(run(["scontrol", "show", "-o", "node"])), None
    partitions, default = parse_scontrol_partitions(run(["scontrol", "show", "-o", "partition"]))
    if version is None:
        version = next((n.version for n in nodes if n.version), None)
    return ClusterInfo(nodes={n.name: n for n in nodes}, partitions=partitions, default_partition=default,
                       slurm_version=version, backend="cli")


def run_command(argv: Sequence[str]) -> str:
    """Run one Slurm client command under a timeout: a down controller makes them retry for minutes."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise ClusterError(f"{argv[0]} not found: is the Slurm client installed and on PATH?") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(argv)} did not answer within {COMMAND_TIMEOUT_S:g} s "
                           "(is slurmctld up?)") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ClusterError(f"{' '.join(argv)} failed: {last}")
    return done.stdout


# What sbatch says when it could not ask the controller (no config, controller or munge down): no refusal known.
UNREACHABLE = re.compile(r"fatal:|unable to contact|socket timed out|connect|zero bytes|can't be reached|"
                         r"authenticat|talking to database|configuration source", re.IGNORECASE)


def test_only_refusal(options: Sequence[str], run: Callable[..., subprocess.CompletedProcess] = subprocess.run
                      ) -> str | None:
    """Why Slurm would refuse a job of `options` (`sbatch --test-only`: the controller checks it against its
    partitions and nodes without queueing it), or None when it would take it or cannot be asked (then nothing is
    known against it). Runs without the SBATCH_* variables, which would add options, and without xmem's filter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBATCH_")}
    try:
        done = run(["sbatch", "--test-only", *options, "--wrap=true"], capture_output=True, text=True,
                   timeout=COMMAND_TIMEOUT_S, env={**env, "XMEM_NO_FILTER": "1"}, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode == 0 or UNREACHABLE.search(done.stderr):
        return None
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return lines[-1].removeprefix("sbatch: error: ").strip() if lines else f"exit status {done.returncode}"


# -- parsers ----------------------------------------------------------------------------------------------------

def parse_version(text: str) -> str | None:
    """`slurm-wlm 22.05.8` / `slurm 23.11.1` -> "22.05.8"."""
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    return ".".join(match.groups()) if match else None


def parse_gres_list(text: str | None) -> tuple[GresItem, ...]:
    """A node's configured GRES as Slurm prints it: `gpu:a100:2(S:0-1),mps:a100:200,shard:h100:4`."""
    if not text or text in ("(null)", "N/A"):
        return ()
    items = []
    for raw in re.sub(r"\([^)]*\)", "", text).split(","):
        parts = [p for p in raw.strip().split(":") if p]
        if not parts:
            continue
        count = ascii_whole_number(parts[-1]) if len(parts) > 1 else None
        gres_type = parts[1] if len(parts) == 3 or (len(parts) == 2 and count is None) else None
        count = 1 if count is None else count
        items.append(GresItem(parts[0], gres_type, count))
    return tuple(items)


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """`sinfo --json` (openapi v0.0.38 in 22.05; later versions keep `nodes[].name/gres/partitions/state`)."""
    return _sinfo_nodes(_load_sinfo_json(text))


def _load_sinfo_json(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterError(f"sinfo --json printed something that is not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise ClusterError("sinfo --json has no nodes list")
    return data


def _sinfo_nodes(data: Mapping[str, Any]) -> list[NodeInfo]:
    nodes = []
    for node in data["nodes"]:
        state = node.get("state", "")
        if isinstance(state, list):  # 23.02+: a list of flags
            state = ",".join(state)
        nodes.append(NodeInfo(name=str(node.get("name") or node.get("hostname")),
                              partitions=tuple(node.get("partitions") or ()),
                              gres=parse_gres_list(node.get("gres")), state=str(state).lower(),
                              version=node.get("version") or None))
    return nodes


def sinfo_json_version(data: Mapping[str, Any]) -> str | None:
    """`meta.Slurm.release` (22.05: "22.05.8"), or `meta.slurm.release` in later versions."""
    meta = data.get("meta", {})
    slurm = meta.get("Slurm") or meta.get("slurm") or {}
    release = slurm.get("release") if isinstance(slurm, dict) else None
    return parse_version(release) if isinstance(release, str) else None


def parse_scontrol_nodes(text: str) -> list[NodeInfo]:
    nodes = []
    for line in text.splitlines():
        record = parse_scontrol_record(line)
        if "NodeName" not in record:
            continue
        partitions = tuple(p for p in record.get("Partitions", "").split(",") if p)
        nodes.append(NodeInfo(name=record["NodeName"], partitions=partitions,
                              gres=parse_gres_list(record.get("Gres")), state=record.get("State", "").lower(),
                              version=record.get("Version")))
    return nodes


def parse_scontrol_partitions(text: str) -> tuple[tuple[str, ...], str | None]:
    names, default = [], None
    for line in text.splitlines():
        record = parse_scontrol_record(line)
        if "PartitionName" not in record:
            continue
        names.append(record["PartitionName"])
        if record.get("Default") == "YES":
            default = record["PartitionName"]
    return tuple(names), default


def from_pyslurm(nodes: Mapping[str, Mapping[str, Any]], partitions: Mapping[str, Mapping[str, Any]],
                 version: str | None = None) -> ClusterInfo:
    """pyslurm 22.5's `node().get()` and `partition().get()` dictionaries."""
    infos = {}
    for name, node in nodes.items():
        gres = node.get("gres") or ()
        gres_text = ",".join(gres) if isinstance(gres, (list, tuple)) else str(gres)
        infos[name] = NodeInfo(name=name, partitions=tuple(node.get("partitions") or ()),
                               gres=parse_gres_list(gres_text), state=str(node.get("state", "")).lower())
    default = next((name for name, p in partitions.items() if _is_default(p)), None)
    return ClusterInfo(nodes=infos, partitions=tuple(partitions), default_partition=default,
                       slurm_version=version, backend="pyslurm")


def _is_default(partition: Mapping[str, Any]) -> bool:
    flags = partition.get("flags")
    if isinstance(flags, Mapping):
        return bool(flags.get("Default") or flags.get("default"))
    return bool(partition.get("default"))


def _matching_pyslurm(run: Runner) -> Any:
    try:
        import pyslurm  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        cluster = parse_version(run(["sinfo", "-V"]))
    except ClusterError:
        return None
    return pyslurm if versions_match(str(pyslurm.version()), cluster) else None


def versions_match(pyslurm_version: str, slurm_version: str | None) -> bool:
    """pyslurm is numbered after the Slurm release it binds: 22.5.x for 22.05, 25.11.x for 25.11."""
    if not slurm_version:
        return False
    p, s = pyslurm_version.split("."), slurm_version.split(".")
    return len(p) >= 2 and len(s) >= 2 and p[0] == s[0] and int(p[1]) == int(s[1])
