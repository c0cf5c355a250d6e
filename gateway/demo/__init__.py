"""`tollgate demo`: an offline tour of the gateway (DESIGN section 1).

Everything runs in one process on loopback: a scripted model server (`model`, OpenAI chat wire), a
scripted MCP tool server (`toolserver`, Streamable HTTP JSON-RPC), a real tollgate gateway built in
code (`tour`) and a sample agent loop (`agent`) whose three runs trip three guards: a USD budget
(`budget_exhausted`), loop detection (`loop_detected`) and a tool allow-list (`tool_not_allowed`, on
a model call and on an MCP `tools/call`). Each run's step tree is read back from the admin API and
printed (`report`); `--otlp-json FILE` also writes the tour's spans as OTLP JSON (`otlp`).
Nothing leaves the machine and no API key is needed.
"""

from __future__ import annotations

from gateway.demo.tour import run_demo

__all__ = ["run_demo"]
