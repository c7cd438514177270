# One-GPU work owed to issues 34 and 36 (the vLLM kit parked), for `bash e2e/gpu-lanes.sh start x1 TAG` (copy to
# /tmp/ember-run/x1.q). Poll again at once after each poll: a machine idle for 30 s is released with its lanes.
# The Llama shape's 10 fresh LOADs (V2 runner) and the one-GPU vLLM plugin and one-rank SAVE tests passed at ee9bdcc
# (h200-20261203d). Still owed on one GPU, in order: the full-depth AOT bench (~480 s), every other LOAD's canary
# under cProfile, which with the canary's new `fingerprint kernels` part says how much of its first step the
# fingerprint's kernels loading was; then the one-GPU tier without vLLM (~1200 s; its load-canary fault classes
# passed at bab655e, the rest last ran h200-20261129), the files most exposed to the 12-01..03 changes first.
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_VLLM_MEGA_AOT=1; timeout 900 ember bench vllm --model llama-3-8b --loads 4 --ab EMBER_VLLM_CANARY_PROFILE=/tmp/ember-run/canary-prof --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wm --out-dir /tmp/ember-run/bench-mega > /tmp/ember-run/bench-llama-mega.txt 2>&1; tail -30 /tmp/ember-run/bench-llama-mega.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90; timeout 1800 python3 -m pytest -m gpu -p no:cacheprovider -rA --timeout 900 --basetemp=/tmp/ember-run/pt/tier tests/gpu/test_serve_gpu.py tests/gpu/test_cb_restore.py tests/gpu/test_runtime_save_load.py tests/gpu/test_native.py tests/gpu/test_cb_save_job.py tests/gpu/test_runtime_inprocess.py tests/gpu/test_cb_canary_rows.py tests/gpu/test_pool_check_gpu.py tests/gpu/test_multi_gpu.py tests/gpu/test_kernel_images_gpu.py > /tmp/ember-run/tier.txt 2>&1; tail -30 /tmp/ember-run/tier.txt
