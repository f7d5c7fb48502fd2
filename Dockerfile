# The gateway image: the ext_proc service, the `llmgw` CLI and the engine simulator.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY llmgw ./llmgw
COPY enginesim ./enginesim
RUN pip install --no-cache-dir . && useradd --system --uid 10001 llmgw
COPY policy /etc/llmgw/policy
USER llmgw
EXPOSE 50051
CMD ["python", "-m", "extproc", "--config", "/etc/llmgw/policy", "--listen", "0.0.0.0:50051"]
