# One-GPU work owed to issues 34 and 36 (nvidia-h200, the vLLM kit parked), for `bash e2e/gpu-lanes.sh start x1 TAG`
# (copy to /tmp/ember-run/x1.q). First the canary's scratch: its CPU tests with torch, then a clean restore and the
# kernel-argument faults on both runners, whose report now says what scratch was poisoned and what SAVE found
# (benchmarks/results/h200-20261202d); then the full-depth Llama bench on the default path (no single AOT artifact)
# with torch's ptxas pinned, half its LOADs without the canary (what the canary adds at full depth),
# then with the single artifact at 4 more LOADs (whether it can be the default; last, cut first when the budget ends).
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_vllm_canary_steps.py tests/unit/test_vllm_canary_plan.py tests/unit/test_vllm_canary_paths.py > /tmp/ember-run/unit-canary.txt 2>&1; tail -5 /tmp/ember-run/unit-canary.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_GPU_ENGINE_TIMEOUT_S=420; timeout 1200 python3 -m pytest -m gpu -p no:cacheprovider -rA --basetemp=/tmp/ember-run/pt/c1 tests/gpu/test_vllm_canary.py -k "not tp2 and (kernel-arg or own-exec or passes_its_canary)" > /tmp/ember-run/canary-scratch.txt 2>&1; tail -30 /tmp/ember-run/canary-scratch.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90; timeout 1000 ember bench vllm --model llama-3-8b --loads 6 --ab EMBER_VLLM_CANARY=0 --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wp --out-dir /tmp/ember-run/bench-plain > /tmp/ember-run/bench-llama-plain.txt 2>&1; tail -30 /tmp/ember-run/bench-llama-plain.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_VLLM_MEGA_AOT=1; timeout 900 ember bench vllm --model llama-3-8b --loads 4 --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wm --out-dir /tmp/ember-run/bench-mega > /tmp/ember-run/bench-llama-mega.txt 2>&1; tail -30 /tmp/ember-run/bench-llama-mega.txt
