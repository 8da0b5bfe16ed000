# omni-sidecar: the profiling controller beside `vllm serve <model> --omni`.
# The image holds only the sidecar (no torch, no vllm): it talks to the server over HTTP and reads
# the trace folders the server writes, which you mount at the same path (or map with --artifact-root).
#
#   docker build -t omni-sidecar .
#   docker run --rm -p 8092:8092 -v /tmp/omni-sidecar/perf:/tmp/omni-sidecar/perf \
#     -v $PWD/configs:/configs:ro omni-sidecar \
#     --upstream http://vllm:8000 --deploy-config /configs/qwen2_5_omni.yaml
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 sidecar \
 && useradd --system --uid 10001 --gid sidecar --home-dir /home/sidecar --create-home sidecar

WORKDIR /opt/omni-sidecar
# Metadata first so the dependency layer is cached across source edits.
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN pip install . \
 && omni-sidecar --help >/dev/null

COPY --chown=sidecar:sidecar configs /opt/omni-sidecar/configs
COPY --chown=sidecar:sidecar stage_profiles /opt/omni-sidecar/stage_profiles

USER sidecar
WORKDIR /home/sidecar
EXPOSE 8092

# A capture journal survives restarts only on a volume.
VOLUME ["/home/sidecar/state"]

# Settings come from flags or OMNI_SIDECAR_* variables; these two keep working when `docker run`
# arguments replace CMD.
ENV OMNI_SIDECAR_HOST=0.0.0.0 \
    OMNI_SIDECAR_STATE_DIR=/home/sidecar/state
ENTRYPOINT ["omni-sidecar", "serve"]
