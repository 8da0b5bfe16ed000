# omni-sidecar: the profiling controller beside `vllm serve <model> --omni`.
# The image holds only the sidecar (no torch, no vllm): it talks to the server over HTTP and reads
# the trace folders the server writes, which you mount at the same path (or map with --artifact-root).
#
#   docker build -t omni-sidecar .
#   openssl rand -hex 32 > token
#   docker run --rm -p 127.0.0.1:8092:8092 -v omni-sidecar-state:/home/sidecar/state \
#     -v $PWD/token:/run/secrets/omni-sidecar-token:ro \
#     -e OMNI_SIDECAR_TOKEN_FILE=/run/secrets/omni-sidecar-token \
#     -v /tmp/omni-sidecar/perf:/tmp/omni-sidecar/perf -v $PWD/configs:/configs:ro omni-sidecar \
#     --upstream http://vllm:8000 --deploy-config /configs/qwen2_5_omni.yaml
#   docker stop -t 330 <container>     # compose: stop_grace_period: 330s (covers a flush; see below)
#
# It listens on 0.0.0.0 (a port mapping needs that), so it refuses to start without a token file.
# Clients that reach it by a name other than localhost need OMNI_SIDECAR_ALLOWED_HOSTS=<name>.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 sidecar \
 && useradd --system --uid 10001 --gid sidecar --home-dir /home/sidecar --create-home sidecar

WORKDIR /opt/omni-sidecar
# The dependency layer comes from pyproject.toml alone, so a source edit does not rebuild it.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY README.md ./
COPY sidecar ./sidecar
RUN pip install --no-deps . \
 && omni-sidecar --help >/dev/null

COPY --chown=sidecar:sidecar configs /opt/omni-sidecar/configs
COPY --chown=sidecar:sidecar stage_profiles /opt/omni-sidecar/stage_profiles

# The state volume exists and belongs to the non-root user before VOLUME, so a fresh named volume
# is created owned by it (an unwritable state dir stops start-up with exit 1).
RUN mkdir -p /home/sidecar/state && chown sidecar:sidecar /home/sidecar/state

USER sidecar
WORKDIR /home/sidecar
EXPOSE 8092
VOLUME ["/home/sidecar/state"]

# Settings come from flags or OMNI_SIDECAR_* variables; these keep working when `docker run`
# arguments replace CMD. On SIGTERM the sidecar stops the active capture and waits up to
# CLOSE_TIMEOUT_S for the server's flush (minutes with stacks on): `docker stop -t` must exceed it.
ENV OMNI_SIDECAR_HOST=0.0.0.0 \
    OMNI_SIDECAR_STATE_DIR=/home/sidecar/state \
    OMNI_SIDECAR_CLOSE_TIMEOUT_S=300
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('OMNI_SIDECAR_PORT', '8092'), timeout=4)"]
ENTRYPOINT ["omni-sidecar", "serve"]
