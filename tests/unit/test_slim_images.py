"""SAVE's cut of the graphs' kernel images (ember.runtime.slim_images), with a stand-in for
libember: which images are cut, where the graph set's references then point, and when an image
stays whole. The real library and driver run in tests/gpu (test_kernel_images_gpu.py, and every
SAVE/LOAD test, whose proof replays the graphs with the cut images)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from ember.archive import kernel_images as ki
from ember.archive.graphs import GraphSet, KernelRef
from ember.native import EmberError
from ember.runtime import slim_images

DATA = Path(__file__).resolve().parents[1] / "data" / "kernel_images"


class StandIn:
    """libember's catalog as slim uses it: image bytes by hash, preload, function lookup."""

    def __init__(self, images: dict[str, bytes]) -> None:
        self.images = dict(images)
        self.preloaded: dict[str, bytes] = {}
        self.handles: dict[tuple[str, str], int] = {}  # (image, kernel) -> a function handle

    def catalog(self) -> list[dict[str, Any]]:
        return [{"hash": h, "jit_options": {}, "library_options": {"1": 0}} for h in self.images]

    def image_bytes(self, h: str) -> bytes:
        if h not in self.images:
            raise EmberError(f"image_bytes: no image {h}")
        return self.images[h]

    def hash(self, data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def preload(self, items: list[tuple[str, bytes, dict[str, Any]]]) -> None:
        for h, data, _ in items:
            assert self.hash(data) == h
            self.preloaded[h] = data

    def function(self, h: str, name: str) -> int:
        data = self.images.get(h) or self.preloaded.get(h)
        if data is None:
            raise EmberError(f"function: unknown image {h}")
        cubin = ki.fatbin_cubin(data, 90) if ki.is_fatbin(data) else data
        e = ki._read(cubin or b"")
        if name not in [n for n, s in zip(e.sym_names, e.syms, strict=True) if s[1] & 0xF == 2]:
            raise EmberError(f"function: no kernel {name} in image {h}")
        return self.handles.setdefault((h, name), len(self.handles) + 1)

    def from_cut_image(self, func: int) -> bool:
        return any(f == func and h in self.preloaded for (h, _), f in self.handles.items())


def same_attrs(func: int) -> list[int]:
    return [1] * 17


def graph_set(refs: list[KernelRef]) -> GraphSet:
    return GraphSet(graphs=[], kernels=list(refs), function_attrs=[])


@pytest.fixture
def fat() -> tuple[str, bytes]:
    data = (DATA / "fixture.fatbin").read_bytes()
    return hashlib.sha256(data).hexdigest(), data


def test_a_fatbin_is_replaced_by_its_cut_and_the_references_follow(fat: tuple[str, bytes]) -> None:
    h, data = fat
    ip = StandIn({h: data})
    gs = graph_set([KernelRef(h, "uses_helper"), KernelRef(h, "checks"), KernelRef(h, "uses_helper")])
    rep = slim_images.slim(ip, gs, 90, log=lambda _: None, attrs=same_attrs)  # type: ignore[arg-type]
    assert rep.images == 1 and list(rep.replaced) == [h]
    new = rep.replaced[h]
    assert [k.image for k in gs.kernels] == [new] * 3 and [k.name for k in gs.kernels][1] == "checks"
    cut = ip.preloaded[new]
    assert ki.is_cubin(cut) and rep.bytes_after == len(cut) and rep.bytes_before == len(data)
    e = ki._read(cut)
    entries = {n for n, s in zip(e.sym_names, e.syms, strict=True) if s[1] & 0xF == 2 and s[2] & 0x10}
    assert entries == {"uses_helper", "checks"}
    slim_images.undo(gs, rep)
    assert [k.image for k in gs.kernels] == [h] * 3


def test_an_image_stays_whole_when_it_cannot_be_cut_or_its_kernels_change(fat: tuple[str, bytes]) -> None:
    h, data = fat
    other = (DATA / "fixture.sm_90.cubin").read_bytes()
    h2 = hashlib.sha256(other).hexdigest()
    ip = StandIn({h: data, h2: other, "0" * 64: b"not an image at all"})
    refs = [KernelRef(h, "not_in_it"), KernelRef(h2, "plain"), KernelRef("0" * 64, "x")]
    gs = graph_set(refs)
    rep = slim_images.slim(ip, gs, 90, log=lambda _: None, attrs=same_attrs)  # type: ignore[arg-type]
    assert rep.images == 1 and set(rep.kept_whole) == {h, "0" * 64}
    assert "no kernel not_in_it" in rep.kept_whole[h]
    assert gs.kernels[0] == refs[0] and gs.kernels[2] == refs[2] and gs.kernels[1].image != h2

    # attributes that differ once cut (registers, shared memory, ...) keep the image whole
    gs = graph_set([KernelRef(h2, "plain")])
    differ = lambda f: [int(ip.from_cut_image(f))] * 17  # noqa: E731
    rep = slim_images.slim(ip, gs, 90, log=lambda _: None, attrs=differ)  # type: ignore[arg-type]
    assert (
        rep.images == 0
        and "attributes differ" in rep.kept_whole[h2]
        and gs.kernels == [KernelRef(h2, "plain")]
    )


def test_an_image_already_cut_to_its_kernels_is_left_as_it_is(fat: tuple[str, bytes]) -> None:
    cut = ki.prune((DATA / "fixture.sm_90.cubin").read_bytes(), {"plain"})
    h = hashlib.sha256(cut).hexdigest()
    ip = StandIn({h: cut})
    gs = graph_set([KernelRef(h, "plain")])
    rep = slim_images.slim(ip, gs, 90, log=lambda _: None, attrs=same_attrs)  # type: ignore[arg-type]
    assert (
        rep.images == 0 and not rep.kept_whole and gs.kernels == [KernelRef(h, "plain")] and not ip.preloaded
    )
