"""What a run's bits depend on besides the code and the case: the machine's arithmetic.

Two machines of the same kind can round one sum differently: another CPU model (AMD / Intel), another ATen
CPU kernel set (``ATEN_CPU_CAPABILITY``: default / avx2 / avx512), another BLAS or BLAS code path
(``MKL_CBWR``), another thread count, another GPU or cuBLAS.  `arithmetic_facts` records them in every
manifest and in the report's environment block, so a verdict that differs between two machines can be traced
to the setting that differs.  Every fact is read defensively: a missing one is ``"unknown"``, never an error.
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import socket
from datetime import datetime, timezone
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Optional

#: Environment variables that select another arithmetic on the same machine (recorded as set or unset).
ARITHMETIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS",
                  "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE")


@lru_cache(maxsize=1)
def _first_cpu() -> dict:
    """The first processor's fields of /proc/cpuinfo ({lower-case key: value}); {} where there is none.  Read
    once per process (the model and the family come from the same block)."""
    fields: dict = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if not line.strip() and fields:
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name ('AMD EPYC 9654 96-Core Processor'), from /proc/cpuinfo on Linux."""
    return _first_cpu().get("model name") or platform.processor() or "unknown"


def cpu_family() -> str:
    """The CPU's vendor and family ('AuthenticAMD family 25', 'GenuineIntel family 6'), from /proc/cpuinfo;
    'unknown' elsewhere.  Vendors' math libraries take other code paths by vendor (measured: MKL's vector
    square root rounds differently on Intel and AMD under ``MKL_CBWR=COMPATIBLE``), so goldens say on which
    families they were checked (`harness.judging.golden`)."""
    fields = _first_cpu()
    if "vendor_id" not in fields:
        return "unknown"
    return f"{fields['vendor_id']} family {fields.get('cpu family', '?')}"


def _blas(config: str) -> dict:
    """BLAS name and version from ``torch.__config__.show()`` (the build's BLAS_INFO and its MKL line)."""
    info = re.search(r"BLAS_INFO=(\w+)", config)
    mkl = re.search(r"Math Kernel Library Version ([^\n]+)", config)
    return {"blas": info.group(1) if info else "unknown",
            "blas_version": mkl.group(1).strip() if mkl else "unknown"}


def _cublas_version() -> str:
    """cuBLAS's own version (major*10000+minor*100+patch decoded), from the library torch loaded."""
    for name in ("libcublas.so", "libcublas.so.13", "libcublas.so.12", "libcublas.so.11"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int()
        try:
            if lib.cublasGetProperty(0, ctypes.byref(v)) == 0:   # MAJOR_VERSION
                parts = [v.value]
                for prop in (1, 2):                              # MINOR_VERSION, PATCH_LEVEL
                    lib.cublasGetProperty(prop, ctypes.byref(v))
                    parts.append(v.value)
                return ".".join(map(str, parts))
        except AttributeError:
            continue
    return "unknown"


def arithmetic_facts() -> dict:
    """The facts that decide how floating-point results round on this machine (strings and ints, JSON-ready).

    Keys: ``cpu_model``, ``cpu_family`` (vendor and family), ``aten_cpu_capability`` (the kernel set ATen dispatches to, after
    ``ATEN_CPU_CAPABILITY``), ``blas`` / ``blas_version``, ``mkl_cbwr`` (MKL's conditional numerical
    reproducibility branch, ``unset`` = automatic), ``torch_num_threads`` (this process; the ranks set the
    case's ``num_threads``), ``env`` ({variable: value} of `ARITHMETIC_ENV` that are set), and with a CUDA
    device ``gpu``, ``cuda``, ``cudnn``, ``cublas``.  Never raises.
    """
    import torch

    facts: dict = {"cpu_model": cpu_model(), "cpu_family": cpu_family()}
    try:
        facts["aten_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        facts["aten_cpu_capability"] = "unknown"
    try:
        facts.update(_blas(torch.__config__.show()))
    except (AttributeError, RuntimeError):
        facts.update(blas="unknown", blas_version="unknown")
    facts["mkl_cbwr"] = os.environ.get("MKL_CBWR", "unset")
    facts["torch_num_threads"] = torch.get_num_threads()
    facts["env"] = {k: os.environ[k] for k in ARITHMETIC_ENV if k in os.environ}
    if torch.cuda.is_available():
        try:
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["cuda"] = torch.version.cuda or "unknown"
            facts["cudnn"] = str(torch.backends.cudnn.version())
            facts["cublas"] = _cublas_version()
        except RuntimeError as e:          # a broken driver must not stop the report
            facts["gpu"] = f"unknown ({e})"
    return facts


def environment(arithmetic: Optional[dict] = None) -> dict:
    """Facts that bitwise results depend on (recorded in every manifest and shown in the report): versions,
    platform, and the machine's arithmetic: `arithmetic` when measured elsewhere (`arithmetic_facts` in a child
    of the runner's forkserver, `harness.running.runner.in_forkserver`), else `arithmetic_facts` here."""
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed (source tree)"
    return {"torch": version("torch"), "bitparity": version("bitparity"),
            "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "hostname": socket.gethostname(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **(arithmetic or arithmetic_facts())}
