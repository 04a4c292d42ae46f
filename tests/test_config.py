"""Site config: loading, path resolution, defaults, and errors that name the key."""

import os
import time
from pathlib import Path

import pytest

from xmem.config import CONFIG_MAX_BYTES, ConfigError, SiteConfig, config_from_dict, load_site_config

EXAMPLE = Path(__file__).resolve().parents[1] / "etc" / "xmem.toml"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "xmem.toml"
    path.write_text(text)
    return path


def test_documented_example_matches_the_dev_cluster():
    config = load_site_config(EXAMPLE)
    assert config.partitions.gpu_types == {"debug": ("a100", "h100", "1g.10gb")}
    assert config.partitions.default == "debug"
    assert config.mig.profiles == {"h100": ("1g.10gb",)}
    assert config.mig.parent_of("1g.10gb") == "h100" and config.mig.parent_of("a100") is None
    assert (config.mps.enabled, config.mps.count_per_gpu, config.mps.gpu_types) == (True, 100, ("a100",))
    assert (config.shard.enabled, config.shard.per_gpu, config.shard.gpu_types) == (True, 4, ("h100", "1g.10gb"))
    assert config.margin.absolute_bytes == 256 * 2**20
    assert config.preference == ("mig", "shard", "mps", "gpu")
    assert (config.explicit_request, config.failure) == ("fill_generic", "open")
    assert config.source == str(EXAMPLE)


def test_every_key_of_the_example_is_commented():
    lines = EXAMPLE.read_text().splitlines()
    for index, line in enumerate(lines):
        if "=" in line and not line.startswith("#") and not line.startswith("["):
            assert lines[index - 1].startswith("#") or "#" in line, f"uncommented key: {line}"


def test_no_file_anywhere_gives_built_in_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("XMEM_CONFIG", raising=False)
    monkeypatch.setattr("xmem.config.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    config = load_site_config()
    assert config == SiteConfig()
    assert config.failure == "open" and config.margin.relative == 0.10


def test_environment_variable_names_the_file(monkeypatch, tmp_path):
    path = write(tmp_path, '[policy]\nfailure = "closed"\n')
    monkeypatch.setenv("XMEM_CONFIG", str(path))
    assert load_site_config().failure == "closed"


def test_the_filter_reads_the_site_config_never_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("XMEM_CONFIG", str(write(tmp_path, '[policy]\nfailure = "open"\n')))
    site = tmp_path / "site.toml"
    site.write_text('[policy]\nfailure = "closed"\n')
    monkeypatch.setattr("xmem.config.DEFAULT_CONFIG_PATH", site)
    assert load_site_config(user_env=False).failure == "closed"
    assert load_site_config().failure == "open"  # check and estimate: the user's own, for themselves


@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "directory", "too large", "not utf-8"])
def test_a_config_that_is_not_a_small_regular_text_file_is_refused_at_once(tmp_path, what):
    """A user's XMEM_CONFIG naming a FIFO or /dev/zero held sbatch 76-340 s: `check` still takes the user's, and
    must answer too."""
    path = tmp_path / "xmem.toml"
    if what == "fifo":
        os.mkfifo(path)
    elif what == "directory":
        path.mkdir()
    elif what == "too large":
        path.write_text("# padding\n" * (CONFIG_MAX_BYTES // 10 + 1))
    elif what == "not utf-8":
        path.write_bytes(b'[policy]\nfailure = "\xff"\n')
    else:
        path = Path(what)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=str(path)):
        load_site_config(path)
    assert time.monotonic() - started < 2


def test_explicit_path_wins_over_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XMEM_CONFIG", str(write(tmp_path, '[policy]\nfailure = "closed"\n')))
    other = tmp_path / "other.toml"
    other.write_text('[policy]\nfailure = "open"\n')
    assert load_site_config(other).failure == "open"


def test_missing_explicit_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="absent.toml: cannot read"):
        load_site_config(tmp_path / "absent.toml")


def test_bad_toml_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_site_config(write(tmp_path, "[mps\nenabled = true\n"))


@pytest.mark.parametrize("text, message", [
    ("[mps]\ncount = 100\n", "unknown key 'mps.count'; allowed here: enabled, count_per_gpu, gpu_types"),
    ("[sharding]\n", "unknown key 'sharding'"),
    ("[mps]\ncount_per_gpu = 0\n", "mps.count_per_gpu: must be a whole number above 0"),
    ("[shard]\nenabled = 'yes'\n", "shard.enabled: must be true or false"),
    ("[policy]\npreference = ['gpu', 'vgpu']\n", "policy.preference: 'vgpu' is not a request kind"),
    ("[policy]\npreference = ['gpu', 'gpu']\n", "at most once"),
    ("[policy]\nexplicit_request = 'ignore'\n", "policy.explicit_request: must be one of 'keep', 'fill_generic'"),
    ("[policy]\nfailure = 'maybe'\n", "policy.failure: must be one of 'open', 'closed'"),
    ("[margin]\nrelative = -0.1\n", "margin.relative"),
    ("[margin]\nabsolute_mib = 1\nabsolute_bytes = 1\n", "not both"),
    ("[estimate]\ntimeout_s = 0\n", "estimate.timeout_s"),
    ("[filter]\nput_off_margin_s = 0\n", "filter.put_off_margin_s: must be more than 0 seconds"),
    ("[partitions.gpu_types]\ndebug = 'a100'\n", "partitions.gpu_types.debug: must be a list"),
    ("[partitions]\ndefault = 'x'\nfrom_cluster = false\n[partitions.gpu_types]\ndebug = ['a100']\n",
     "partitions.default: 'x' is not one of the partitions"),
    ("[mig]\nh100 = ['1g.5gb']\n", "mig.h100: .*no MIG profile '1g.5gb'"),
    ("[mig]\nnot-a-gpu = ['1g.10gb']\n", "mig.not-a-gpu: unknown GPU type"),
    ("[deferred]\nmode = 'later'\n", "deferred.mode"),
    ("[partitions.gpu_types]\ndebug = ['a100', 'rtx9999']\n", "partitions.gpu_types.debug: unknown GPU type 'rtx9999'"),
    ("[partitions.gpu_types]\ndebug = ['2g.20gb']\n", "a MIG slice must be listed under \\[mig\\]"),
    ("[shard]\ngpu_types = ['nope']\n", "shard.gpu_types: unknown GPU type 'nope'"),
    ("[catalog.gpus.brandnew]\ntotal_bytes = 1\n", "catalog: .*needs total_bytes and capability"),
])
def test_bad_values_name_the_key_and_what_is_allowed(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_site_config(write(tmp_path, text))


def test_margin_needed_rounds_up_and_adds_the_absolute_part():
    config = config_from_dict({"margin": {"relative": 0.1, "absolute_mib": 1}})
    # 1000 * 1.1 = 1100 (+ 1 MiB = 1,048,576)
    assert config.margin.needed(1000) == 1100 + 1_048_576
    assert config_from_dict({"margin": {"relative": 0.5}}).margin.needed(3) == 5  # 4.5 rounds up


def test_catalog_overrides_are_kept_for_the_estimator():
    config = config_from_dict({"catalog": {"gpus": {"a100": {"total_bytes": 40 * 2**30}}}})
    assert config.catalog_overrides == {"gpus": {"a100": {"total_bytes": 40 * 2**30}}}


def test_with_partitions_adds_cluster_types_without_overriding_the_file():
    config = config_from_dict({"partitions": {"gpu_types": {"debug": ["a100"]}}})
    merged = config.with_partitions({"debug": ("h100",), "big": ("h100",)})
    assert merged.partitions.gpu_types == {"debug": ("a100",), "big": ("h100",)}


def test_deferred_section_is_parsed():
    config = config_from_dict({"deferred": {"mode": "partition", "cpu_partition": "cpu", "mem": "32G"}})
    assert (config.deferred.mode, config.deferred.cpu_partition, config.deferred.mem) == ("partition", "cpu", "32G")


def test_partition_mode_without_a_cpu_partition_is_refused():
    with pytest.raises(ConfigError, match="deferred.cpu_partition: required"):
        config_from_dict({"deferred": {"mode": "partition"}})


def test_warm_tracer_is_on_unless_the_site_turns_it_off(tmp_path):
    assert config_from_dict({}).estimate.warm_tracer is True
    assert config_from_dict({"estimate": {"warm_tracer": False}}).estimate.warm_tracer is False
    with pytest.raises(ConfigError, match="estimate.warm_tracer"):
        config_from_dict({"estimate": {"warm_tracer": "yes"}})
