# syntax=docker/dockerfile:1
# ember's images, one target each (README "Images"; docs/install.md pushes them):
#
#   operator     ember-operator: the chart's Deployment (image.repository)
#   sidecar      ember-sidecar and /opt/ember/lib/libember*.so: the serving pods' sidecar and the
#                init container that copies libember for the engine's LD_PRELOAD (sidecar.image)
#   engine       transformers + ember + libember on a torch image: SAVE Jobs and serving pods of
#                engine.kind transformers (spec.engine.image)
#   engine-vllm  vLLM 0.26 + ember + libember on vLLM's image: engine.kind vllm (spec.engine.image)
#
#   docker build --target engine-vllm -t registry.example.com/ember-engine-vllm:0.1.0 .
#
# Every image runs as uid/gid 65532, a user with a passwd entry (`ember`, home /home/ember):
# torch's inductor cache path calls getpass.getuser(), which raises for a uid without one. The
# pods set HOME=/tmp (read-only root filesystem). The wheel is tagged py3-none-linux_x86_64
# (libember is loaded with ctypes, not a CPython extension), so one wheel serves every image's
# Python; it is built on Debian 11 (glibc 2.31) so that libember loads on the Debian 12 and Ubuntu
# 22.04/24.04 bases below. Bases are build arguments: use your registry's mirrors.

# Build arguments used in FROM lines must come before the first FROM.
ARG BUILD_IMAGE=python:3.12-slim-bullseye
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG ENGINE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
ARG VLLM_IMAGE=vllm/vllm-openai:v0.26.0
# The transformers ember's continuous-batching adapter knows (ember.engines.transformers_cb): a
# transformers deployment names it as engine.version ("5.17").
ARG TRANSFORMERS_VERSION=5.17.0

FROM ${BUILD_IMAGE} AS build
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make \
 && rm -rf /var/lib/apt/lists/*
# cmake and ninja come from their wheels (scikit-build-core asks for them when missing).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ember ember
COPY operator operator
COPY sidecar sidecar
# The wheel carries the benchmarks too (`ember bench ...`, pyproject.toml wheel.packages) and the
# test support they build on (synthetic archives).
COPY benchmarks/ember_bench benchmarks/ember_bench
COPY testing/ember_testing testing/ember_testing
COPY native native
# CUDA headers come from the nvidia-cuda-runtime build requirement: no toolkit, no libcuda.
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && mkdir -p /opt/ember/lib \
 && python -m zipfile -e /wheels/ember-*.whl /tmp/wheel \
 && cp /tmp/wheel/ember/lib/libember.so /tmp/wheel/ember/lib/libember_nccl.so /opt/ember/lib/

# The control-plane images: ember with one extra each, the ember user, no writable root needed.
# (DL3013 below: the wheel is this build's own; its dependencies are pinned by pyproject ranges.)
FROM ${PYTHON_IMAGE} AS python-base
RUN groupadd --gid 65532 ember \
 && useradd --uid 65532 --gid 65532 --home-dir /home/ember --create-home --shell /usr/sbin/nologin ember
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

FROM python-base AS operator
# hadolint ignore=DL3013
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    whl="$(echo /wheels/ember-*.whl)" && python -m pip install "${whl}[operator]"
USER 65532:65532
CMD ["ember-operator"]

FROM python-base AS sidecar
# hadolint ignore=DL3013
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    whl="$(echo /wheels/ember-*.whl)" && python -m pip install "${whl}[sidecar]"
# libember_nccl.so beside libember: SAVE of a multi-GPU shape preloads it (docs/multi-gpu.md).
COPY --from=build /opt/ember/lib/ /opt/ember/lib/
USER 65532:65532
CMD ["ember-sidecar"]

# Engine image for engine.kind transformers: ember on top of a torch image.
FROM ${ENGINE_IMAGE} AS engine
ARG TRANSFORMERS_VERSION
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir /wheels/ember-*.whl "transformers==${TRANSFORMERS_VERSION}"
COPY --from=build /opt/ember/lib/ /opt/ember/lib/
RUN groupadd --gid 65532 ember \
 && useradd --uid 65532 --gid 65532 --home-dir /home/ember --create-home --shell /usr/sbin/nologin ember
USER 65532:65532
ENV HOME=/home/ember
CMD ["ember", "doctor"]

# Engine image for engine.kind vllm: ember (its vLLM plugin, `ember serve --engine vllm`) on vLLM's
# own image, whose torch vLLM was built against. vLLM's entry point is reset: the operator runs
# `ember serve --engine vllm -- ...`, which starts `vllm serve` under libember.
FROM ${VLLM_IMAGE} AS engine-vllm
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m pip install --no-cache-dir /wheels/ember-*.whl
COPY --from=build /opt/ember/lib/ /opt/ember/lib/
RUN groupadd --gid 65532 ember \
 && useradd --uid 65532 --gid 65532 --home-dir /home/ember --create-home --shell /usr/sbin/nologin ember
USER 65532:65532
ENV HOME=/home/ember
ENTRYPOINT []
CMD ["ember", "doctor"]
