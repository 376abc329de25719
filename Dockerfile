# The cluster image of icr-studies: the project in /app with the virtual environment that
# `make install` builds (/app/.venv: torch and torchvision first, then the project, every version
# from the lock, constraints.txt, as the Makefile installs them), and `ray` and `python` on the PATH of
# every shell, login shells included. Ray's cluster launcher runs its commands in the container
# with `bash --login -c -i`, KubeRay starts its pods with `bash -lc 'ulimit ...; ray start ...'`,
# and a login shell's /etc/profile sets PATH anew: the venv is on it through /etc/profile.d, and
# `ray` through a link in /usr/local/bin. cluster.yaml and kuberay-rayjob.yaml run on this image
# (docs/clusters.md); tests/test_cluster_files.py checks that it installs as the Makefile does and runs the manifests' start commands in a login shell of a tree laid out as it.
#
#   docker build -t icr-studies:0.1.0 .
#   docker tag icr-studies:0.1.0 REGISTRY/icr-studies:0.1.0 && docker push REGISTRY/icr-studies:0.1.0
#
# The CUDA libraries come with the torch wheels; a GPU node needs only NVIDIA's driver and
# container toolkit (the Deep Learning AMIs and GPU node images of the clouds have both).
FROM python:3.11-slim-bookworm

# wget: KubeRay's health probes; rsync and openssh-client: the cluster launcher's file mounts;
# tmux: `ray exec --tmux` (a study that outlives the terminal);
# procps: `ray stop` and Ray's process lookups.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget rsync openssh-client procps tmux \
    && rm -rf /var/lib/apt/lists/*

ENV RAY_USAGE_STATS_ENABLED=0 \
    MLFLOW_DISABLE_TELEMETRY=true \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# torch in a layer of its own: the largest, and the one that changes least (the lock's versions).
COPY constraints.txt ./
RUN python -m venv /app/.venv \
    && /app/.venv/bin/pip install -q --upgrade pip \
    && /app/.venv/bin/pip install -q -c constraints.txt torch torchvision

# The project and its dependencies at the lock's versions (ray, optuna, mlflow within
# pyproject.toml's ranges), as `make install` installs it (editable), without the dev extra.
COPY pyproject.toml README.md ./
COPY icr icr
COPY studies studies
RUN /app/.venv/bin/pip install -q -c constraints.txt -e .
COPY search_spaces search_spaces

# `ray` and the venv's python for every shell; a login shell's /etc/profile resets PATH.
RUN ln -s /app/.venv/bin/ray /usr/local/bin/ray \
    && echo 'export PATH="/app/.venv/bin:$PATH"' > /etc/profile.d/icr-studies.sh
ENV PATH="/app/.venv/bin:$PATH"
