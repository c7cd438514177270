# One-GPU work owed to issue 34 (the vLLM kit parked), for `bash e2e/gpu-lanes.sh start x1 TAG` (copy to
# /tmp/ember-run/x1.q). Poll again at once after each poll: a machine idle for 30 s is released with its lanes.
# The canary's FULL step over real KV with per-run blocks (689b7a0), which has run only as the Llama eager
# kv-write case (h200-20261203b): clean restores against SAVE's fingerprint (SAVE's two runs now use different
# blocks) and against eager steps, and kv-write both ways, on both runners (~800 s); then kernel-arg, which
# last ran before the FULL step wrote KV (Llama's eager kv-write, proven at 689b7a0, left out). Then 10 fresh
# LOADs of Qwen3-MoE (V1 runner, 4 layers) on the default path, each compared with native.
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_fingerprint.py tests/unit/test_vllm_canary_steps.py tests/unit/test_vllm_canary_kv.py tests/unit/test_vllm_canary_plan.py tests/unit/test_vllm_canary_paths.py tests/unit/test_fault_injection.py > /tmp/ember-run/unit-canary.txt 2>&1; tail -5 /tmp/ember-run/unit-canary.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_GPU_ENGINE_TIMEOUT_S=420; timeout 1500 python3 -m pytest -m gpu -p no:cacheprovider -rA --basetemp=/tmp/ember-run/pt/c1 tests/gpu/test_vllm_canary.py -k "not tp2 and (passes_its_canary or kv-write or kernel-arg or each_piece) and not (each_piece and llama-3-8b-kv-write)" > /tmp/ember-run/canary-kv.txt 2>&1; tail -30 /tmp/ember-run/canary-kv.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90; timeout 900 ember bench vllm --model qwen3-moe --layers 4 --loads 10 --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wq --out-dir /tmp/ember-run/bench-qwen > /tmp/ember-run/bench-qwen-loads10.txt 2>&1; tail -40 /tmp/ember-run/bench-qwen-loads10.txt
