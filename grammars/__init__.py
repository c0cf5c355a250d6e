"""Grammar-constrained outputs: constraints compiled once, native parameters per upstream dialect,
complete and incremental validators, named grammar files, re-ask instructions.

Modules (import what you need; importing this package loads nothing heavy):
- `spec`: ConstraintSpec (kind, source, name; `key` = content hash) and Violation.
- `compile`: compile_constraint / compile_async -> Constraint (`validate`, `checker(native=...)`).
- `tool_args`: check_tool_schemas (offered tools' schemas, compiled off the loop), validate_tool_arguments.
- `library`: GrammarLibrary (shipped `builtin/` grammars + a user folder; inline refs).
- `requests`: constraints a chat-completions body brings (response_format, vLLM fields).
- `native`: native_params / native_is_exact per upstream dialect.
- `reask`: the instruction appended to the original request after a violation.
Internals: `engine` (llguidance byte matcher), `schema` (jsonschema verdict), `checker`
(IncrementalChecker), `strict` (OpenAI strict schemas), `gbnf` (regex -> GBNF), `walk`.
"""
