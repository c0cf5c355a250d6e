"""Render a run, as `GET /admin/runs/{id}` shows it, as a step tree for a terminal.

The run is the root; model calls (`chat ...`) are its children, in order; an MCP `execute_tool` step
that runs a tool the preceding model call proposed is drawn under that call, any other MCP step
under the run. Each step shows its decision (`allow`, `refuse`, `STOP <reason>`), HTTP status, cost
and tokens. `render_run` is pure: a run view in, lines out; `ascii=True` draws with `|`, `` ` ``, `-`
for terminals that cannot show box-drawing characters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["render_run"]


@dataclass(slots=True)
class _Node:
    step: Mapping[str, Any]
    proposed: list[str] = field(default_factory=list)  # tools the model call proposed, not yet run
    children: list[_Node] = field(default_factory=list)


def _tree(steps: Sequence[Mapping[str, Any]]) -> list[_Node]:
    roots: list[_Node] = []
    last_chat: _Node | None = None
    for step in steps:
        node = _Node(step)
        if step.get("operation") != "execute_tool":
            node.proposed = [str(t) for t in step.get("tool_calls") or []]
            roots.append(node)
            last_chat = node
            continue
        names = [str(t) for t in step.get("tool_calls") or []]
        bare = names[0].rpartition("/")[2] if names else ""
        if last_chat is not None and bare in last_chat.proposed:
            last_chat.proposed.remove(bare)
            last_chat.children.append(node)
        else:
            roots.append(node)
    return roots


def _decision(step: Mapping[str, Any]) -> str:
    if step.get("stop_reason"):
        return f"STOP {step['stop_reason']}"
    if step.get("refusal"):
        return f"refuse {step['refusal']}"
    return str(step.get("decision") or "allow")


def _label(step: Mapping[str, Any]) -> str:
    if step.get("operation") == "execute_tool":
        names = step.get("tool_calls") or []
        return f"tools/call {names[0] if names else '?'}"
    return f"{step.get('operation', '?')} {step.get('model', '')}".strip()


def _usage(step: Mapping[str, Any]) -> str:
    if step.get("operation") == "execute_tool":
        return ""
    parts = [f"${float(step.get('cost_usd') or 0.0):.6f}"]
    if step.get("input_tokens") is not None:
        parts.append(f"{step['input_tokens']} in / {step.get('output_tokens') or 0} out")
    return "  ".join(parts)


def _proposes(step: Mapping[str, Any]) -> str:
    if step.get("operation") == "execute_tool":
        return ""
    names = step.get("tool_calls") or []
    return f"-> proposes {', '.join(names)}" if names else ""


def _row(step: Mapping[str, Any]) -> list[str]:
    return [_label(step), _decision(step), str(step.get("status") or "-"), _usage(step), _proposes(step)]


def render_run(run: Mapping[str, Any], *, ascii: bool = False) -> list[str]:
    """Lines showing `run` (an admin API run view) as a tree of its steps, with totals and decisions."""
    tee, last, bar = ("|-- ", "`-- ", "|   ") if ascii else ("├── ", "└── ", "│   ")
    status = str(run.get("status"))
    if run.get("stop_reason"):
        status += f": {run['stop_reason']}"
    tokens = int(run.get("input_tokens") or 0) + int(run.get("output_tokens") or 0)
    lines = [
        f"run {run.get('run_id')}  agent {run.get('agent')}  [{status}]",
        (f"  spent ${float(run.get('spent_usd') or 0.0):.6f}  tokens {tokens}  "
         f"llm calls {run.get('llm_calls', 0)}  tool calls {run.get('tool_calls', 0)}"),
    ]
    if run.get("stop_detail"):
        lines.append(f"  why: {run['stop_detail']}")
    flat: list[tuple[str, list[str]]] = []
    roots = _tree(run.get("steps") or [])
    for i, node in enumerate(roots):
        end = i == len(roots) - 1
        flat.append(("  " + (last if end else tee), _row(node.step)))
        for j, child in enumerate(node.children):
            prefix = "  " + ("    " if end else bar) + (last if j == len(node.children) - 1 else tee)
            flat.append((prefix, _row(child.step)))
    if not flat:
        return [*lines, "  (no steps recorded)"]
    widths = [max(len(prefix) + len(cells[0]) for prefix, cells in flat)]
    widths += [max(len(cells[k]) for _, cells in flat) for k in range(1, 5)]
    for prefix, cells in flat:
        first = (prefix + cells[0]).ljust(widths[0])
        rest = [cell.ljust(widths[k + 1]) for k, cell in enumerate(cells[1:])]
        lines.append("  ".join([first, *rest]).rstrip())
    return lines
