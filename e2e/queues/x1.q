# One-GPU work owed to issue 34 (the vLLM kit parked), for `bash e2e/gpu-lanes.sh start x1 TAG` (copy to
# /tmp/ember-run/x1.q). Poll again at once after each poll: a machine idle for 30 s is released with its lanes.
# The canary's cases ran clean and refused as they should on both runners at bab655e (h200-20261203c), and
# Qwen3-MoE (V1) had 10 of 10 fresh LOADs identical to native. Still owed on one GPU, in order:
# - 10 fresh LOADs of the Llama shape (V2 runner) on the default path (~560 s);
# - the one-GPU vLLM plugin and one-rank SAVE tests (the SAVE Job under the operator's identity, `vllm serve`
#   through the sidecar; last run h200-20261129c and h200-20261201b);
# - the full-depth AOT bench (~480 s), every other LOAD's canary under cProfile (where its first step's 110+ ms go);
# - the rest of the one-GPU tier without vLLM (its load-canary fault classes passed at bab655e; the rest last
#   ran h200-20261129).
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90; timeout 900 ember bench vllm --model llama-3-8b --layers 4 --loads 10 --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wl --out-dir /tmp/ember-run/bench-llama > /tmp/ember-run/bench-llama-loads10.txt 2>&1; tail -40 /tmp/ember-run/bench-llama-loads10.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_GPU_ENGINE_TIMEOUT_S=420; timeout 1500 python3 -m pytest -m gpu -p no:cacheprovider -rA --basetemp=/tmp/ember-run/pt/vp tests/gpu/test_vllm_plugin.py tests/gpu/test_vllm_one_rank_save.py > /tmp/ember-run/gpu-vllm-plugin.txt 2>&1; tail -20 /tmp/ember-run/gpu-vllm-plugin.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_VLLM_MEGA_AOT=1; timeout 900 ember bench vllm --model llama-3-8b --loads 4 --ab EMBER_VLLM_CANARY_PROFILE=/tmp/ember-run/canary-prof --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wm --out-dir /tmp/ember-run/bench-mega > /tmp/ember-run/bench-llama-mega.txt 2>&1; tail -30 /tmp/ember-run/bench-llama-mega.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90; timeout 1800 python3 -m pytest -m gpu -p no:cacheprovider -rA --timeout 900 --basetemp=/tmp/ember-run/pt/tier tests/gpu -k "not vllm and not test_load_canary" > /tmp/ember-run/tier.txt 2>&1; tail -30 /tmp/ember-run/tier.txt
