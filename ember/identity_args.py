"""Which engine arguments and which image facts are part of an archive identity.

The rule: every engine argument changes the captured graphs unless it is on `NOT_GRAPH_ARGS`, a
list of arguments known to act only around the engine (HTTP front end, logging, names, tokenizer,
downloads). So `--quantization`, `--kv-cache-dtype`, `--max-model-len`, `--enforce-eager`,
`--block-size`, `--max-num-seqs`, `--compilation-config`, `--gpu-memory-utilization` and any
argument ember does not know are identity; `--port` or `--api-key` are not. An unknown argument
costs at worst one extra SAVE; a wrongly ignored one would restore graphs of another
configuration, so the list is short on purpose.

`graph_args` also canonicalizes what it keeps (`--a_b=1` → `--a-b 1`; flags in name order, each
flag's values in place, repeated flags in their order), so two spellings of one configuration
name one archive. `image_digest` reads the digest out of a pinned image reference.
Used by the operator (`ModelDeploymentSpec.identity`); no engine import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# Arguments that never change a graph, and whether each takes a value (False: a switch; vLLM's
# `--no-<switch>` forms are switches too).
NOT_GRAPH_ARGS: dict[str, bool] = {
    # HTTP front end, TLS, CORS, API keys
    "--host": True,
    "--port": True,
    "--uds": True,
    "--root-path": True,
    "--api-key": True,
    "--allowed-origins": True,
    "--allowed-methods": True,
    "--allowed-headers": True,
    "--allow-credentials": False,
    "--ssl-keyfile": True,
    "--ssl-certfile": True,
    "--ssl-ca-certs": True,
    "--ssl-cert-reqs": True,
    "--middleware": True,
    "--api-server-count": True,
    "--disable-fastapi-docs": False,
    "--enable-request-id-headers": False,
    "--enable-server-load-tracking": False,
    "--disable-frontend-multiprocessing": False,
    # names, chat and tool formatting (text in and out, not the model's kernels)
    "--served-model-name": True,
    "--chat-template": True,
    "--chat-template-content-format": True,
    "--response-role": True,
    "--enable-auto-tool-choice": False,
    "--tool-call-parser": True,
    "--tool-parser-plugin": True,
    "--reasoning-parser": True,
    "--enable-prompt-tokens-details": False,
    "--tokenizer": True,
    "--tokenizer-revision": True,
    "--generation-config": True,
    # logging, metrics, tracing
    "--uvicorn-log-level": True,
    "--disable-uvicorn-access-log": False,
    "--disable-log-stats": False,
    "--disable-log-requests": False,
    "--enable-log-requests": False,
    "--max-log-len": True,
    "--otlp-traces-endpoint": True,
    "--collect-detailed-traces": True,
    # where weights come from (the revision is identity already)
    "--download-dir": True,
    # `ember serve` (the transformers engine): the hand-off's wait and a request limit
    "--deadline": True,
    "--max-tokens-limit": True,
}

_DIGEST = re.compile(r"@(sha256:[0-9a-f]{64})$")


def _flag(token: str) -> str:
    """`--max_model_len` → `--max-model-len` (vLLM accepts both spellings)."""
    return "--" + token[2:].replace("_", "-")


def _split(args: Iterable[str]) -> list[str]:
    """`--a=1` → `--a`, `1`; flag names canonical."""
    out: list[str] = []
    for arg in args:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            out += [_flag(name), value] if eq else [_flag(name)]
        else:
            out.append(arg)
    return out


def _ignored(flag: str) -> bool | None:
    """None: part of the identity; else whether the ignored flag takes a value."""
    if flag in NOT_GRAPH_ARGS:
        return NOT_GRAPH_ARGS[flag]
    if flag.startswith("--no-") and NOT_GRAPH_ARGS.get("--" + flag[5:]) is False:
        return False
    return None


def graph_args(args: Iterable[str]) -> tuple[str, ...]:
    """The arguments of `args` that change graphs, canonical (see the module docstring)."""
    groups: list[list[str]] = []
    tokens = _split(args)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("--") and (takes := _ignored(token)) is not None:
            # an ignored flag and its value (never a following flag)
            i += 2 if takes and i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else 1
            continue
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
        i += 1
    positional = [g for g in groups if not g[0].startswith("--")]
    flags = sorted((g for g in groups if g[0].startswith("--")), key=lambda g: g[0])  # stable
    return tuple(t for g in positional + flags for t in g)


def image_digest(image: str) -> str:
    """`sha256:…` of an image pinned by digest (`repo@sha256:…`, `repo:tag@sha256:…`); "" for a
    tag alone (unknown: the tag may move, so the identity cannot include what it points at)."""
    match = _DIGEST.search(image)
    return match.group(1) if match else ""
