"""The SAVE Job, `ember save --job`: one entry for every engine.

The contract (ember/contract.py): the identity from EMBER_IDENTITY, parsed here once per process;
the store from EMBER_STORE; a JSON summary in the termination log and exit 0, or the reason there
and exit 1. The identity's engine picks the SAVE:
- `ember-decode`: ember's built-in decode workloads (`ember.engines.decode.workloads.save_identity`),
  a multi-GPU shape saved on ONE GPU under the NCCL stub;
- `vllm`: vLLM's two-process job (`ember.engines.vllm.job`) with the deployment's arguments
  (those after `--`).
Any other engine fails with its reason, and the deployment's pods capture natively.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from ember import contract
from ember.identity import ArchiveIdentity

Saver = Callable[[ArchiveIdentity, str, str, list[str]], dict[str, Any]]  # identity, raw, store, args


class JobFailed(RuntimeError):
    """The Job cannot run: its reason goes to the termination log as it is."""


def read_identity(env: dict[str, str] | None = None) -> tuple[ArchiveIdentity, str]:
    """EMBER_IDENTITY, parsed and validated: (the identity, its JSON as the operator wrote it)."""
    raw = (os.environ if env is None else env).get(contract.ENV_IDENTITY, "")
    if not raw:
        raise JobFailed(f"{contract.ENV_IDENTITY} is not set: the operator sets it on SAVE Jobs")
    try:
        return ArchiveIdentity.model_validate_json(raw), raw
    except ValueError as exc:
        raise JobFailed(f"{contract.ENV_IDENTITY} is not an archive identity: {exc}") from exc


def _decode(identity: ArchiveIdentity, raw: str, store: str, args: list[str]) -> dict[str, Any]:
    from ember.engines.decode.workloads import save_identity

    if args:
        raise JobFailed(f"ember-decode takes no engine arguments, got {args}")
    return save_identity(identity, store)


def _vllm(identity: ArchiveIdentity, raw: str, store: str, args: list[str]) -> dict[str, Any]:
    from ember.engines.vllm.job import save_job

    return save_job(raw, store, args)


SAVERS: dict[str, Saver] = {"ember-decode": _decode, "vllm": _vllm}


def run(store: str, args: list[str], log: Callable[[str], None] = print) -> int:
    """Run the SAVE the identity names; the Job's exit code. Never raises: every failure is a
    reason in the termination log."""
    try:
        identity, raw = read_identity()
        if not store:
            raise JobFailed(f"{contract.ENV_STORE} is not set: the operator sets it on SAVE Jobs")
        saver = SAVERS.get(identity.engine)
        if saver is None:
            raise JobFailed(f"engine {identity.engine!r} has no SAVE Job here (known: {', '.join(SAVERS)})")
        summary = saver(identity, raw, store, args)
    except Exception as exc:  # the contract: a reason, exit 1
        reason = f"SAVE failed: {type(exc).__name__}: {exc}"
        log(reason)
        contract.write_termination_log(reason)
        return 1
    contract.write_termination_log(summary)
    print(json.dumps(summary, indent=1))
    return 0
