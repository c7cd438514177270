# syntax=docker/dockerfile:1
# One image for the control-plane side: `ember-operator` and `ember-sidecar` are its entry points
# (the chart picks one per container). The native library ships inside the wheel and is copied
# to /opt/ember/lib so an init container can put it on a shared volume for the engine's
# LD_PRELOAD. An optional `engine` target layers ember onto an engine image (torch inside).

# Build arguments used in FROM lines must come before the first FROM.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG ENGINE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ cmake ninja-build \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ember ember
COPY operator operator
COPY sidecar sidecar
# The wheel carries the benchmarks too (`ember bench ...`, pyproject.toml wheel.packages).
COPY benchmarks/ember_bench benchmarks/ember_bench
COPY native native
# CUDA headers come from the nvidia-cuda-runtime build requirement: no toolkit, no libcuda.
RUN python -m pip wheel --no-cache-dir --wheel-dir /wheels '.[operator,sidecar]'

FROM ${PYTHON_IMAGE} AS runtime
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir /wheels/*.whl \
 && mkdir -p /opt/ember/lib \
 && lib="$(python -c 'import ember.native as n; print(n.find_library())')" \
 && cp "$lib" /opt/ember/lib/libember.so \
 && cp "$(dirname "$lib")/libember_nccl.so" /opt/ember/lib/libember_nccl.so
# Non-root; the operator and sidecar need no writable root filesystem.
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin ember
USER 65532:65532
ENV PYTHONUNBUFFERED=1
CMD ["ember-operator"]

# Engine image for SAVE Jobs and serving pods: ember on top of a torch image.
FROM ${ENGINE_IMAGE} AS engine
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir /wheels/ember-*.whl transformers
# libember_nccl.so beside libember: SAVE of a multi-GPU shape preloads it (docs/multi-gpu.md).
COPY --from=runtime /opt/ember/lib/libember.so /opt/ember/lib/libember_nccl.so /opt/ember/lib/
CMD ["ember", "doctor"]
