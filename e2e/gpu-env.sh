# Source this on a bare GPU machine (the device) from the repository root:
#   source e2e/gpu-env.sh
# Installs carried wheels (.whl/) into /tmp/site and ember itself in editable mode, building
# native/ with the machine's CUDA toolkit.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
export EMBER_LIB=$(python3 -c 'import ember.native as n; print(n.find_library())')
