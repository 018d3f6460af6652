"""The machine and package versions an experiment's report was made on."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    from importlib import metadata

    versions = {}
    for pkg in ("nitro", "torch", "numpy", "gymnasium", "mujoco", "prefect", "mlflow", "pydantic", "redis",
                "matplotlib", "safetensors"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    cpu, first = platform.processor() or "", _first_cpu()
    cpu = first.get("model name", cpu)
    flags = set(first.get("flags", "").split())
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu,
        # The same name covers generations that differ ~2-3x in speed (an AMD EPYC of family 25 and
        # one of family 26), and AVX-512 changes which kernels PyTorch runs, hence a run's floats.
        "cpu_family": first.get("cpu family"),
        "cpu_model_number": first.get("model"),
        "cpu_vector": "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else None,
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": mem_gib,
        "git_commit": commit,
        "packages": versions,
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _first_cpu() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (none where there is no such file)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and fields:
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def machine_markdown(info: dict[str, Any]) -> list[str]:
    """A report's "Machine and versions" section, as Markdown lines."""
    return ["## Machine and versions", "",
            f"- {info['platform']}, Python {info['python']}, {info['cpu']}"
            + (f" family {info['cpu_family']} model {info['cpu_model_number']} with {info['cpu_vector']}"
               if info.get("cpu_family") else "")
            + f" ({info['cpu_count']} CPUs"
            f"{', ' + str(info['affinity_cpus']) + ' usable' if info.get('affinity_cpus') else ''}), "
            f"{info['memory_gib']} GiB RAM; git {info['git_commit']}",
            "- " + ", ".join(f"{k} {v}" for k, v in info["packages"].items()),
            f"- generated {info['generated_at']}", ""]
