# One-GPU work owed to issue 36 (nvidia-h200, the vLLM kit parked), for `bash e2e/gpu-lanes.sh start x1 TAG`
# (copy to /tmp/ember-run/x1.q). The full-depth Llama bench with vLLM's compiled model as one AOT artifact
# (EMBER_VLLM_MEGA_AOT=1), which kernels half its LOADs compiled and where (`triton_compiled_kernels`), then the
# same bench without it in the same session (benchmarks/results/h200-20261202c).
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_VLLM_MEGA_AOT=1; timeout 1000 ember bench vllm --model llama-3-8b --loads 4 --floor --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wm --out-dir /tmp/ember-run/bench-mega > /tmp/ember-run/bench-llama-mega.txt 2>&1; tail -30 /tmp/ember-run/bench-llama-mega.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90; timeout 1000 ember bench vllm --model llama-3-8b --loads 4 --floor --gpu-memory-utilization 0.4 --timeout 400 --work /tmp/ember-run/wp --out-dir /tmp/ember-run/bench-plain > /tmp/ember-run/bench-llama-plain.txt 2>&1; tail -30 /tmp/ember-run/bench-llama-plain.txt
