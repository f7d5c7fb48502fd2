# The gateway image: the ext_proc service, the `llmgw` CLI (docker-compose's init and loops services run
# it), the engine simulator, and the Envoy and Valkey binaries of their wheels (the CLI's sandboxes earn
# the demo's evidence with them).
#   Another Python base:        --build-arg PYTHON_IMAGE=...
#   Behind a package mirror:    --build-arg PIP_INDEX_URL=...   (pip reads it)
#   Offline, from a wheelhouse: --build-arg PIP_FIND_LINKS=URL --build-arg PIP_NO_INDEX=1
#                               (and PIP_TRUSTED_HOST=HOST where URL is plain HTTP)
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST
WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY llmgw ./llmgw
COPY enginesim ./enginesim
# xds-protos ships older copies of OpenTelemetry's proto modules: opentelemetry-proto's own must win.
# A named volume mounted on /run/llmgw (the decision socket's) or /var/lib/llmgw (the state's) starts
# with the directory's owner, the user the gateway runs as.
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --force-reinstall --no-deps "opentelemetry-proto==$(python -c \
       'from importlib.metadata import version; print(version("opentelemetry-proto"))')" \
    && useradd --system --uid 10001 llmgw \
    && mkdir -p /run/llmgw /var/lib/llmgw && chown llmgw /run/llmgw /var/lib/llmgw
COPY policy /etc/llmgw/policy
USER llmgw
CMD ["python", "-m", "extproc", "--config", "/etc/llmgw/policy", "--listen", "unix:/run/llmgw/extproc.sock"]
