# One image for the api, worker and scheduler processes.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY platform ./platform
COPY templates ./templates
# With the otel extra: a process exports traces once OTEL_EXPORTER_OTLP_ENDPOINT is set.
RUN pip install --no-cache-dir '.[otel]'
ENV JOBPLANE_HOST=0.0.0.0
ENTRYPOINT ["jobplane"]
