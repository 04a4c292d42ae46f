"""Cluster queries: parsers on output captured from a real Slurm 22.05.8 (tests/data/slurm/: the dev cluster's
node with gpu:a100:2, gpu:h100:1, gpu:1g.10gb:1, mps:200, shard:8, partitions debug (default) and big), and the
CLI backend against a live single-node cluster when Slurm is installed."""

import dataclasses
import importlib.util
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from xmem.jobscript import GresItem
from xmem.slurm.cluster import (ClusterError, from_pyslurm, parse_gres_list, parse_scontrol_nodes,
                                parse_scontrol_partitions, parse_sinfo_json, parse_version, query_cluster,
                                run_command, versions_match)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "slurm"
CAPTURED = {
    ("sinfo", "-V"): "sinfo-V.txt",
    ("sinfo", "--json"): "sinfo.json",
    ("scontrol", "show", "-o", "partition"): "scontrol-partition.txt",
    ("scontrol", "show", "-o", "node"): "scontrol-node.txt",
}
NODE_GRES = (GresItem("gpu", "a100", 2), GresItem("gpu", "h100", 1), GresItem("gpu", "1g.10gb", 1),
             GresItem("mps", "a100", 200), GresItem("mps", "h100", 0), GresItem("mps", "1g.10gb", 0),
             GresItem("shard", "a100", 0), GresItem("shard", "h100", 4), GresItem("shard", "1g.10gb", 4))


def captured(argv):
    return (DATA / CAPTURED[tuple(argv)]).read_text()


def test_sinfo_json_nodes():
    [node] = parse_sinfo_json(captured(["sinfo", "--json"]))
    assert (node.name, node.partitions, node.state) == ("localhost", ("debug", "big"), "idle")
    assert node.gres == NODE_GRES


def test_scontrol_nodes_give_the_same_as_sinfo_json():
    [from_scontrol] = parse_scontrol_nodes(captured(["scontrol", "show", "-o", "node"]))
    [from_sinfo] = parse_sinfo_json(captured(["sinfo", "--json"]))
    assert from_scontrol.version == "22.05.8" and from_sinfo.version is None  # sinfo --json has it in meta only
    assert dataclasses.replace(from_scontrol, version=None) == from_sinfo


def test_scontrol_partitions_and_the_default():
    assert parse_scontrol_partitions(captured(["scontrol", "show", "-o", "partition"])) == (("debug", "big"), "debug")


def test_version():
    assert parse_version(captured(["sinfo", "-V"])) == "22.05.8"


def test_gres_list_with_socket_binding_and_untyped_items():
    assert parse_gres_list("gpu:a100:4(S:0-1),gpu:2,mps:400,(null)") == (
        GresItem("gpu", "a100", 4), GresItem("gpu", None, 2), GresItem("mps", None, 400))
    assert parse_gres_list("(null)") == ()


def test_gpu_types_per_partition_from_the_cli_backend():
    info = query_cluster("cli", run=captured)
    assert info.gpu_types == {"debug": ("a100", "h100", "1g.10gb"), "big": ("a100", "h100", "1g.10gb")}
    assert (info.default_partition, info.slurm_version, info.backend) == ("debug", "22.05.8", "cli")
    assert info.gres_counts("debug")["mps"] == {"a100": 200, "h100": 0, "1g.10gb": 0}
    assert info.gres_counts("debug")["shard"]["h100"] == 4


def test_cli_backend_falls_back_to_scontrol_when_sinfo_has_no_json():
    def old_slurm(argv):
        if argv == ["sinfo", "--json"]:
            raise ClusterError("sinfo --json failed: sinfo: unrecognized option '--json'")
        return captured(argv)

    info = query_cluster("cli", run=old_slurm)
    assert info.gpu_types["debug"] == ("a100", "h100", "1g.10gb")
    assert info.slurm_version == "22.05.8"  # from the nodes' Version=


def test_an_unreachable_controller_costs_one_command():
    calls = []

    def down(argv):
        calls.append(argv)
        raise ClusterError(f"{' '.join(argv)} did not answer within 10 s (is slurmctld up?)")

    with pytest.raises(ClusterError, match="did not answer"):
        query_cluster("cli", run=down)
    assert calls == [["sinfo", "--json"]]


def test_a_missing_slurm_conf_fails_at_once(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))
    with pytest.raises(ClusterError, match="absent.conf does not exist"):
        query_cluster("cli")


def test_a_failing_command_is_a_cluster_error_naming_it():
    with pytest.raises(ClusterError, match="definitely-not-a-slurm-command not found"):
        run_command(["definitely-not-a-slurm-command"])
    with pytest.raises(ClusterError, match="failed: boom"):
        run_command(["sh", "-c", "echo boom >&2; exit 3"])


def test_pyslurm_backend_is_refused_when_pyslurm_is_absent():
    if importlib.util.find_spec("pyslurm") is not None:  # PyPI has no pyslurm for Slurm 22.05
        pytest.skip("pyslurm is installed here")
    with pytest.raises(ClusterError, match="pyslurm is not installed"):
        query_cluster("pyslurm", run=captured)
    assert query_cluster("auto", run=captured).backend == "cli"


def test_pyslurm_dictionaries():
    # The shape of pyslurm 22.5's node().get() / partition().get() (see notes/slurm-local.md §10).
    nodes = {"localhost": {"gres": ["gpu:a100:2", "gpu:h100:1", "mps:a100:200"], "partitions": ["debug"],
                           "state": "IDLE"}}
    partitions = {"debug": {"flags": {"Default": True}}, "big": {"flags": {"Default": False}}}
    info = from_pyslurm(nodes, partitions, version="22.5.3")
    assert info.gpu_types == {"debug": ("a100", "h100"), "big": ()}
    assert (info.default_partition, info.backend) == ("debug", "pyslurm")


def test_pyslurm_version_must_match_the_clusters_release():
    assert versions_match("22.5.3", "22.05.8")
    assert not versions_match("25.11.2", "22.05.8")
    assert not versions_match("22.5.3", None)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        query_cluster("rest")


def free_port_pair() -> int:
    """A port N with N and N + 1 free (the dev cluster script puts slurmd on N + 1)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.slurm
def test_live_cluster_through_the_cli(tmp_path, monkeypatch):
    if not all(shutil.which(n) for n in ("slurmctld", "slurmd", "sinfo", "munged")) or os.geteuid() != 0:
        pytest.skip("needs Slurm installed and root (scripts/slurm-dev-cluster.sh)")
    script = REPO / "scripts" / "slurm-dev-cluster.sh"
    lab = tmp_path / "lab"
    port = str(free_port_pair())
    up = subprocess.run(["bash", str(script), "up", "--lab", str(lab), "--port", port], capture_output=True,
                        text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stderr
        exports = dict(re.findall(r"(\w+)=(\S+)", up.stdout.strip().splitlines()[-1].removeprefix("export ")))
        monkeypatch.setenv("SLURM_CONF", exports["SLURM_CONF"])
        info = query_cluster("cli")
        assert info.gpu_types["debug"] == ("a100", "h100", "1g.10gb")
        assert info.default_partition == "debug"
        assert info.slurm_version and info.slurm_version.startswith("22.05")
    finally:
        subprocess.run(["bash", str(script), "down", "--lab", str(lab)], capture_output=True, timeout=120)
