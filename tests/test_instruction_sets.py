"""The embedded benchmark is the same on every CPU: files written under other instruction sets.

This file uses nothing but the command line and the manifest, so it runs unchanged against an
older version of the generator (it fails at 9334507, which trained the detector while generating).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from icr.data.synthetic import read_manifest


def _hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# An older x86-64 CPU as far as the libraries can be told: torch's kernels without SIMD, oneDNN
# and MKL at SSE4, glibc's maths without AVX2 and FMA, OpenBLAS's Prescott kernels, numpy's
# dispatch without AVX2 / AVX-512 (both of numpy's naming schemes; unknown names are ignored).
OLDER_CPU = {
    "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA,-AVX512F",
    "OPENBLAS_CORETYPE": "Prescott",
    "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR AVX2 FMA3 AVX512F AVX512_SKX",
}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="the instruction sets compared are x86-64's")
def test_every_instruction_set_writes_the_same_files(tmp_path):
    """The tiny preset written by two processes, one with torch's kernels at the CPU's best
    instruction set, one at none and every other library held to an older CPU's (OLDER_CPU):
    the same bytes in every file, the same fingerprint. (At 9334507, which trained the detector
    while generating, ATEN_CPU_CAPABILITY alone gave three detectors and three fingerprints.)
    Each folder has its own parent, so nothing one process leaves beside it serves the other."""
    best = torch.backends.cpu.get_cpu_capability().lower()  # avx512, avx2 or default
    if best == "default":
        pytest.skip("torch has one kernel path on this CPU")
    processes = {}
    for name, env in (("best", {"ATEN_CPU_CAPABILITY": best}), ("older", OLDER_CPU)):
        out = tmp_path / name / "tiny-0"
        command = [sys.executable, "-m", "icr.data.synthetic", "--out", str(out), "--preset",
                   "tiny", "--seed", "0", "--workers", "1"]
        processes[out] = subprocess.Popen(command, env={**os.environ, **env}, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for process in processes.values():
        output = process.communicate(timeout=600)[0]
        assert process.returncode == 0, output
    a, b = processes
    hashes = _hashes(a)
    assert [f for f, h in _hashes(b).items() if hashes.get(f) != h] == []
    assert hashes == _hashes(b)
    assert read_manifest(a)["fingerprint"] == read_manifest(b)["fingerprint"]
