"""The SAVE Job, `ember save --job`: one entry for every engine.

The contract (ember/contract.py): the identity from EMBER_IDENTITY, parsed here once per process
and checked against EMBER_IDENTITY_HASH (the operator's name for the archive: its pods look for
`<store>/archives/<that hash>`, and every SAVE publishes under this identity); the store from
EMBER_STORE; a JSON summary in the termination log and exit 0, or the reason there and exit 1.
The identity's engine picks the SAVE, with the deployment's engine arguments (those after `--`):
- `ember-decode`: ember's built-in decode workloads (`ember.engines.decode.workloads.save_identity`),
  a multi-GPU shape saved on ONE GPU under the NCCL stub; no arguments;
- `vllm`: vLLM's two-process job (`ember.engines.vllm.job`);
- `transformers`: the SAVE of `ember serve --save-to` (`ember.serving.server.save`), the arguments
  read as `ember serve` options after the identity's model, as the deployment's pods run them
  (`ember.contract.serve_args`: `--model <model>` unless they name `--model NAME|DIR` or
  `--model-config FILE`; then `--layers`, `--seed`, `--num-blocks`, `--block-size`, …; what a pod's
  command sets, `--host` or `--save-to` …, refused as the operator's admission does:
  `ember.serving.options.pod_options`). Its pods build the same model and sizing.
Any other engine fails with its reason, and the deployment's pods capture natively.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ember import contract
from ember.identity import ArchiveIdentity, identity_short
from ember.serving import server
from ember.serving.options import pod_options

Saver = Callable[[ArchiveIdentity, str, str, list[str]], dict[str, Any]]  # identity, raw, store, args


class JobFailed(RuntimeError):
    """The Job cannot run: its reason goes to the termination log as it is."""


def read_identity(env: Mapping[str, str] | None = None) -> tuple[ArchiveIdentity, str]:
    """EMBER_IDENTITY, parsed and validated: (the identity, its JSON as the operator wrote it)."""
    env = os.environ if env is None else env
    raw = env.get(contract.ENV_IDENTITY, "")
    if not raw:
        raise JobFailed(f"{contract.ENV_IDENTITY} is not set: the operator sets it on SAVE Jobs")
    try:
        identity = ArchiveIdentity.model_validate_json(raw)
    except ValueError as exc:
        raise JobFailed(f"{contract.ENV_IDENTITY} is not an archive identity: {exc}") from exc
    named = env.get(contract.ENV_IDENTITY_HASH, "")
    if named and named != identity.hash():
        raise JobFailed(f"{contract.ENV_IDENTITY} hashes to {identity_short(identity.hash())}…, not to "
                        f"{contract.ENV_IDENTITY_HASH} {identity_short(named)}…: the pods would not find "
                        "the archive")
    return identity, raw


def _decode(identity: ArchiveIdentity, raw: str, store: str, args: list[str]) -> dict[str, Any]:
    from ember.engines.decode.workloads import save_identity

    if args:
        raise JobFailed(f"ember-decode takes no engine arguments, got {args}")
    return save_identity(identity, store)


def _vllm(identity: ArchiveIdentity, raw: str, store: str, args: list[str]) -> dict[str, Any]:
    from ember.engines.vllm.job import save_job

    return save_job(raw, store, args)


def _transformers(identity: ArchiveIdentity, raw: str, store: str, args: list[str]) -> dict[str, Any]:
    from ember.runtime.session import reexec_under_libember

    options = transformers_options(identity, args)
    reexec_under_libember("save")  # the pod preloads libember; SAVE needs it in save mode
    _need_gpu()
    result = server.save(options, store, identity)
    if not result.published:
        raise JobFailed(result.reason or "the archive was not published")
    return json.loads(json.dumps(result.summary(), default=str))  # as `ember serve --save-to` prints it


def transformers_options(identity: ArchiveIdentity, args: list[str]) -> server.ServeOptions:
    """The `ember serve` options the engine arguments give after the identity's model (as the
    deployment's pods run them: `ember.serving.options.pod_options`), checked with the identity before
    anything starts: JobFailed with what cannot be saved."""
    problems = _cb_identity_problems(identity)
    if problems:
        raise JobFailed("; ".join(problems))
    try:
        options = pod_options(identity.model, args)
    except server.UsageError as exc:
        raise JobFailed(f"engine.args: {exc}") from None
    _check_model(options)
    return options


def _cb_identity_problems(identity: ArchiveIdentity) -> list[str]:
    """Why `ember serve` cannot be the engine the identity names (empty: it can)."""
    from ember.engines.transformers_cb.hooks import engine_version

    out = []
    p = identity.parallelism
    if p.tensor * p.expert * p.data > 1:
        out.append(f"transformers' continuous batching runs on one GPU: no SAVE of a parallel shape "
                   f"(tensor {p.tensor}, expert {p.expert}, data {p.data})")
    if identity.dtype != "bfloat16":
        out.append(f"dtype {identity.dtype}: `ember serve` builds bfloat16 models")
    here, want = engine_version(), identity.engine_version
    if here is None:
        out.append("transformers is not installed in the engine image")
    elif here != want and not here.startswith(want + "."):  # "5.17" names 5.17.0
        out.append(f"the identity names transformers {want}, the engine image has {here}")
    return out


def _check_model(options: server.ServeOptions) -> None:
    """A model `ember serve` can build: a checkpoint directory, a built-in shape or a config file."""
    from ember.engines.transformers_cb.engine import model_config_dict

    if options.model is not None and Path(options.model).is_dir():
        return
    try:
        model_config_dict(options.model, options.model_config, options.layers)
    except (OSError, ValueError) as exc:
        raise JobFailed(f"no model to build: {exc} (engine.args name it: --model NAME|DIR or "
                        "--model-config FILE)") from None


def _need_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise JobFailed("no CUDA GPU visible: the SAVE Job runs on one (nvidia.com/gpu: 1)")


SAVERS: dict[str, Saver] = {"ember-decode": _decode, "transformers": _transformers, "vllm": _vllm}


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
