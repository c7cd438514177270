# One-GPU work owed to issues 34 and 36 (the vLLM kit parked), for `bash e2e/gpu-lanes.sh start x1 TAG` (copy to
# /tmp/ember-run/x1.q). Poll again at once after each poll: a machine idle for 30 s is released with its lanes.
# First the canary: its CPU tests with torch, then the one-GPU cases on both runners with the per-piece
# fingerprints and the 0x5A poison (benchmarks/results/h200-20261202e: kernel-arg refused on V2, passed on V1
# with wrong tokens), against SAVE's fingerprints and against eager steps (how N ranks check); skip-kernel and
# stale-update were refused on both runners before (h200-20261202c) and run last; then the full-depth Llama
# bench with the single AOT artifact (whether it can be the default).
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_fingerprint.py tests/unit/test_vllm_canary_steps.py tests/unit/test_vllm_canary_plan.py tests/unit/test_vllm_canary_paths.py > /tmp/ember-run/unit-canary.txt 2>&1; tail -5 /tmp/ember-run/unit-canary.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_GPU_ENGINE_TIMEOUT_S=420; timeout 1300 python3 -m pytest -m gpu -p no:cacheprovider -rA --basetemp=/tmp/ember-run/pt/c1 tests/gpu/test_vllm_canary.py -k "not tp2 and not skip-kernel and not stale-update" > /tmp/ember-run/canary-pieces.txt 2>&1; tail -30 /tmp/ember-run/canary-pieces.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_VLLM_MEGA_AOT=1; timeout 900 ember bench vllm --model llama-3-8b --loads 4 --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wm --out-dir /tmp/ember-run/bench-mega > /tmp/ember-run/bench-llama-mega.txt 2>&1; tail -30 /tmp/ember-run/bench-llama-mega.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_GPU_ENGINE_TIMEOUT_S=420; timeout 900 python3 -m pytest -m gpu -p no:cacheprovider -rA --basetemp=/tmp/ember-run/pt/c2 tests/gpu/test_vllm_canary.py -k "skip-kernel or stale-update" > /tmp/ember-run/canary-other-faults.txt 2>&1; tail -20 /tmp/ember-run/canary-other-faults.txt
