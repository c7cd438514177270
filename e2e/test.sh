#!/usr/bin/env bash
# The one test command: starts the local control plane + MinIO if needed (e2e/cluster.sh up,
# a no-op when running), then runs pytest over every tier. GPU tests skip themselves with a
# reason on machines without a GPU. Extra arguments go to pytest (e.g. -m "not k8s", -k smoke).
# The cluster is left running for fast reruns: stop it with `e2e/cluster.sh down`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi

e2e/cluster.sh up

set +e
python -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  # pytest's "no tests collected" (e.g. a -k filter that matches nothing) is not a failure.
  echo "e2e/test.sh: pytest collected no tests" >&2
  rc=0
fi
exit $rc
