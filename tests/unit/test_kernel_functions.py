"""KernelFunctions: kernels resolved the first time a prepared graph needs them, per kernel or
in one batch call (LOAD's `ember_functions`)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cuda.bindings")

from ember.runtime.graphs.kernels import KernelFunctions


def test_a_batch_resolves_only_what_is_missing_in_one_call_per_take() -> None:
    calls: list[list[int]] = []

    def many(idx: list[int]) -> list[int]:
        calls.append(idx)
        return [1000 + i for i in idx]

    kf = KernelFunctions(6, resolve_many=many)
    assert kf.take(np.array([3, 1, 3])).tolist() == [1003, 1001, 1003]
    assert kf.take(np.array([1, 4, 5])).tolist() == [1001, 1004, 1005]
    assert calls == [[1, 3], [4, 5]]  # each kernel once, duplicates and known ones left out
    assert kf.resolved == 4 and kf[3] == 1003 and len(calls) == 2


def test_a_failed_batch_resolves_none_of_it_and_raises_each_time() -> None:
    def many(idx: list[int]) -> list[int]:
        raise LookupError(f"no kernel {idx[0]}")

    kf = KernelFunctions(3, resolve_many=many)
    for _ in range(2):
        with pytest.raises(LookupError, match="no kernel 0"):
            kf.take(np.array([0, 2]))
    assert kf.resolved == 0


def test_per_kernel_resolution_applies_attributes_and_one_mechanism_is_required() -> None:
    applied: list[tuple[int, str]] = []
    kf = KernelFunctions(2, lambda i: 7 + i, ["a", "b"], lambda f, a: applied.append((f, a)))  # type: ignore[list-item]
    assert list(kf) == [7, 8] and applied == [(7, "a"), (8, "b")]
    with pytest.raises(TypeError):
        KernelFunctions(2)
    with pytest.raises(TypeError):
        KernelFunctions(2, lambda i: i, resolve_many=lambda idx: idx)
