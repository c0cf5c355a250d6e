"""OpenTelemetry GenAI telemetry for tollgate (semantic conventions v1.41) and Prometheus metrics.

Modules, from pure to stateful:

- `attributes`: `Call` / `Answer` -> semconv attributes; the `tollgate.*` attribute names.
- `content`, `redact`: opt-in content capture in the convention's JSON shapes; secret redaction.
- `runs`: trace shape (run root ids, W3C header extraction / injection, `RunTotals`).
- `metrics`: `Metrics`, the Prometheus registry served on the admin `/metrics`.
- `export`: drop-counting batch export.
- `spans`: `StepSpan`, MCP `params._meta` context helpers.
- `telemetry`, `setup`: `Telemetry` and `setup_telemetry(env)`.

Importing this package does nothing; no global provider is ever installed.
"""
