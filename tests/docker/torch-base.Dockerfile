# Test stand-in for a pytorch/pytorch image (no registry is reachable from the tests): Debian's
# Python with a CPU torch in a virtual environment first on PATH, as conda's is in those images.
# Build context: a wheelhouse holding the torch wheel and its dependencies.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
ARG TORCH_VERSION
RUN --mount=type=bind,target=/tmp/wheels \
    python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels "torch==${TORCH_VERSION}"
ENV PATH=/opt/venv/bin:$PATH
