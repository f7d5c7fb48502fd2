# The gateway image: the ext_proc service, the `llmgw` CLI and the engine simulator.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY llmgw ./llmgw
COPY enginesim ./enginesim
# xds-protos ships older copies of OpenTelemetry's proto modules: opentelemetry-proto's own must win.
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --force-reinstall --no-deps "opentelemetry-proto==$(python -c \
       'from importlib.metadata import version; print(version("opentelemetry-proto"))')" \
    && useradd --system --uid 10001 llmgw
COPY policy /etc/llmgw/policy
USER llmgw
EXPOSE 50051
CMD ["python", "-m", "extproc", "--config", "/etc/llmgw/policy", "--listen", "0.0.0.0:50051"]
