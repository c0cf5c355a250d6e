"""Reading a config file's YAML: the parsed tree, or a ConfigError that never quotes the file's text
(a line of it may hold a literal provider key or admin token)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.errors import ConfigError

if TYPE_CHECKING:
    import yaml


def read_yaml(p: Path) -> Any:
    """The parsed YAML tree of the file `p`. Raises ConfigError, never quoting the file's text."""
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("<file>", f"cannot read {p}: {exc.strerror}")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([("<file>", f"{p} is not UTF-8 text (byte {exc.start})")]) from None
    import yaml  # only reading a file needs the YAML parser (default_config, parse_config do not)

    try:
        return _load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([("<file>", f"invalid YAML: {_yaml_problem(exc)}")]) from None
    except RecursionError:
        raise ConfigError([("<file>", "invalid YAML: nested too deeply")]) from None
    except _TAG_FAILURES:
        # PyYAML converts an explicitly tagged scalar (`!!int x`) with int(), float() or a dict lookup,
        # whose own errors quote the scalar: the traceback would print a literal key
        raise ConfigError([("<file>", "invalid YAML: a value does not fit its tag (!!int, ...)")]) from None


def _load(text: str) -> Any:
    """`yaml.safe_load`, with the strict loader and the size check between composing and constructing."""
    loader = _strict_loader()(text)  # its reader refuses characters YAML does not allow: a YAMLError
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


MAX_NODES = 100_000  # values of the tree once aliases are expanded; a real config has a few hundred


def _strict_loader() -> type[yaml.SafeLoader]:
    """PyYAML's safe loader, but a key repeated in one mapping is an error: PyYAML keeps the last one, so
    a pasted `budget:` or a second `agents:` block would silently drop the first (and its limits).
    Keys a merge (`<<: *defaults`) brings in may still be overridden: that is what a merge is for."""
    import yaml

    class Strict(yaml.SafeLoader):
        # every mapping is flattened before it is built, and a mapping a merge brings in is flattened
        # (its `node.value` rewritten with what it merges) when the first mapping merging it is built:
        # each mapping's own keys are checked once, on its first flattening, before any merge rewrites them
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._checked: set[int] = set()  # the mappings whose own keys were checked

        def flatten_mapping(self, node: yaml.MappingNode) -> None:
            if id(node) not in self._checked:
                self._checked.add(id(node))
                seen: dict[Any, yaml.Mark] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    first = seen.setdefault(key, key_node.start_mark) if _hashable(key) else key_node.start_mark
                    if first is not key_node.start_mark:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"a key is repeated in one mapping (first{_at(first)})", key_node.start_mark)
            super().flatten_mapping(node)

    return Strict


def _hashable(key: Any) -> bool:
    try:
        hash(key)
    except TypeError:
        return False  # PyYAML refuses an unhashable key itself, with its own error
    return True


def _check_size(root: yaml.Node) -> None:
    """Refuse a tree that aliases expand past MAX_NODES values (`a: &a [x, x]`, `b: &b [*a, *a]`, ... is a
    few hundred bytes that the checks below it would walk billions of times), or that contains itself."""
    import yaml

    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in open_:
            raise ConfigError([("<file>", f"invalid YAML: an alias refers to a value that contains it{_at(node.start_mark)}")])
        open_.add(id(node))
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(item) for item in node.value)
        else:
            total = 1
        open_.discard(id(node))
        if total > MAX_NODES:
            raise ConfigError([("<file>", f"invalid YAML: aliases expand it past {MAX_NODES:,} values")])
        sizes[id(node)] = total
        return total

    size(root)


_TAG_FAILURES = (ValueError, TypeError, KeyError, AttributeError)
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
# what PyYAML quotes that is not the file's text: one character (or its escape) and its token names
_HARMLESS = re.compile(r".|\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|.)|<[a-z ]+>")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, never the file's text. PyYAML's own message quotes the offending lines
    (and names tags and aliases), and such a line may hold a literal provider key or admin token."""
    import yaml  # already loaded: only load_config, which imported it, gets here

    if not isinstance(exc, yaml.MarkedYAMLError):
        return _unquote(" ".join(str(exc).split()))
    problem = f"{_unquote(exc.problem or 'malformed document')}{_at(exc.problem_mark)}"
    if not exc.context:
        return problem
    return f"{problem} ({_unquote(exc.context)}{_at(exc.context_mark)})"


def _at(mark: yaml.Mark | None) -> str:
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"


def _unquote(text: str) -> str:
    """`text` with every quoted stretch but a single character or a token name shown as '...'."""
    return _QUOTED.sub(lambda m: m.group() if _HARMLESS.fullmatch(m.group()[1:-1]) else "'...'", text)
