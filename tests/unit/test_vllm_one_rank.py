"""The vLLM SAVE Job as rank r of a world of N on one GPU, without vLLM: placement, refusals, the
arguments and environment a parallel shape adds (and a one-GPU shape does not), and the Job
reading its own rank's report over a stand-in engine process."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ember.engines.vllm import args as vargs
from ember.engines.vllm import job, ranks, versions
from ember.engines.vllm import report as reports
from ember.identity import ArchiveIdentity, Parallelism

IDENTITY = ArchiveIdentity(model="/models/llama", revision="main", engine="vllm", engine_version="0.26",
                           capture_sizes=(1, 2, 4, 8), graph_mode="full-and-piecewise",
                           compile={"mode": "3"}, dtype="bfloat16", max_num_tokens=2048, max_batch=8)


def _shape(**par: int) -> ArchiveIdentity:
    return IDENTITY.model_copy(update={"parallelism": Parallelism(**par)})


def test_a_global_rank_is_placed_data_parallel_outermost() -> None:
    assert ranks.place(0, 2, 1) == (0, 0) and ranks.place(1, 2, 1) == (0, 1)
    assert [ranks.place(r, 2, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [ranks.place(r, 1, 4) for r in range(4)] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    for bad in [(2, 2, 1), (-1, 2, 1), (0, 0, 1)]:
        with pytest.raises(ValueError, match="not in a world"):
            ranks.place(*bad)


def test_the_rank_to_play_comes_from_the_environment() -> None:
    assert ranks.save_rank({}) == 0 and ranks.save_rank({ranks.RANK_ENV: "3"}) == 3
    with pytest.raises(ValueError, match="is not a rank"):
        ranks.save_rank({ranks.RANK_ENV: "one"})


OPTED_IN: dict[str, str] = {}  # no opt-in any more: every pod LOADs a parallel archive


def test_shapes_no_rank_can_play_are_refused_with_the_reason() -> None:
    assert ranks.refusals(_shape(tensor=2), 1, OPTED_IN) == []
    assert ranks.refusals(_shape(tensor=2, expert=2), 1, OPTED_IN) == []
    sp = ranks.refusals(_shape(tensor=2, expert=4, data=2), 3, OPTED_IN)
    assert len(sp) == 1 and "sequence-parallel MoE" in sp[0]
    assert ranks.refusals(_shape(tensor=1, expert=4, data=4), 0, OPTED_IN) == []
    bad = ranks.refusals(_shape(tensor=2, expert=2, data=2), 0, OPTED_IN)
    assert "expert 2 must be tensor x data = 4" in bad[0]
    assert "is not a rank of a world of 2" in ranks.refusals(_shape(tensor=2), 2, OPTED_IN)[0]
    assert "data parallel without expert parallel" in ranks.refusals(_shape(data=2), 0, OPTED_IN)[0]


def test_a_parallel_save_needs_no_opt_in_now_that_every_rank_loads_it() -> None:
    assert ranks.refusals(_shape(tensor=2), 0, {}) == []
    assert ranks.refusals(IDENTITY, 0, {}) == []


def test_one_gpu_gets_no_pin_and_its_arguments_are_unchanged() -> None:
    a = vargs.engine_args(IDENTITY)
    assert json.loads(a[a.index("--compilation-config") + 1]) == {
        "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8], "mode": 3,
        "inductor_compile_config": vargs.NUMERICS}
    assert "--disable-custom-all-reduce" not in a and "--all2all-backend" not in a
    assert ranks.save_args(IDENTITY) == [] and ranks.save_env(IDENTITY, 0, "/stub.so") == {}
    assert ranks.parallel_env(IDENTITY) == {}


def test_a_parallel_shapes_save_pins_what_the_stub_cannot_stand_in_for() -> None:
    tp2 = _shape(tensor=2)
    pods = vargs.engine_args(tp2)  # the pods run as SAVE did: the same pins by default
    assert pods == vargs.engine_args(tp2, rank_pins=True)
    unpinned = vargs.engine_args(tp2, rank_pins=False)
    assert "--disable-custom-all-reduce" not in unpinned
    a = vargs.engine_args(tp2, rank_pins=True)
    assert "--disable-custom-all-reduce" in a and "--all2all-backend" not in a
    cc = json.loads(a[a.index("--compilation-config") + 1])
    assert cc["pass_config"] == {"fuse_allreduce_rms": False, "fuse_gemm_comms": False, "enable_sp": False}
    moe = vargs.engine_args(_shape(tensor=2, expert=4, data=2), rank_pins=True)
    assert moe[moe.index("--all2all-backend") + 1] == "allgather_reducescatter"
    given = IDENTITY.model_copy(update={"compile": {"pass_config": '{"eliminate_noops": false}'},
                                        "parallelism": Parallelism(tensor=2)})
    assert vargs.compilation_config(given, rank_pins=True)["pass_config"] == {
        "eliminate_noops": False, "fuse_allreduce_rms": False, "fuse_gemm_comms": False, "enable_sp": False}
    assert ranks.save_args(tp2) == ["--distributed-executor-backend", "external_launcher"]
    # every shape compiles its reductions by rule (NUMERICS), over what the deployment gives
    inductor = '{"max_autotune": true, "deterministic": false}'
    tuned = given.model_copy(update={"compile": {"inductor_compile_config": inductor}})
    assert vargs.compilation_config(tuned)["inductor_compile_config"] == {"max_autotune": True,
                                                                          **vargs.NUMERICS}
    assert vargs.compilation_config(tuned, deterministic=False)["inductor_compile_config"] == {
        "max_autotune": True, "deterministic": False}
    env = ranks.save_env(_shape(tensor=2, expert=4, data=2), 3, "/lib/libember_nccl.so")
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == env[ranks.WORLD_ENV] == "4"
    assert env["LOCAL_RANK"] == "0"
    # the stub reaches pynccl through ranks.enter, not VLLM_NCCL_SO_PATH (in the compile-cache hash)
    assert env[ranks.STUB_ENV] == "/lib/libember_nccl.so" and "VLLM_NCCL_SO_PATH" not in env
    assert env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0" and env["VLLM_DISTRIBUTED_USE_SPLIT_GROUP"] == "0"


def test_pods_of_a_parallel_shape_get_the_saves_settings() -> None:
    pods = vargs.engine_args(_shape(tensor=2))
    assert ranks.parallel_args(pods) and ranks.pod_env(pods) == ranks.PARALLEL_ENV
    assert ranks.parallel_args(["-tp", "4"]) and ranks.parallel_args(["-dp=2", "-ep"])
    moe = vargs.engine_args(_shape(expert=2, data=2))
    assert ranks.pod_env(moe) == {**ranks.PARALLEL_ENV, reports.REPLICAS_ENV: "2"}
    assert not ranks.parallel_args(vargs.engine_args(IDENTITY))
    assert ranks.pod_env(["--tensor-parallel-size", "1"]) == {}
    assert ranks.PARALLEL_ENV["NCCL_RUNTIME_CONNECT"] == "0"


def test_a_dense_models_data_parallel_replicas_restore_the_data_1_archive() -> None:
    """vLLM runs a dense model's DP ranks as engines of their own (DP 1 each): the archive is the
    tensor-parallel shape's, the pods add vLLM's DP size, and get no parallel settings where that
    archive is one GPU's (every VLLM_* variable is in the compile-cache hash: SAVE ran without)."""
    dense = Parallelism(tensor=1, data=4)
    assert vargs.archived(dense) == Parallelism()
    assert vargs.archived(Parallelism(tensor=2, data=2)) == Parallelism(tensor=2)
    for kept in (Parallelism(expert=2, data=2), Parallelism(tensor=2), Parallelism()):
        assert vargs.archived(kept) == kept
    pods = vargs.pod_args(IDENTITY, 4)
    assert pods == [*vargs.engine_args(IDENTITY), "--data-parallel-size", "4"]
    assert ranks.args_shape(pods) == dense and not ranks.parallel_args(pods)
    assert ranks.pod_env(pods) == {reports.REPLICAS_ENV: "4"}
    tp_dp = vargs.pod_args(_shape(tensor=2), 2)
    assert ranks.pod_env(tp_dp) == {**ranks.PARALLEL_ENV, reports.REPLICAS_ENV: "2"}
    # an identity that already holds the DP size (MoE with EP) gets no second flag
    assert vargs.pod_args(_shape(expert=2, data=2), 2).count("--data-parallel-size") == 1
    assert ranks.args_shape(["-tp", "x", "--data-parallel-size", "0"]) == Parallelism()


def test_the_save_guard_names_a_vllm_of_another_parallel_shape() -> None:
    moe = _shape(tensor=2, expert=4, data=2)
    resolved = {"model": "/models/llama", "revision": "main", "dtype": "bfloat16", "engine_version": "0.26.0",
                "capture_sizes": [1, 2, 4, 8], "cudagraph_mode": "FULL_AND_PIECEWISE", "max_num_seqs": 8,
                "max_num_batched_tokens": 2048, "parallelism": vargs.parallelism(2, 2, True)}
    assert vargs.mismatches(moe, resolved) == []
    no_ep = vargs.mismatches(moe, {**resolved, "parallelism": vargs.parallelism(2, 2, False)})
    assert len(no_ep) == 1 and no_ep[0].startswith("parallelism")
    assert vargs.mismatches(IDENTITY, resolved)[0].startswith("parallelism")


def _config(**pc: int) -> Any:
    par = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1, **pc}
    return SimpleNamespace(parallel_config=SimpleNamespace(**par), compilation_config=SimpleNamespace(),
                           model_config=SimpleNamespace(enforce_eager=False))


def test_a_parallel_config_loads_with_the_saves_pins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ranks.PARALLEL_ENV.items():
        monkeypatch.setenv(name, value)
    tp2 = _config(tensor_parallel_size=2, data_parallel_size=2)
    tp2.parallel_config.disable_custom_all_reduce = True
    for mode in ("save", "load"):
        monkeypatch.setenv("EMBER_MODE", mode)
        assert versions.unsupported_features(tp2) == []
    assert "pipeline_parallel_size=2" in versions.unsupported_features(_config(pipeline_parallel_size=2))[0]
    tp2.parallel_config.disable_custom_all_reduce = False
    assert "custom all-reduce" in versions.unsupported_features(tp2)[0]
    tp2.parallel_config.disable_custom_all_reduce = True
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_SYMM_MEM", "1")
    assert "VLLM_ALLREDUCE_USE_SYMM_MEM=1" in versions.unsupported_features(tp2)[0]
    assert versions.unsupported_features(_config()) == []  # one GPU: no pin asked


def test_the_job_reads_its_own_rank_never_another(tmp_path: Path) -> None:
    path = tmp_path / "save.report.json"
    reports.write(path, {"stages": {"front": {"t": 1}}}, None)
    reports.write(path, {"stages": {"save": {"identity": "r0"}}}, (0, 2))
    reports.write(path, {"stages": {"save": {"identity": "r1"}}}, (1, 2))
    one = job.rank_report(path, 1)
    assert one["stages"] == {"front": {"t": 1}, "save": {"identity": "r1"}} and one["rank"] == 1
    assert "ranks" not in one and job.rank_report(path, 0)["stages"]["save"] == {"identity": "r0"}
    assert job.rank_report(tmp_path / "absent.json", 0) == {}


STANDIN = r'''
import json, os, sys
from pathlib import Path
rank = int(os.environ.get("RANK", "0"))
env = {k: os.environ.get(k) for k in ("RANK", "EMBER_VLLM_SAVE_WORLD", "EMBER_VLLM_NCCL_STUB", "EMBER_MODE")}
with open(os.path.join(os.environ["FAKE_DIR"], "calls.jsonl"), "a") as f:
    f.write(json.dumps({"args": json.loads(sys.argv[3]), "env": env}) + "\n")
base = Path(os.environ["EMBER_VLLM_REPORT"])
if os.environ.get("EMBER_VLLM_PROBE") == "1":
    stages = {"worker.determine_available_memory": {"bytes": 1000}}
else:
    ident = json.loads(os.environ["EMBER_IDENTITY"])
    from ember.identity import ArchiveIdentity
    stages = {"save": {"published": True, "identity": ArchiveIdentity(**ident).hash(), "graphs": 7}}
for r in range(int(os.environ["EMBER_VLLM_SAVE_WORLD"])):  # every rank's file; only RANK's is true
    mine = stages if r == rank else {"save_refused": {"reason": f"rank {r} is not this one"}}
    base.with_name(f"{base.stem}.rank{r}{base.suffix}").write_text(
        json.dumps({"rank": r, "world": 2, "stages": mine}))
'''


def test_the_job_plays_the_rank_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n{STANDIN}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    seen: list[bool] = []

    def env(mode: str, given: Any, *, comm_stub: bool = False) -> dict[str, str]:
        seen.append(comm_stub)
        return dict(given)

    monkeypatch.setattr(job, "process_env", env)
    monkeypatch.setattr("ember.runtime.comm.stub_path", lambda: Path("/lib/libember_nccl.so"))
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    monkeypatch.setenv(ranks.RANK_ENV, "1")
    tp2 = _shape(tensor=2)
    out = job.save_job(tp2.model_dump_json(), "file:///s", [], work=tmp_path / "w", python=str(script))
    assert out["identity"] == tp2.hash() and out["graphs"] == 7 and (out["rank"], out["world"]) == (1, 2)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2 and seen == [True, True]  # the probe too: NCCL must not wait for peers
    for call in calls:
        assert call["env"]["RANK"] == "1" and call["env"]["EMBER_VLLM_SAVE_WORLD"] == "2"
        assert call["env"]["EMBER_VLLM_NCCL_STUB"] == "/lib/libember_nccl.so"
        assert "external_launcher" in call["args"] and "--disable-custom-all-reduce" in call["args"]
    assert "--kv-cache-memory-bytes" not in calls[0]["args"]  # the probe sized rank 1's engine
    assert calls[1]["args"][-2:] == ["--kv-cache-memory-bytes", "1000"]


def test_the_dp_batch_agreement_of_a_one_rank_save_is_every_rank_asking_the_same() -> None:
    env = ranks.save_env(_shape(tensor=2, expert=4, data=2), 3, "/stub.so")
    assert env[ranks.DP_RANK_ENV] == "1"  # global rank 3 of tensor 2 x data 2
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 2, dtype=torch.int32)
    t[:, 1] = torch.tensor([5, 8, 0, 2], dtype=torch.int32)  # DP rank 1's column (vLLM's _run_ar)
    ranks.AsIfEveryRank(1, SimpleNamespace(get_rank=lambda: 3)).all_reduce(t, group=None)
    assert t.tolist() == [[5, 5], [8, 8], [0, 0], [2, 2]]
    assert ranks.AsIfEveryRank(0, SimpleNamespace(get_rank=lambda: 3)).get_rank() == 3


def test_the_save_childs_config_hashes_as_its_pods_with_data_parallel() -> None:
    """vLLM 0.26 multiplies world_size by DP for external_launcher only, and world_size is in the
    hash that names the compile cache's directory: the SAVE child must hash as the pods do."""
    import dataclasses

    @dataclasses.dataclass
    class ParallelConfig:  # vllm/config/parallel.py's fields that matter here
        tensor_parallel_size: int
        data_parallel_size: int
        distributed_executor_backend: str
        world_size: int = 0

        def __post_init__(self) -> None:
            self.world_size = self.tensor_parallel_size
            if self.distributed_executor_backend == "external_launcher":
                self.world_size *= self.data_parallel_size

        def compute_hash(self) -> str:
            return f"{self.tensor_parallel_size}/{self.data_parallel_size}/{self.world_size}"

    save = ParallelConfig(1, 2, "external_launcher")
    pod = ParallelConfig(1, 2, "mp")
    assert save.compute_hash() != pod.compute_hash()  # what SAVE's compiled code was filed under
    ranks.hash_as_the_pods(ParallelConfig)
    ranks.hash_as_the_pods(ParallelConfig)  # once
    assert save.compute_hash() == pod.compute_hash() and save.world_size == 2  # put back after
    tp2 = ParallelConfig(2, 1, "external_launcher")
    assert tp2.compute_hash() == ParallelConfig(2, 1, "mp").compute_hash()  # DP 1: untouched
