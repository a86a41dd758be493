# Two images from one Dockerfile:
#   docker build --target trainer  -t tetrad/trainer:0.1.0 .   (torch, no kopf/kubernetes)
#   docker build --target operator -t tetrad/operator:0.1.0 .  (kopf/kubernetes, no torch)
# Both run as the non-root user 1000 with a read-only root filesystem (see tetrad/render/objects.py).
# Each target installs its dependencies from pyproject.toml alone, then the sources: a change to
# the sources rebuilds only the last, small layer (the trainer's dependencies are 4 GB).
ARG PYTHON=python:3.11-slim

FROM ${PYTHON} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 1000 --create-home --home-dir /home/tetrad tetrad
WORKDIR /src
COPY pyproject.toml hack/images/requirements-of.py ./

FROM base AS sources
COPY README.md ./
COPY tetrad ./tetrad
COPY operator ./operator
COPY trainer-image ./trainer-image

FROM base AS trainer
# CPU images can pass --build-arg TORCH_INDEX=<a CPU wheel index>; the default is PyPI's CUDA build.
ARG TORCH_INDEX=""
# DL3013: torch's version bound is in pyproject.toml, installed next.
# hadolint ignore=DL3013
RUN if [ -n "$TORCH_INDEX" ]; then pip install --index-url "$TORCH_INDEX" torch; fi \
 && python requirements-of.py trainer < pyproject.toml > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY --from=sources /src /src
RUN pip install --no-deps . && rm -rf /src
USER 1000
WORKDIR /home/tetrad
ENTRYPOINT []
# The pods' command (tetrad.render.objects.TRAIN_COMMAND): the supervisor passes a worker's 75 or 78 on.
CMD ["python", "-m", "tetrad_trainer.preemption", "torchrun", "-m", "tetrad_trainer.train", "--config", "/etc/tetrad/config.json"]

FROM base AS operator
RUN python requirements-of.py operator < pyproject.toml > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY --from=sources /src /src
RUN pip install --no-deps . && rm -rf /src
USER 1000
WORKDIR /home/tetrad
EXPOSE 8080
ENTRYPOINT ["tetrad", "operator"]
CMD ["--all-namespaces"]
