"""Archive identity derivation from a ModelDeployment spec."""

from __future__ import annotations

from operator_helpers import md_spec

from ember_operator.api import CaptureSpec, IdentitySpec


def test_identity_is_stable_and_ignores_scaling_fields() -> None:
    a = md_spec(replicas=1)
    b = md_spec(replicas=7, warmPool={"size": 3})
    assert a.identity().hash() == b.identity().hash()


def test_parallelism_and_gpu_change_the_identity() -> None:
    base = md_spec().identity().hash()
    ep = md_spec(parallelism={"data": 2, "expert": 2}, gpu={"product": "NVIDIA-H100-80GB-HBM3", "count": 2})
    other_gpu = md_spec(gpu={"product": "NVIDIA-H200"})
    assert ep.identity().hash() != base
    assert other_gpu.identity().hash() != base
    assert ep.identity().parallelism.expert == 2


def test_presets_resolve_to_sizes() -> None:
    assert CaptureSpec(preset="small", max_batch=4).resolved_sizes() == (1, 2, 4)
    assert CaptureSpec(preset="powers-of-two", max_batch=40).resolved_sizes() == (1, 2, 4, 8, 16, 32)
    default = CaptureSpec(max_batch=512).resolved_sizes()
    assert default[:4] == (1, 2, 4, 8) and default[-1] == 512 and list(default) == sorted(default)


def test_identity_spec_round_trips() -> None:
    ident = md_spec().identity()
    assert IdentitySpec.of(ident).to_identity() == ident
    assert IdentitySpec.of(ident).to_identity().hash() == ident.hash()
