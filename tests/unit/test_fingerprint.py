"""CPU (torch): `ember.runtime.proof.replay.fingerprint`, the exact hash the canaries and proofs
compare: order- and byte-sensitive, the same for a view at any offset as for its copy, and the
same numbers queued on the device (`fingerprints_on_device`) as read at once; its warm-up goes
through each of its paths."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ember.runtime.proof import replay  # noqa: E402
from ember.runtime.proof.replay import fingerprint, fingerprints_on_device  # noqa: E402


def test_a_view_at_an_odd_offset_hashes_as_its_copy() -> None:
    fused = torch.arange(11, dtype=torch.float32)  # q|k of a fused buffer: k starts 4 bytes in
    k = fused[1:6]
    assert k.data_ptr() % 8 == 4 and k.is_contiguous()
    assert fingerprint([k]) == fingerprint([k.clone()])
    # a strided view, and a tail of fewer than 8 bytes
    assert fingerprint([fused[::2]]) == fingerprint([fused[::2].contiguous()])
    assert fingerprint([fused[:3]]) != fingerprint([fused[:2]])


def test_every_byte_and_the_order_count() -> None:
    a, b = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    b.view(torch.uint8)[5] = 1
    assert fingerprint([a]) != fingerprint([b])
    assert fingerprint([a, b]) != fingerprint([b, a])
    swapped = torch.tensor([2.0, 1.0])
    assert fingerprint([torch.tensor([1.0, 2.0])]) != fingerprint([swapped])


def test_queued_numbers_are_the_ones_read_at_once() -> None:
    xs = [torch.randn(3, 5), torch.arange(7, dtype=torch.int32), torch.ones(1, dtype=torch.float16)]
    assert fingerprints_on_device(xs).tolist() == fingerprint(xs)
    assert fingerprint([]) == []


def test_the_warm_up_goes_through_every_path_of_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each path launches kernels of its own (whole words; the clone of a view at an odd offset;
    the sum of a tail of fewer than 8 bytes): the warm-up must take each, or the canary's first
    step still loads the one it skipped."""
    seen: list[torch.Tensor] = []
    real = replay.fingerprints_on_device

    def spy(tensors: list[torch.Tensor]) -> torch.Tensor:
        seen.extend(tensors)
        return real(tensors)

    monkeypatch.setattr(replay, "fingerprints_on_device", spy)
    assert replay.warm_fingerprints("cpu") >= 0.0
    nbytes = [t.numel() * t.element_size() for t in seen]
    words = [t.data_ptr() % 32 for t, n in zip(seen, nbytes, strict=True)
             if t.data_ptr() % 8 == 0 and n % 8 == 0]
    assert 0 in words and any(words)  # aligned for the widest vector loads, and for words only
    assert any(t.data_ptr() % 8 for t in seen)
    assert any(n % 8 for n in nbytes)
