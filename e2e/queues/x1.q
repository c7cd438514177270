# One-GPU work owed to issue 34 (nvidia-h200, the vLLM kit parked), for `bash e2e/gpu-lanes.sh start x1 TAG`
# (copy to /tmp/ember-run/x1.q). The kernel-argument fault now halves every Inductor pointwise kernel's count:
# is it caught by the vLLM canary on both runners (it was inert before), and still on the decode workload?
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90 EMBER_GPU_ENGINE_TIMEOUT_S=400; timeout 1200 python3 -m pytest -m gpu -p no:cacheprovider -rA --basetemp=/tmp/ember-run/pt/ka tests/gpu/test_vllm_canary.py -k "not tp2 and (kernel-arg or own-exec)" > /tmp/ember-run/canary-kernel-arg.txt 2>&1; tail -14 /tmp/ember-run/canary-kernel-arg.txt
export CUDA_VISIBLE_DEVICES=0 EMBER_STACKS_AFTER_S=90; timeout 600 python3 -m pytest -m gpu -p no:cacheprovider -rA --basetemp=/tmp/ember-run/pt/kd tests/gpu/test_load_canary.py -k "kernel-arg or own-exec" > /tmp/ember-run/decode-kernel-arg.txt 2>&1; tail -14 /tmp/ember-run/decode-kernel-arg.txt
