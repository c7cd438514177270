"""GPU, one device: multi-GPU archives from one single-GPU SAVE.

- the NCCL stub exports every NCCL symbol the installed torch imports;
- a stub SAVE of TP=2, EP=2 and DP=2 shapes runs on ONE GPU and publishes (placeholders in the
  archive for TP and EP; none for dense DP), and a TP=2 SAVE is timed against the TP=1 SAVE;
- a real one-rank NCCL communicator: SAVE (stub) → LOAD splices the real collectives and every
  graph's outputs and the greedy tokens equal a native capture with the same communicator
  (all-reduce; all-gather + reduce-scatter for the MoE dispatch).
Two-rank LOADs need two GPUs: `ember bench graphs --tp 2` (its own issue).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

torch = pytest.importorskip("torch")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMBER_MODE")}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


@pytest.fixture(scope="module")
def lib() -> Path:
    from ember import native

    found = native.find_library()
    if found is None or not found.with_name("libember_nccl.so").is_file():
        pytest.skip("libember / libember_nccl not built")
    return found


def test_stub_exports_every_nccl_symbol_torch_imports(lib: Path) -> None:
    torch_cuda = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    want = subprocess.run(["nm", "-D", "--undefined-only", str(torch_cuda)], capture_output=True, text=True,
                          check=True).stdout
    want_syms = {w[-1] for w in map(str.split, want.splitlines()) if w and w[-1].startswith("nccl")}
    have = subprocess.run(["nm", "-D", "--defined-only", str(lib.with_name("libember_nccl.so"))],
                          capture_output=True, text=True, check=True).stdout
    have_syms = {ln.split()[-1] for ln in have.splitlines()}
    assert want_syms and not want_syms - have_syms, sorted(want_syms - have_syms)


def _save(store: str, *args: str) -> dict:
    from ember.runtime.session import ember_argv

    cmd = ember_argv("save", "--layers", "2", "--sizes", "1,8,64", "--store", store, *args)
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def _inspect(store: str, identity: str) -> dict:
    from ember.runtime.session import ember_argv

    proc = subprocess.run(ember_argv("inspect", store, identity, "--json"), env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    ("args", "ops"),
    [
        (("--workload", "llama3-8b", "--tp", "2"), {"all_reduce"}),
        (("--workload", "qwen3-moe", "--ep", "2"), {"all_gather", "reduce_scatter"}),
        (("--workload", "llama3-8b", "--dp", "2"), set()),
    ],
)
def test_stub_save_of_a_parallel_shape_publishes_on_one_gpu(
    lib: Path, tmp_path: Path, args: tuple, ops: set
) -> None:
    store = tmp_path.as_uri()
    out = _save(store, *args)
    assert out["published"] is True and out["graphs"] == 3
    report = _inspect(store, out["identity"])
    shape = report["manifest"]["identity"]["parallelism"]
    assert shape["tensor"] * shape["data"] == 2
    lines = report.get("collectives", [])
    assert {ln.split(": ", 1)[1].split()[0] for ln in lines} == ops, lines
    if ops:
        facts = report["manifest"]["engine"]["collectives"]
        assert facts["world"] == 2 and facts["nccl_version"]
        assert len(facts["nodes"]) == 3  # every graph holds placeholders


@pytest.mark.parametrize("workload", ["llama3-8b", "qwen3-moe"])
def test_one_rank_splice_is_bit_identical_to_native(lib: Path, tmp_path: Path, workload: str) -> None:
    from ember_bench.parallel import bench_parallel

    r = bench_parallel(workload, 2, "1,8,64", tmp_path.as_uri(), 1, 1, 1, True, timeout=600)
    assert "ranks" in r, r
    (rank,) = r["ranks"]
    assert "load_ms" in rank, rank
    assert all(rank["tokens_identical"].values()) and rank["tokens_identical"], rank
    assert rank["outputs_identical"] == rank["outputs"] == 3, rank
    print(json.dumps(r, default=str)[:2000])
