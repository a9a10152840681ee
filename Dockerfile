# splitserve image: one image for every service (`splitserve <command>` is the entrypoint).
#
#   docker build -t splitserve .
#   docker run --gpus all --rm splitserve serve --device cuda --prompt "Hello"
#
# torch comes from the PyTorch index for the CUDA version of your driver (TORCH_INDEX);
# the project accepts any torch >= 2.5 (the H200 machines run 2.11 + CUDA 13).
FROM python:3.11-slim

ARG TORCH_SPEC="torch>=2.5"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# the UCX build for the same CUDA major version: cu12 with a cu12x torch, cu13 with cu13x
ARG UCX_EXTRA=cu12

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    SPLITSERVE_CACHE=/models/.cache \
    UCX_WARN_UNUSED_ENV_VARS=n

RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"

WORKDIR /opt/splitserve
COPY pyproject.toml README.md ./
COPY splitserve_pkg/ splitserve_pkg/
COPY cli/ cli/
COPY request/ request/
COPY config/ config/
COPY service/ service/
COPY engine/ engine/
COPY kernels/ kernels/
COPY kvtransfer/ kvtransfer/
COPY worker/ worker/
COPY prefill_worker/ prefill_worker/
COPY decode_worker/ decode_worker/
COPY router/ router/
COPY protos/ protos/
RUN pip install ".[${UCX_EXTRA}]" && splitserve --help > /dev/null

# 50051 router, 8000 router's OpenAI HTTP API, 50061 prefill gRPC, 50062 prefill KV (UCX), 50071 decode;
# 94xx metrics
EXPOSE 50051 8000 50061 50062 50071 9451 9461 9471
ENTRYPOINT ["splitserve"]
# beyond loopback the router needs an API key: one is generated into this file on first start
# (read it with `docker exec <container> cat /run/splitserve/api-keys`; docs/security.md)
CMD ["serve", "--host", "0.0.0.0", "--api-keys-file", "/run/splitserve/api-keys"]
