"""vLLM's caches shipped with the archive (compiled code, model-class facts): packed at SAVE, put
back at LOAD (no vLLM needed)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from ember.engines.vllm import compile_cache

INFO = "vllm-model_executor-models-llama-LlamaForCausalLM.json"


def _tree(root: Path) -> None:
    base = root / compile_cache.SUBDIR
    (base / "3f2a9c01de" / "rank_0_0" / "backbone").mkdir(parents=True)
    (base / "3f2a9c01de" / "rank_0_0" / "backbone" / "vllm_compile_cache.py").write_text("{'graph': 1}")
    (base / "3f2a9c01de" / "rank_0_0" / "backbone" / "artifact_shape_1").write_bytes(b"\x7fELF" * 300)
    (base / "torch_aot_compile" / "abc").mkdir(parents=True)
    (base / "torch_aot_compile" / "abc" / "model").write_bytes(b"aot" * 100)
    (base / "torch_aot_compile" / "abc" / "model.lock").write_text("")  # per process: not shipped
    (root / "modelinfos").mkdir()
    (root / "modelinfos" / INFO).write_text('{"hash": "9e"}')
    kernel = root / compile_cache.TRITON_HOME / ".triton" / "cache" / "RBYNPP3K"  # vLLM's own Triton kernel
    kernel.mkdir(parents=True)
    (kernel / "_prepare_prefill_inputs_kernel.cubin").write_bytes(b"\x7fELF" * 50)
    (root / "hub-downloads").mkdir()  # not one of vLLM's caches ember ships
    (root / "hub-downloads" / "weights").write_bytes(b"w")


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for t in compile_cache.TREES
            for p in (root / t).rglob("*") if p.is_file()}


def test_the_tree_comes_back_under_another_root(tmp_path: Path) -> None:
    _tree(tmp_path / "save")
    data = compile_cache.pack(tmp_path / "save")
    assert data is not None
    done = compile_cache.unpack(data, tmp_path / "pod")
    want = {k: v for k, v in _files(tmp_path / "save").items() if not k.endswith(".lock")}
    assert _files(tmp_path / "pod") == want and len(want) == 5
    assert done["placed"] == 4 and done["kept"] == 0  # four top-level entries, each placed whole
    # no scratch directory is left behind, nothing but vLLM's caches and Triton's is shipped
    assert sorted(p.name for p in (tmp_path / "pod").iterdir()) == [
        "modelinfos", "torch_compile_cache", compile_cache.TRITON_HOME]
    assert sorted(p.name for p in (tmp_path / "pod" / compile_cache.SUBDIR).iterdir()) == [
        "3f2a9c01de", "torch_aot_compile"]


def test_what_the_pod_has_is_kept_and_the_rest_merged(tmp_path: Path) -> None:
    _tree(tmp_path / "save")
    data = compile_cache.pack(tmp_path / "save")
    assert data is not None
    pod = tmp_path / "pod" / compile_cache.SUBDIR
    (pod / "torch_aot_compile" / "other-model").mkdir(parents=True)
    (pod / "3f2a9c01de").mkdir(parents=True)
    mine = pod / "3f2a9c01de" / "rank_0_0"
    mine.write_text("the pod's own")  # a file where SAVE has a directory: kept, not replaced
    done = compile_cache.unpack(data, tmp_path / "pod")
    assert mine.read_text() == "the pod's own"
    assert (pod / "torch_aot_compile" / "abc" / "model").read_bytes() == b"aot" * 100
    assert (pod / "torch_aot_compile" / "other-model").is_dir()
    assert done == {**done, "placed": 3, "kept": 1}  # torch_aot_compile/abc, the modelinfo, Triton's
    # unpacking again changes nothing
    again = compile_cache.unpack(data, tmp_path / "pod")
    assert again["placed"] == 0 and again["kept"] == 4


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, None


@pytest.mark.parametrize("bad", [
    [_file("torch_compile_cache/ok/a"), _file("../escaped")],
    [_file("torch_compile_cache/ok/a"), _file("torch_compile_cache/../../escaped")],
    [_link("modelinfos/link", "/etc/passwd")],
    [_link("torch_compile_cache/ok/link", "../../../outside")],
])
def test_an_unsafe_tar_places_nothing(tmp_path: Path, bad: list) -> None:
    with pytest.raises(tarfile.TarError):
        compile_cache.unpack(_tar(*bad), tmp_path / "pod")
    assert list((tmp_path / "pod").iterdir()) == []
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "pod" / "escaped").exists()


def test_an_absolute_member_lands_inside_the_root(tmp_path: Path) -> None:
    data = _tar(_file("/torch_compile_cache/abs", b"in"), _file("/etc/cron.d/x"))  # the "data" filter
    compile_cache.unpack(data, tmp_path / "pod")
    assert (tmp_path / "pod" / compile_cache.SUBDIR / "abs").read_bytes() == b"in"
    assert sorted(p.name for p in (tmp_path / "pod").iterdir()) == [compile_cache.SUBDIR]


def test_nothing_compiled_packs_nothing(tmp_path: Path) -> None:
    assert compile_cache.pack(tmp_path) is None
    (tmp_path / compile_cache.SUBDIR / "empty-dir").mkdir(parents=True)
    (tmp_path / "other" / "file").parent.mkdir()
    (tmp_path / "other" / "file").write_text("not a vLLM cache")
    assert compile_cache.pack(tmp_path) is None


def test_cache_root_follows_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_root() == tmp_path / "xdg" / "vllm"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "explicit"))
    assert compile_cache.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.cache_root() == tmp_path / "home" / ".cache" / "vllm"


def test_save_and_load_name_torchs_ptxas_before_any_triton_compile(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """Triton keys every kernel by the ptxas version it reads at its first compile: SAVE and LOAD
    name torch's ptxas (as Inductor does, but from the start), never override one already named,
    and leave it unset where torch brings none."""
    import sys

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    for name in ("TRITON_PTXAS_PATH", "TRITON_HOME", "TRITON_CACHE_DIR"):  # restored after the test
        monkeypatch.delenv(name, raising=False)
    if "torch" not in sys.modules:  # find torch's ptxas without importing torch: a stand-in wheel
        (tmp_path / "site" / "torch" / "bin").mkdir(parents=True)
        (tmp_path / "site" / "torch" / "__init__.py").write_text("raise ImportError('not to be imported')\n")
        ptxas = tmp_path / "site" / "torch" / "bin" / "ptxas"
        ptxas.write_text("#!/bin/sh\n")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        assert compile_cache.torch_ptxas() == ""  # not executable: Inductor would not use it either
        ptxas.chmod(0o755)
        assert compile_cache.torch_ptxas() == str(ptxas)
    monkeypatch.setattr(compile_cache, "torch_ptxas", lambda: "/opt/torch/bin/ptxas")
    compile_cache.own_triton_home()
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/torch/bin/ptxas"
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/usr/local/cuda/bin/ptxas")  # the operator's own choice
    compile_cache.own_triton_home()
    assert os.environ["TRITON_PTXAS_PATH"] == "/usr/local/cuda/bin/ptxas"
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    monkeypatch.setattr(compile_cache, "torch_ptxas", lambda: "")
    compile_cache.own_triton_home()
    assert "TRITON_PTXAS_PATH" not in os.environ


def test_load_finds_the_model_under_its_own_root_once_put_back(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """What the adapter's accept() looks for (`model_dir`) after its attached() unpacked the
    attachment: SAVE's model directory under this process's root, not SAVE's absolute path."""
    _tree(tmp_path / "save")
    saved_dir = str(tmp_path / "save" / compile_cache.SUBDIR / "3f2a9c01de" / "rank_0_0" / "backbone")
    facts = {"compile_cache_key": compile_cache.key_of(saved_dir)}
    assert facts["compile_cache_key"] == "3f2a9c01de/rank_0_0/backbone"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "pod"))
    where = Path(compile_cache.model_dir(facts))
    assert where == tmp_path / "pod" / compile_cache.SUBDIR / "3f2a9c01de" / "rank_0_0" / "backbone"
    assert not where.is_dir()
    packed = compile_cache.pack(tmp_path / "save")
    assert packed is not None
    compile_cache.unpack(packed)
    assert (where / "vllm_compile_cache.py").read_text() == "{'graph': 1}"
    # a path outside any tree has no key; no key, nothing to look for
    assert compile_cache.key_of("/elsewhere/cache") == "" and compile_cache.model_dir({}) == ""


def _archive_with_caches(tmp_path: Path, tensor: int = 1, engine: dict | None = None) -> Path:
    """A published archive whose attachment is SAVE's packed vLLM caches."""
    from ember.archive import bundle
    from ember.identity import ArchiveIdentity, CompatKey, Parallelism
    from ember.store import LocalStore
    from ember_testing.synthetic import synthetic_graphset, synthetic_images

    _tree(tmp_path / "save")
    packed = compile_cache.pack(tmp_path / "save")
    assert packed is not None
    ident = ArchiveIdentity(model="m", engine="vllm", engine_version="0.26.0", capture_sizes=(1, 2),
                            parallelism=Parallelism(tensor=tensor))
    compat = CompatKey(gpu_name="NVIDIA H200", compute_capability="9.0", driver="580", cuda="13.0",
                       torch="2.11.0")
    store = LocalStore(tmp_path / "store")
    bundle.write_archive(store, synthetic_graphset(graphs=2, nodes=20, groups=1), ident, compat,
                         kernel_images=synthetic_images(), attachments={compile_cache.NAME: packed},
                         engine=engine)
    return tmp_path / "store" / "archives" / ident.hash()


@pytest.fixture
def plugin_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from ember.engines.vllm import plugin

    monkeypatch.setattr(plugin, "STATE", plugin._State())
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "pod"))
    monkeypatch.setenv("EMBER_VLLM_REPORT", str(tmp_path / "report.json"))
    monkeypatch.delenv(compile_cache.PLACED, raising=False)
    return plugin


def test_load_places_the_caches_when_vllm_starts_once_per_process_tree(
    plugin_state, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """The plugin puts the archive's caches in place as vLLM loads it (before vLLM resolves the
    model's class, which reads `modelinfos/`), marks the cache root for vLLM's own child
    processes, and the runner's attached() then leaves it alone."""
    import json

    archive = _archive_with_caches(tmp_path)
    monkeypatch.setenv("EMBER_VLLM_ARCHIVE", str(archive))
    plugin_state.place_caches()
    info = tmp_path / "pod" / "modelinfos" / INFO
    assert info.read_text() == '{"hash": "9e"}'
    stage = json.loads((tmp_path / "report.json").read_text())["stages"]["compile_cache"]
    assert stage["placed"] == 4 and stage["process"] == "plugin"
    assert os.environ[compile_cache.PLACED] == str(tmp_path / "pod")

    info.unlink()  # a second process of the same tree: nothing unpacked again
    plugin_state.place_caches()
    assert not info.exists() and compile_cache.placed_here()  # the runner's attached() skips too
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "elsewhere"))  # another root: placed there
    assert not compile_cache.placed_here()
    plugin_state.place_caches()
    assert (tmp_path / "elsewhere" / "modelinfos" / info.name).is_file()


@pytest.mark.parametrize("compiled_with", [None, ["vocab-bounds"]])
def test_a_tp2_archive_whose_save_did_not_name_the_vocab_patch_leaves_its_code_unplaced(
    plugin_state, compiled_with: list[str] | None, tmp_path: Path,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Code compiled without the patch holds rank 0's vocabulary bounds: vLLM would load it by
    its config and run it on every rank. Such an archive's caches are never placed (the runner's
    accept refuses it too), so the pod compiles its own code."""
    import json

    engine = {"compiled_with": compiled_with} if compiled_with else {}
    monkeypatch.setenv("EMBER_VLLM_ARCHIVE", str(_archive_with_caches(tmp_path, tensor=2, engine=engine)))
    plugin_state.place_caches()
    stage = json.loads((tmp_path / "report.json").read_text())["stages"]["compile_cache"]
    placed = (tmp_path / "pod" / "modelinfos" / INFO).is_file()
    if compiled_with:
        assert placed and stage["placed"] == 4
    else:
        assert not placed and "vocabulary bounds" in stage["refused"]
        assert compile_cache.PLACED not in os.environ


def test_an_unreadable_archive_leaves_placing_to_the_runner(plugin_state, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setenv("EMBER_VLLM_ARCHIVE", str(tmp_path / "store" / "archives" / ("0" * 64)))
    plugin_state.place_caches()  # must not raise: vLLM is starting
    stages = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert "compile_cache" not in stages and stages["compile_cache_early"]["error"]
    assert compile_cache.PLACED not in os.environ and not (tmp_path / "pod").exists()


def test_processes_of_one_start_add_their_stages_to_one_report(plugin_state, tmp_path: Path) -> None:
    """vLLM's front end and its engine core write the same report one after the other."""
    import json

    plugin_state.report("compile_cache", placed=3)  # the front end
    plugin_state.STATE = plugin_state._State()  # the engine core: its own process state
    plugin_state.report("capture", how="restored")
    stages = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert stages["compile_cache"]["placed"] == 3 and stages["capture"]["how"] == "restored"


@pytest.mark.parametrize("mode", ["save", "load", "probe", "off"])
def test_save_and_load_keep_tritons_home_under_the_cache_root(
    plugin_state, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """What Triton compiles into its default cache while SAVE runs ships with the archive, and a
    fresh pod's LOAD finds it there, not in whatever `~/.triton` the machine has. The SAVE Job's
    sizing probe (no mode, a report) compiles into the same home, for SAVE to find."""
    if mode == "probe":
        monkeypatch.setenv("EMBER_VLLM_PROBE", "1")
        monkeypatch.setenv("EMBER_VLLM_REPORT", str(tmp_path / "probe.report.json"))
    monkeypatch.setenv("EMBER_MODE", "off" if mode == "probe" else mode)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "inherited"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(plugin_state, "after_import", lambda *a: None)  # no vLLM worker module here
    monkeypatch.setattr(plugin_state, "place_caches", lambda: None)
    plugin_state.register()
    want = tmp_path / "pod" / compile_cache.TRITON_HOME if mode != "off" else tmp_path / "inherited"
    assert os.environ["TRITON_HOME"] == str(want)
    # named, so Inductor (which points Triton at its own cache when none is) cannot move it
    assert os.environ.get("TRITON_CACHE_DIR") == (str(want / ".triton" / "cache") if mode != "off" else None)
