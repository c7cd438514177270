"""vLLM's compile cache shipped with the archive: packed at SAVE, put back at LOAD (no vLLM needed)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from ember.engines.vllm import compile_cache


def _tree(root: Path) -> None:
    base = root / compile_cache.SUBDIR
    (base / "3f2a9c01de" / "rank_0_0" / "backbone").mkdir(parents=True)
    (base / "3f2a9c01de" / "rank_0_0" / "backbone" / "vllm_compile_cache.py").write_text("{'graph': 1}")
    (base / "3f2a9c01de" / "rank_0_0" / "backbone" / "artifact_shape_1").write_bytes(b"\x7fELF" * 300)
    (base / "torch_aot_compile" / "abc").mkdir(parents=True)
    (base / "torch_aot_compile" / "abc" / "model").write_bytes(b"aot" * 100)
    (base / "torch_aot_compile" / "abc" / "model.lock").write_text("")  # per process: not shipped


def _files(root: Path) -> dict[str, bytes]:
    base = root / compile_cache.SUBDIR
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}


def test_the_tree_comes_back_under_another_root(tmp_path: Path) -> None:
    _tree(tmp_path / "save")
    data = compile_cache.pack(tmp_path / "save")
    assert data is not None
    done = compile_cache.unpack(data, tmp_path / "pod")
    want = {k: v for k, v in _files(tmp_path / "save").items() if not k.endswith(".lock")}
    assert _files(tmp_path / "pod") == want and len(want) == 3
    assert done["placed"] == 2 and done["kept"] == 0  # two top-level entries, each placed whole
    # no scratch directory is left behind
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
    assert done == {**done, "placed": 1, "kept": 1}
    # unpacking again changes nothing
    again = compile_cache.unpack(data, tmp_path / "pod")
    assert again["placed"] == 0 and again["kept"] == 2


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
    [_file("ok/a"), _file("../escaped")],
    [_link("ok/link", "/etc/passwd")],
    [_link("ok/link", "../../outside")],
])
def test_an_unsafe_tar_places_nothing(tmp_path: Path, bad: list) -> None:
    with pytest.raises(tarfile.TarError):
        compile_cache.unpack(_tar(*bad), tmp_path / "pod")
    assert list((tmp_path / "pod" / compile_cache.SUBDIR).iterdir()) == []
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "pod" / "escaped").exists()


def test_an_absolute_member_lands_inside_the_tree(tmp_path: Path) -> None:
    compile_cache.unpack(_tar(_file("/abs/path", b"in")), tmp_path / "pod")  # the "data" filter
    assert (tmp_path / "pod" / compile_cache.SUBDIR / "abs" / "path").read_bytes() == b"in"


def test_nothing_compiled_packs_nothing(tmp_path: Path) -> None:
    assert compile_cache.pack(tmp_path) is None
    (tmp_path / compile_cache.SUBDIR / "empty-dir").mkdir(parents=True)
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
