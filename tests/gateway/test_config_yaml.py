"""`gateway.config_yaml`: a config file's YAML tree, or an error that names the problem and its place and
never quotes the file's text."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config_yaml import read_yaml
from gateway.errors import ConfigError

SECRET = "sk-config-probe-4d9e2b7c1a0f5e38"

PROVIDER = "providers:\n  o:\n    type: openai\n    base_url: http://x/v1\n"

YAML_SLIPS: list[tuple[str, str, str]] = [
    ("tab before a comment", f"{PROVIDER}    api_key: {SECRET}\t# prod\n",
     ("found character '\\t' that cannot start any token at line 5, column 46 "
      "(while scanning for the next token)")),
    ("unclosed quote", f"{PROVIDER}    api_key: '{SECRET}\n",
     ("found unexpected end of stream at line 6, column 1 "
      "(while scanning a quoted scalar at line 5, column 14)")),
    ("colon after the key", f"{PROVIDER}    api_key: {SECRET}: x\n",
     "mapping values are not allowed here at line 5"),
    ("bad escape", f'{PROVIDER}    api_key: "{SECRET}\\q"\n',
     "unknown escape character 'q' at line 5, column 48"),
    ("key read as a tag", f"{PROVIDER}    api_key: !{SECRET}\n", "for the tag '...' at line 5, column 14"),
    ("key read as an alias", f"{PROVIDER}    api_key: *{SECRET}\n",
     "undefined alias '...' at line 5, column 14"),
    ("key under !!int", f"admin: {{token: !!int {SECRET}}}\n", "does not fit its tag"),
    ("key under !!float", f"admin: {{token: !!float {SECRET}}}\n", "does not fit its tag"),
    ("key under !!bool", f"admin: {{token: !!bool {SECRET}}}\n", "does not fit its tag"),
    # last-wins would silently drop the first budget (and an agent's limits with a second `agents:`)
    ("repeated key", f"agents:\n  bot:\n    budget: {{usd: 0.01}}\n    keys: [{SECRET}]\n    budget: {{tokens: 9}}\n",
     "a key is repeated in one mapping (first at line 3, column 5) at line 5, column 5"),
    ("repeated top-level block", "agents: {a: {}}\nlisten: {port: 1}\nagents: {b: {}}\n",
     "repeated in one mapping (first at line 1, column 1) at line 3, column 1"),
    ("repeated flow key", f"admin: {{token: {SECRET}, token: x}}\n", "a key is repeated in one mapping"),
    ("alias bomb", "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdef", "bcdefg")),
     "aliases expand it past 100,000 values"),
    ("recursive alias", "a: &a [1, *a]\n", "an alias refers to a value that contains it at line 1, column 4"),
]


@pytest.mark.parametrize(("text", "expected"), [(t, x) for _, t, x in YAML_SLIPS],
                         ids=[n for n, _, _ in YAML_SLIPS])
def test_invalid_yaml_names_the_problem_and_place_never_the_text(tmp_path: Path, text: str,
                                                                 expected: str) -> None:
    """PyYAML's own message quotes the offending line, which can hold a literal provider key."""
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_yaml(path)
    [(where, message)] = info.value.problems
    assert where == "<file>" and message.startswith("invalid YAML: ") and expected in message, message
    assert "\n" not in message
    assert SECRET not in str(info.value) and SECRET[-12:] not in str(info.value), message


def test_a_file_is_its_tree(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("a: {b: [1, two]}\n")
    assert read_yaml(path) == {"a": {"b": [1, "two"]}}


def test_merges_and_modest_aliases_are_kept(tmp_path: Path) -> None:
    """A merge's keys may be overridden (that is what `<<` is for), also through a merge of a merge;
    an alias used a few times is a tree like any other."""
    path = tmp_path / "t.yaml"
    path.write_text("base: &base {caps: {llm_calls: 5}, loop: {window: 6}}\n"
                    "strict: &strict {<<: *base, caps: {llm_calls: 2}}\n"
                    "agents:\n  a: {<<: *strict, loop: {window: 4}}\n  b: *base\n  c: *base\n")
    tree = read_yaml(path)
    assert tree["agents"] == {"a": {"caps": {"llm_calls": 2}, "loop": {"window": 4}},
                              "b": {"caps": {"llm_calls": 5}, "loop": {"window": 6}},
                              "c": {"caps": {"llm_calls": 5}, "loop": {"window": 6}}}
    assert tree["strict"] == {"caps": {"llm_calls": 2}, "loop": {"window": 6}}


@pytest.mark.parametrize("text", [
    # an anchored mapping with a merge of its own, deeper than the mapping that merges it: PyYAML
    # flattens it (rewriting its keys with the merged ones) before building it
    "templates:\n  base: &base\n    <<: {retries: 1}\n    retries: 2\nagent: {<<: *base}\n",
    "t:\n  a: &a\n    <<: {x: 0}\n    x: 1\n  b: &b {y: 2}\nc:\n  <<: [*a, *b]\n",  # a list merge
    "a: &a {x: 1}\nb: &b {x: 2}\nc: {<<: [*a, *b]}\n",  # two sources with one key: the first wins
])
def test_merges_are_read_as_pyyaml_reads_them(tmp_path: Path, text: str) -> None:
    import yaml

    path = tmp_path / "t.yaml"
    path.write_text(text)
    assert read_yaml(path) == yaml.safe_load(text)


def test_an_empty_file_is_no_tree(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("# nothing yet\n")
    assert read_yaml(path) is None


@pytest.mark.parametrize(("content", "expected"), [(None, "cannot read"), (b"a: \xff\n", "is not UTF-8 text (byte 3)"),
                                                   (b"a: " + b"[" * 2000, "invalid YAML")])
def test_unreadable_files(tmp_path: Path, content: bytes | None, expected: str) -> None:
    path = tmp_path / "t.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        read_yaml(path)
    [(where, message)] = info.value.problems
    assert where == "<file>" and expected in message, message
