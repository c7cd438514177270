#!/usr/bin/env bash
# Detached lanes of GPU work on a lent GPU machine, each on its own frozen build of this tree, so a
# later call that syncs a newer tree never changes what a running lane imports, and a command's
# time limit never cuts a run. Run from the repository root:
#
#   bash e2e/gpu-lanes.sh setup TAG      # ember as the tree is now -> /tmp/ember-TAG (not editable),
#                                        # tests -> /tmp/snap-TAG, env -> /tmp/ember-env-TAG.sh
#   echo "CMD" >> /tmp/ember-run/NAME.q  # one bash command a line (cwd /tmp/snap-TAG)
#   bash e2e/gpu-lanes.sh start NAME TAG # run NAME.q's lines in order, detached: NAME.log, NAME.rc
#   bash e2e/gpu-lanes.sh poll SECS      # wait until every lane ended (or SECS); tails; $OUT/run.tgz
#   bash e2e/gpu-lanes.sh poll SECS next # ... or until any lane ends a line (spend no budget on a
#                                        # line that cannot finish in it)
#
# pytest lines: `--basetemp=/tmp/ember-run/pt/NAME` keeps each test's engine logs and reports where
# `poll` packs them (pytest's own temp root keeps only its last three runs), caches and stores left out.
# `touch /tmp/ember-run/stop-NAME` (or stop-all) skips a lane's remaining lines; `halt NAME|all`
# also kills what it runs (a `pkill -f PATTERN` in a call's command matches that command's own
# shell). Carried wheels in .whl/ go to /tmp/site (as e2e/gpu-env.sh does); an unpacked vLLM kit in
# /tmp/vsite (and extras in /tmp/vsite3) joins the path of builds set up after it. One GPU: two
# lanes at most, or memory runs out (benchmarks/results/h200-20261129/README.md), and two vLLM
# lanes there can still clash: a start fails if the other's engine frees memory while it profiles
# (h200-20261201d; tests/gpu/test_vllm_canary.py starts such an engine once more); several GPUs:
# CUDA_VISIBLE_DEVICES per line. vLLM on several GPUs runs alone: it refuses to start when another
# process frees memory on its GPUs while it profiles (benchmarks/results/h200x2-20261129e).
set -uo pipefail
RUN=${RUN:-/tmp/ember-run}
mkdir -p "$RUN/pt"  # pytest --basetemp=$RUN/pt/NAME needs its parent (it makes only the last part)

setup() {
  local tag=$1 t0=$SECONDS lib
  if [[ ! -d /tmp/site ]] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  fi
  rm -rf "/tmp/ember-$tag" "/tmp/snap-$tag" && mkdir -p "/tmp/snap-$tag"
  cp -a tests pyproject.toml "/tmp/snap-$tag/"
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --target "/tmp/ember-$tag" . \
    || return 1
  lib=$(cd / && PYTHONPATH="/tmp/ember-$tag:/tmp/site" python3 -c 'import ember.native as n; print(n.find_library())')
  echo "export PYTHONPATH=/tmp/ember-$tag:/tmp/site PATH=/tmp/ember-$tag/bin:\$PATH EMBER_LIB=$lib PYTHONUNBUFFERED=1" \
    > "/tmp/ember-env-$tag.sh"
  if [[ -f /tmp/vsite/vllm/__init__.py ]]; then
    echo 'export PYTHONPATH=/tmp/vsite:$PYTHONPATH:/tmp/vsite3 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1' \
      >> "/tmp/ember-env-$tag.sh"
  fi
  echo "setup $tag: $((SECONDS - t0)) s, EMBER_LIB=$lib"
}

lane() {  # the detached loop of `start`
  local name=$1 tag=$2 line s rc
  # shellcheck disable=SC1090
  source "/tmp/ember-env-$tag.sh"; cd "/tmp/snap-$tag" || exit 1
  while IFS= read -r line; do
    [[ -z "$line" ]] && continue
    if [[ -e $RUN/stop-$name || -e $RUN/stop-all ]]; then echo "## skipped (stop): $line"; continue; fi
    s=$SECONDS; echo "## $(date -u +%T) >>> $line"
    bash -c "$line" < /dev/null; rc=$?
    echo "## $(date -u +%T) rc=$rc after $((SECONDS - s)) s: $line"
  done < "$RUN/$name.q"
  echo done > "$RUN/$name.rc"
}

start() {
  rm -f "$RUN/$1.rc"
  RUN=$RUN setsid nohup bash "$(realpath "$0")" lane "$1" "$2" >> "$RUN/$1.log" 2>&1 < /dev/null &
  echo $! > "$RUN/$1.pid"  # setsid: the lane leads its own process group
  echo "lane $1 on $2: $(wc -l < "$RUN/$1.q") commands"
}

halt() {  # a lane (or all) stopped now, whatever it runs: every process of its session killed
  local p     # (not just its group: `timeout` puts its command in a group of its own)
  for p in "$RUN"/${1/#all/*}.pid; do
    [[ -e $p ]] || continue
    touch "$RUN/stop-$(basename "$p" .pid)"
    pkill -KILL -s "$(cat "$p")" 2>/dev/null && echo "halted $(basename "$p" .pid)"
    echo halted > "${p%.pid}.rc"
  done
}

poll() {  # `poll SECS next`: also back as soon as any lane ends a line (the budget's last calls)
  local end=$((SECONDS + ${1:-500})) left l ended
  if ! compgen -G "$RUN/*.log" >/dev/null; then  # nothing to wait for: do not spend the call
    echo "no lanes in $RUN: a fresh machine (the one that ran them was released when idle)"; return 3
  fi
  ended=$(cat "$RUN"/*.log | grep -c "^## .* rc=")
  while ((SECONDS < end)); do
    left=0; for l in "$RUN"/*.log; do [[ -e ${l%.log}.rc ]] || left=$((left + 1)); done
    ((left == 0)) && break
    [[ ${2:-} == next ]] && (($(cat "$RUN"/*.log | grep -c "^## .* rc=") > ended)) && break
    sleep "${POLL_EVERY:-10}"
  done
  for l in "$RUN"/*.log; do
    echo "===== $(basename "$l" .log): $(cat "${l%.log}.rc" 2>/dev/null || echo running)"
    grep -E "^## |passed|failed|rror|wrong" "$l" | tail -"${TAILN:-12}"
  done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null
  [[ -n "${OUT:-}" ]] && pack
}

pack() {  # $OUT/run.tgz: the lanes' logs and queues, every small log and report under $RUN, and
           # Inductor's autotuning choices (*.best_config) and generated code in the runs' vLLM caches,
           # the Triton kernels' metadata in their Triton homes (which kernels a run compiled)
  (cd "$RUN" && find . \( -name store -o -name 'cache*' ! -path '*/triton-home/*' -o -name work -o -name config \) \
    -prune -o -type f \
    \( -name '*.log' -o -name '*.txt' -o -name '*.json' -o -name '*.md' -o -name '*.q' -o -name '*.rc' \
    -o -name '*.best_config' -o -path '*/inductor_cache/*/*.py' \) \
    -size -4M -print) | tar -C "$RUN" -czf "$OUT/run.tgz" -T -
}

cmd=${1:-}; shift || true
case "$cmd" in
  setup|lane|start|poll|pack|halt) "$cmd" "$@" ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
