"""The GPU catalog: names, totals as the driver reports them, MIG profiles, overheads and their overrides."""

from pathlib import Path

import pytest

from xmem.gpus import (
    CatalogError,
    UnknownGpuError,
    cublas_workspace_bytes,
    find_gpu,
    load_catalog,
    mig_profile,
    overhead_bytes,
)

MIB = 1 << 20
GIB = 1 << 30


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(calibration_path=None)


REQUIRED = ["A100-SXM4-40GB", "A100-PCIE-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H100-PCIE-80GB", "H200-141GB",
            "L40S", "A10", "V100-16GB", "V100-32GB", "T4", "RTX-3060-12GB", "RTX-4060-8GB", "RTX-4090"]


def test_catalog_has_every_required_type(catalog):
    assert set(REQUIRED) <= set(catalog)


@pytest.mark.parametrize("name, canonical", [
    ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
    ("a100", "A100-SXM4-40GB"),
    ("A100", "A100-SXM4-40GB"),
    ("a100_80gb", "A100-SXM4-80GB"),
    ("h100", "H100-SXM5-80GB"),
    ("NVIDIA H100 80GB HBM3", "H100-SXM5-80GB"),
    ("nvidia geforce rtx 3060", "RTX-3060-12GB"),
    ("NVIDIA GeForce RTX 4060", "RTX-4060-8GB"),
    ("Tesla V100-SXM2-32GB", "V100-32GB"),
    ("Tesla T4", "T4"),
    ("l40s", "L40S"),
    ("h200", "H200-141GB"),
    ("rtx-4090", "RTX-4090"),
])
def test_find_gpu_matches_aliases_case_insensitively(catalog, name, canonical):
    assert find_gpu(name, catalog).name == canonical


def test_unknown_gpu_error_lists_known_names(catalog):
    with pytest.raises(UnknownGpuError) as e:
        find_gpu("MI300X", catalog)
    message = str(e.value)
    assert "'MI300X'" in message and "A100-SXM4-40GB" in message and "\n" not in message


def test_totals_measured_on_real_gpus_are_exact(catalog):
    # The three totals measured by NVML in shared/data/xmem-dev.jsonl.
    assert catalog["RTX-3060-12GB"].total_bytes == 12_622_168_064
    assert catalog["RTX-4060-8GB"].total_bytes == 8_318_222_336
    assert catalog["A100-SXM4-40GB"].total_bytes == 42_474_471_424


def test_public_totals_are_nvidia_smi_mib(catalog):
    assert catalog["H200-141GB"].total_bytes == 143_771 * MIB
    assert catalog["RTX-4090"].total_bytes == 24_564 * MIB


def test_capabilities(catalog):
    assert catalog["H100-SXM5-80GB"].capability == (9, 0)
    assert catalog["A100-SXM4-80GB"].capability == (8, 0)
    assert catalog["V100-16GB"].capability == (7, 0)
    assert catalog["T4"].capability == (7, 5)
    assert catalog["RTX-4060-8GB"].capability == (8, 9)


def test_a100_40gb_mig_profiles(catalog):
    gpu = catalog["A100-SXM4-40GB"]
    assert [p.name for p in gpu.mig_profiles] == ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
    profile = mig_profile(gpu, "MIG 3g.20gb")
    assert profile.compute_slices == 3
    assert profile.memory_bytes == round(19.62 * GIB)
    assert mig_profile(gpu, "1G.5GB").memory_bytes == 4864 * MIB  # 4.75 GiB


def test_a100_80gb_and_hopper_mig_profiles(catalog):
    names = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    for gpu in ("A100-SXM4-80GB", "H100-SXM5-80GB", "H100-PCIE-80GB"):
        assert [p.name for p in catalog[gpu].mig_profiles] == names
    assert [p.name for p in catalog["H200-141GB"].mig_profiles][-1] == "7g.141gb"


def test_mig_profile_unknown_or_no_mig(catalog):
    with pytest.raises(UnknownGpuError, match="no MIG"):
        mig_profile(catalog["T4"], "1g.5gb")
    with pytest.raises(UnknownGpuError, match="1g.5gb"):
        mig_profile(catalog["A100-SXM4-40GB"], "1g.10gb")


def test_overhead_adds_only_the_libraries_the_job_used(catalog):
    gpu = catalog["A100-SXM4-40GB"]
    libs = gpu.libraries
    assert overhead_bytes(gpu, []) == gpu.context_bytes == 446_693_376
    assert overhead_bytes(gpu, ["cublas"]) == 446_693_376 + libs["cublas"]
    both = overhead_bytes(gpu, ["cublas", "cudnn", "cublas", "unknown-lib"])
    assert both == 446_693_376 + libs["cublas"] + libs["cudnn"]


def test_cublas_workspace_size_per_architecture(catalog):
    assert cublas_workspace_bytes(catalog["A100-SXM4-40GB"]) == 8_519_680
    assert cublas_workspace_bytes(catalog["T4"]) == 8_519_680
    assert cublas_workspace_bytes(catalog["H100-SXM5-80GB"]) == 32 * MIB


def test_cublas_workspace_config_env_wins(catalog):
    h100 = catalog["H100-SXM5-80GB"]
    assert cublas_workspace_bytes(h100, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MIB
    assert cublas_workspace_bytes(h100, {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8_519_680
    assert cublas_workspace_bytes(h100, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 16 * 1024 * 8
    assert cublas_workspace_bytes(h100, {"OTHER": "x"}) == 32 * MIB


def test_site_override_changes_a_type_and_adds_one():
    catalog = load_catalog({
        "gpus": {"tesla t4": {"total_bytes": 15_000 * MIB},
                 "GB300": {"total_bytes": 270 * GIB, "capability": [10, 3], "aliases": ["gb300"]}},
        "overhead": {"default": {"context_bytes": 500 * MIB}, "gb300": {"context_bytes": 700 * MIB}},
    }, calibration_path=None)
    assert catalog["T4"].total_bytes == 15_000 * MIB
    assert catalog["T4"].context_bytes == 500 * MIB
    assert find_gpu("gb300", catalog).context_bytes == 700 * MIB
    assert catalog["GB300"].libraries["cublas"] == catalog["T4"].libraries["cublas"]  # defaults still apply


def test_calibration_file_overrides_defaults_and_keeps_provenance(tmp_path: Path):
    calibration = tmp_path / "calibration.toml"
    calibration.write_text(
        '[overhead."RTX-3060-12GB"]\n'
        "context_bytes = 300000000\n"
        "library_bytes = { cublas = 1000000 }\n"
        'provenance = "xmem-slurm calibrate on node gpu01, driver 550.54"\n'
    )
    catalog = load_catalog(calibration_path=calibration)
    rtx = catalog["RTX-3060-12GB"]
    assert rtx.context_bytes == 300_000_000
    assert rtx.libraries["cublas"] == 1_000_000
    assert rtx.libraries["cudnn"] == catalog["T4"].libraries["cudnn"]  # not calibrated: the default stays
    assert rtx.overhead_provenance == "xmem-slurm calibrate on node gpu01, driver 550.54"
    assert catalog["T4"].context_bytes == 446_693_376
    assert "defaults" in catalog["T4"].overhead_provenance


def test_site_override_wins_over_calibration(tmp_path: Path):
    calibration = tmp_path / "calibration.toml"
    calibration.write_text('[overhead."T4"]\ncontext_bytes = 1\nprovenance = "measured"\n')
    catalog = load_catalog({"overhead": {"T4": {"context_bytes": 2}}}, calibration_path=calibration)
    assert catalog["T4"].context_bytes == 2
    assert catalog["T4"].overhead_provenance == "measured"


def test_calibration_for_unknown_gpu_is_an_error(tmp_path: Path):
    calibration = tmp_path / "calibration.toml"
    calibration.write_text('[overhead."Z9000"]\ncontext_bytes = 1\n')
    with pytest.raises(CatalogError, match="Z9000"):
        load_catalog(calibration_path=calibration)


def test_broken_calibration_file_names_the_file(tmp_path: Path):
    calibration = tmp_path / "calibration.toml"
    calibration.write_text("[overhead\n")
    with pytest.raises(CatalogError, match="calibration.toml"):
        load_catalog(calibration_path=calibration)


def test_site_alias_moves_to_the_site_type():
    # A cluster whose `a100` GRES is the 80 GB card says so; the shipped 40 GB type lets the name go.
    catalog = load_catalog({"gpus": {"A100-SXM4-80GB": {"aliases": ["a100"]}}}, calibration_path=None)
    assert find_gpu("a100", catalog).name == "A100-SXM4-80GB"
    assert find_gpu("NVIDIA A100-SXM4-80GB", catalog).name == "A100-SXM4-80GB"  # shipped aliases stay
    assert find_gpu("a100-40gb", catalog).name == "A100-SXM4-40GB"


def test_alias_claimed_twice_by_the_site_is_an_error():
    with pytest.raises(CatalogError, match="gpu-x"):
        load_catalog({"gpus": {"T4": {"aliases": ["gpu-x"]}, "A10": {"aliases": ["gpu_x"]}}},
                     calibration_path=None)


def test_alias_equal_to_another_types_name_is_an_error():
    with pytest.raises(CatalogError, match="t4"):
        load_catalog({"gpus": {"A10": {"aliases": ["T4"]}}}, calibration_path=None)


def test_new_type_without_total_is_an_error():
    with pytest.raises(CatalogError, match="total_bytes"):
        load_catalog({"gpus": {"X1": {"capability": [8, 0]}}}, calibration_path=None)


# ---- issue 34, item 9: the 96 GB Hoppers and the Blackwell parts, with their MIG profiles ----------------------
@pytest.mark.parametrize("name, canonical", [
    ("NVIDIA B300 SXM6 AC", "B300"),
    ("b300", "B300"),
    ("NVIDIA GB200", "GB200"),
    ("gb300", "GB300"),
    ("h100-96gb", "H100-96GB"),
    ("H100_HBM2e", "H100-96GB"),
    ("NVIDIA H100 NVL", "H100-NVL-94GB"),
])
def test_blackwell_and_96gb_hopper_names(catalog, name, canonical):
    assert find_gpu(name, catalog).name == canonical


def test_blackwell_and_96gb_hopper_totals_and_capabilities(catalog):
    # nvidia-smi's memory.total in public logs, in MiB; the H100 96GB's is nominal (undocumented)
    assert catalog["B300"].total_bytes == 275_040 * MIB and catalog["B300"].capability == (10, 3)
    assert catalog["GB200"].total_bytes == 189_471 * MIB and catalog["GB200"].capability == (10, 0)
    assert catalog["GB300"].total_bytes == 284_208 * MIB and catalog["GB300"].capability == (10, 3)
    assert catalog["H100-96GB"].total_bytes == 96 * GIB and catalog["H100-96GB"].capability == (9, 0)


NEW_MIG = {
    "H100-NVL-94GB": ["1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
    "GH200-96GB": ["1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
    "H100-96GB": ["1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
    "B200": ["1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"],
    "B300": ["1g.34gb", "1g.67gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb"],
}


@pytest.mark.parametrize("gpu", NEW_MIG)
def test_hopper_and_blackwell_mig_profiles_as_nvidia_lists_them(catalog, gpu):
    assert [p.name for p in catalog[gpu].mig_profiles] == NEW_MIG[gpu]
    assert [p.compute_slices for p in catalog[gpu].mig_profiles] == [1, 1, 2, 3, 4, 7]
    assert mig_profile(catalog[gpu], f"MIG {NEW_MIG[gpu][2]}").memory_bytes < catalog[gpu].total_bytes // 4


def test_mig_memory_follows_nvidias_fractions_on_every_seven_slice_gpu(catalog):
    """The MIG user guide's fractions of memory on 7-slice GPUs: the smallest 1g 1/8, the larger 1g and the 2g 2/8,
    3g and 4g 4/8, 7g all of it. Each figure, measured or approximated, is its fraction of the 7g slice's memory or
    at most 10 % less (the driver keeps some back per instance), and the 7g slice fits in the GPU's total."""
    checked = []
    for gpu in catalog.values():
        profiles = {p.name: p for p in gpu.mig_profiles}
        full = next((p for p in gpu.mig_profiles if p.compute_slices == 7), None)
        if full is None:
            continue
        smallest_1g = min(p.memory_bytes for p in gpu.mig_profiles if p.compute_slices == 1)
        for profile in profiles.values():
            slices = profile.compute_slices
            eighths = {1: 1 if profile.memory_bytes == smallest_1g else 2, 2: 2, 3: 4, 4: 4, 7: 8}[slices]
            share = full.memory_bytes * eighths / 8
            assert 0.9 * share <= profile.memory_bytes <= share + 0.01 * GIB, (gpu.name, profile)
        assert full.memory_bytes <= gpu.total_bytes, gpu.name
        checked.append(gpu.name)
    assert set(NEW_MIG) | {"A100-SXM4-40GB", "H100-SXM5-80GB", "H200-141GB"} <= set(checked)


def test_grace_blackwell_parts_offer_no_mig_slice_until_nvidia_lists_their_profiles(catalog):
    for gpu in ("GB200", "GB300"):
        with pytest.raises(UnknownGpuError, match="no MIG"):
            mig_profile(catalog[gpu], "1g.23gb")
