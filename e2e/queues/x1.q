# One-GPU work owed to issues 34 and 36 (the vLLM kit parked), for `bash e2e/gpu-lanes.sh start x1 TAG` (copy to
# /tmp/ember-run/x1.q). Poll again at once after each poll: a machine idle for 30 s is released with its lanes.
# First the canary faults h200-20261203 left: own-exec again (the fault leaked into the templates' graphs and
# was refused on the wrong path; f64ef1f), skip-kernel and stale-update with the per-piece prints, a clean
# restore beside them (~500 s); then the full-depth Llama bench with the single AOT artifact, which has run
# only on H200 (on an H100 this is its first run there).
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_fingerprint.py tests/unit/test_vllm_canary_steps.py tests/unit/test_vllm_canary_plan.py tests/unit/test_vllm_canary_paths.py tests/unit/test_fault_injection.py > /tmp/ember-run/unit-canary.txt 2>&1; tail -5 /tmp/ember-run/unit-canary.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_GPU_ENGINE_TIMEOUT_S=420; timeout 1300 python3 -m pytest -m gpu -p no:cacheprovider -rA --basetemp=/tmp/ember-run/pt/c1 tests/gpu/test_vllm_canary.py -k "not tp2 and (own-exec or skip-kernel or stale-update or passes_its_canary)" > /tmp/ember-run/canary-faults.txt 2>&1; tail -30 /tmp/ember-run/canary-faults.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_VLLM_MEGA_AOT=1; timeout 900 ember bench vllm --model llama-3-8b --loads 4 --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wm --out-dir /tmp/ember-run/bench-mega > /tmp/ember-run/bench-llama-mega.txt 2>&1; tail -30 /tmp/ember-run/bench-llama-mega.txt
