# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target serve -t nca-knn:serve .
#   docker build --target train -t nca-knn:train .                       # CPU training
#   docker build --target train --build-arg TORCH_INDEX_URL= -t nca-knn:train-gpu .  # CUDA training
# (PyPI's torch wheel brings the CUDA libraries; the node's driver is mounted by the NVIDIA
# container toolkit, so no CUDA base image is needed: deploy/README.md)
# The train image's torch: TORCH_SPEC (a requirement, default torch==2.13.0) from
# TORCH_INDEX_URL (default PyTorch's CPU wheel index: no CUDA libraries, a much smaller
# image; empty = PyPI, whose Linux wheels bring CUDA). A private mirror is one more
# --build-arg TORCH_INDEX_URL=<url>.
# Dependencies are installed before the code is copied, so code changes reuse the cached layers.

ARG PYTHON_BASE=python:3.11-slim-bookworm
ARG TRAIN_BASE=python:3.11-slim-bookworm

# ----------------------------------------------------------------------------- serve
FROM ${PYTHON_BASE} AS serve
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NCAKNN_HOST=0.0.0.0 \
    NCAKNN_PORT=8000 \
    NCAKNN_GRPC_PORT=8081 \
    NCAKNN_PROBE_PORT=8082 \
    NCAKNN_MODEL_PATH=/models/current
WORKDIR /app
COPY pyproject.toml README.md ./
COPY requirements/lock.txt ./requirements/lock.txt
# the serve extra only (no torch), read from pyproject.toml, at the lock's versions
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['serve']; open('/tmp/serve.txt', 'w').write(chr(10).join(deps))" \
    && pip install --no-cache-dir -c requirements/lock.txt -r /tmp/serve.txt \
    && rm /tmp/serve.txt
COPY service ./service
RUN pip install --no-cache-dir --no-deps . \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin ncaknn
USER 10001
EXPOSE 8000 8081 8082
# readiness from the probe listener (the main port's when it is off)
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; probe = os.environ.get('NCAKNN_PROBE_PORT', '8082'); port = probe if probe != '0' else os.environ.get('NCAKNN_PORT', '8000'); sys.exit(urllib.request.urlopen('http://127.0.0.1:' + port + '/readyz', timeout=2).status != 200)"]
ENTRYPOINT ["python", "-m", "service"]

# ----------------------------------------------------------------------------- train-build
# The native training kernels are compiled here, at install (setup.py: each C source once per
# dtype and x86-64 level, loaded at run time for the CPU that trains), into a wheel. The train
# image installs that wheel and carries no compiler.
FROM ${TRAIN_BASE} AS train-build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY service ./service
COPY training ./training
RUN /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ----------------------------------------------------------------------------- train
FROM ${TRAIN_BASE} AS train
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    PATH=/opt/venv/bin:$PATH
# CUDA base images have no Python: install it there (skipped on the Python base image).
# Python >= 3.11 is needed (tomllib): use an ubuntu24.04 CUDA base. No compiler: the native
# kernels come built in train-build's wheel.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
WORKDIR /app
COPY pyproject.toml README.md ./
# the index is an option of its own, never part of the quoted requirement (tests/deploy
# run this line with a fake index)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
# hadolint ignore=DL3013
COPY requirements/lock.txt ./requirements/lock.txt
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; open('/tmp/train.txt', 'w').write(chr(10).join(p['dependencies'] + p['optional-dependencies']['train']))" \
    && pip install --no-cache-dir -c requirements/lock.txt -r /tmp/train.txt \
    && rm /tmp/train.txt
COPY --from=train-build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
    && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin ncaknn
USER 10001
ENTRYPOINT ["python", "-m", "training"]
