# Two images from one Dockerfile:
#   docker build --target trainer  -t tetrad/trainer:0.1.0 .   (torch, no kopf/kubernetes)
#   docker build --target operator -t tetrad/operator:0.1.0 .  (kopf/kubernetes, no torch)
# and the trainer's dependencies alone (--target torch), a base for scripts of one's own.
# Both run as the non-root user 1000 with a read-only root filesystem (see tetrad/render/objects.py).
# Each target installs its dependencies from its requirements (read from pyproject.toml), then the
# sources: a change to the sources rebuilds only the last, small layer (the trainer's dependencies
# are 4 GB), and so does a change to pyproject.toml that leaves the target's requirements alone.
ARG PYTHON=python:3.11-slim

FROM ${PYTHON} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 1000 --create-home --home-dir /home/tetrad tetrad
WORKDIR /src

# Each target's requirements, read from pyproject.toml: a change elsewhere in it (a dev tool, the
# version) leaves these files, and so the dependency layers copied from them, as they were.
FROM base AS requirements
COPY pyproject.toml hack/images/requirements-of.py ./
RUN python requirements-of.py trainer < pyproject.toml > trainer.txt \
 && python requirements-of.py operator < pyproject.toml > operator.txt

FROM base AS sources
COPY pyproject.toml README.md ./
COPY tetrad ./tetrad
COPY operator ./operator
COPY trainer-image ./trainer-image

# The trainer's dependencies, torch first, and nothing of Tetrad: the trainer's base, and a base with torch
# for the bring-your-own examples (examples/bring-your-own/script/Dockerfile), which share its layers.
FROM base AS torch
# CPU images can pass --build-arg TORCH_INDEX=<a CPU wheel index>; the default is PyPI's CUDA build.
ARG TORCH_INDEX=""
COPY --from=requirements /src/trainer.txt /tmp/requirements.txt
# DL3013: torch's version bound is in pyproject.toml, installed next.
# hadolint ignore=DL3013
RUN if [ -n "$TORCH_INDEX" ]; then pip install --index-url "$TORCH_INDEX" torch; fi \
 && pip install -r /tmp/requirements.txt

FROM torch AS trainer
COPY --from=sources /src /src
RUN pip install --no-deps . && rm -rf /src
USER 1000
WORKDIR /home/tetrad
ENTRYPOINT []
# The pods' command with the installed launcher (tetrad.render.command.node_command): the supervisor passes
# a worker's 75 or 78 on. The pods run the same launcher from their job's ConfigMap.
CMD ["python3", "-m", "tetrad.node", "supervise", "--", "python3", "-m", "torch.distributed.run", "-m", "tetrad.node", "worker", "--trainer", "--", "--config", "/etc/tetrad/config.json"]

FROM base AS operator
COPY --from=requirements /src/operator.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
COPY --from=sources /src /src
RUN pip install --no-deps . && rm -rf /src
USER 1000
WORKDIR /home/tetrad
EXPOSE 8080
ENTRYPOINT ["tetrad", "operator"]
CMD ["--all-namespaces"]
