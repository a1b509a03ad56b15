"""benchmarks/kernel_sass.py on the CPU: the Triton attention kernels compiled for Hopper by Triton's own ptxas and
read back, the key-tile loop found in each (the proxy the kernels are tuned by between device calls)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
triton = pytest.importorskip("triton")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
if not (TOOLS / "nvdisasm").is_file() or not (TOOLS / "cuobjdump").is_file():
    pytest.skip("this Triton has no bundled nvdisasm and cuobjdump", allow_module_level=True)

sys.path.insert(0, str(ROOT))
spec = importlib.util.spec_from_file_location("kernel_sass", ROOT / "benchmarks" / "kernel_sass.py")
kernel_sass = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_sass)

# The MMAs each format's loop runs: Q.K^T in int8 (IGMMA), then P.V in bf16 (HGMMA), E4M3 (QGMMA) or int8.
PV_MMA = {"16bit": "HGMMA", "fp8": "QGMMA", "int8": "IGMMA"}


@pytest.mark.parametrize("pv", list(PV_MMA))
def test_each_kernels_key_tile_loop_is_found_with_its_mmas_and_exponentials(pv, tmp_path):
    row = kernel_sass.compile_kernel(pv, TOOLS)
    loop = row["by_kind"]
    # One exponential per element of P a thread holds, plus the rows' rescaling: the loop is the key-tile loop,
    # with the format's MMAs in it.
    assert row["p_elements_per_thread"] <= loop["exp2 (MUFU)"] <= row["p_elements_per_thread"] + 8, row
    mmas = {op.split(".")[0] for op in row["mma_opcodes"]}
    assert mmas == {"IGMMA", PV_MMA[pv]}, row["mma_opcodes"]
    assert row["registers"] and row["stack_bytes"] is not None
    text = kernel_sass.docs_section([row])
    assert f"`{row['backend']}`" in text and str(row["loop_instructions"]) in text
