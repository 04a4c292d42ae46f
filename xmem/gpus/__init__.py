"""GPU types of the cluster: the catalog, name lookup, MIG profiles and the non-allocator overhead per type.

Pure: no torch, no GPU, no I/O beyond reading the TOML files shipped here (see `catalog.py`).
"""

from xmem.gpus.catalog import (
    CUBLAS_DEFAULT_WORKSPACE_BYTES,
    CUBLAS_LARGE_WORKSPACE_BYTES,
    CatalogError,
    GpuType,
    MigProfile,
    UnknownGpuError,
    catalog_from_tables,
    cublas_workspace_bytes,
    find_gpu,
    load_catalog,
    mig_profile,
    normalize_name,
    overhead_bytes,
)

__all__ = [
    "CUBLAS_DEFAULT_WORKSPACE_BYTES", "CUBLAS_LARGE_WORKSPACE_BYTES", "CatalogError", "GpuType", "MigProfile",
    "UnknownGpuError", "catalog_from_tables", "cublas_workspace_bytes", "find_gpu", "load_catalog", "mig_profile",
    "normalize_name", "overhead_bytes",
]
