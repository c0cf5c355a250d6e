"""Named grammars: shipped ones, a user folder, inline refs, and config errors that name the grammar."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.errors import ConfigError, InvalidGrammar
from grammars.compile import compile_constraint
from grammars.library import GrammarLibrary
from grammars.spec import JSON_OBJECT, ConstraintSpec, choice_spec

SHIPPED = ("arithmetic", "bullet_list", "iso_date", "sentiment", "ticket", "yes_no")


def write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def test_shipped_grammars() -> None:
    lib = GrammarLibrary.load(None)
    assert lib.names() == SHIPPED
    assert lib.get("yes_no") == ConstraintSpec("choice", '["yes","no"]', "yes_no")
    assert lib.get("sentiment").source == '["positive","neutral","negative"]'
    assert lib.get("iso_date").source == "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    assert lib.get("ticket").kind == "json_schema" and lib.get("arithmetic").kind == "lark"
    assert lib.get("bullet_list").kind == "gbnf"


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("yes_no", "yes", "Yes"),
        ("sentiment", "neutral", "mixed"),
        ("iso_date", "2024-02-29", "2024-13-01"),
        ("arithmetic", "(1 + 2.5) * -3", "1 + * 2"),
        ("bullet_list", "- milk\n- eggs\n", "milk"),
        (
            "ticket",
            json.dumps(
                {
                    "title": "Refund",
                    "category": "billing",
                    "priority": "high",
                    "summary": "Charged twice",
                    "order_id": "AB-123456",
                }
            ),
            json.dumps({"title": "Refund", "category": "billing", "priority": "asap", "summary": "x"}),
        ),
    ],
)
def test_shipped_grammars_validate(name: str, good: str, bad: str) -> None:
    constraint = compile_constraint(GrammarLibrary.load(None).get(name))
    assert constraint.validate(good) is None
    assert constraint.validate(bad) is not None


def test_user_folder(tmp_path: Path) -> None:
    folder = write(
        tmp_path / "g",
        {
            "colors.choice": "red\n  green \n\nblue\n",
            "zip.regex": "[0-9]{5}\n",
            "person.json": '{"type": "object", "required": ["name"]}',
            "expr.lark": 'start: "x"+\n',
            "digits.gbnf": "root ::= [0-9]+\n",
            "yes_no.choice": "oui\nnon\n",  # replaces the shipped one
            "README.md": "ignored",
            ".hidden.regex": "ignored",
        },
    )
    (folder / "sub.regex").mkdir()  # a folder, not a grammar file
    lib = GrammarLibrary.load(folder)
    assert lib.names() == (
        "arithmetic",
        "bullet_list",
        "colors",
        "digits",
        "expr",
        "iso_date",
        "person",
        "sentiment",
        "ticket",
        "yes_no",
        "zip",
    )
    assert lib.get("colors") == choice_spec(["red", "green", "blue"], "colors")
    assert lib.get("zip") == ConstraintSpec("regex", "[0-9]{5}", "zip")
    assert lib.get("person").source == '{"type":"object","required":["name"]}'
    assert lib.get("yes_no").source == '["oui","non"]'
    assert compile_constraint(lib.get("zip")).validate("12345") is None


def test_missing_user_folder_is_empty(tmp_path: Path) -> None:
    assert GrammarLibrary.load(tmp_path / "nope").names() == SHIPPED


def test_user_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "grammars"
    path.write_text("x")
    with pytest.raises(ConfigError) as caught:
        GrammarLibrary.load(path)
    assert caught.value.problems == [("grammars.dir", f"{path} is not a folder")]


def test_broken_user_files_are_config_errors_naming_the_grammar(tmp_path: Path) -> None:
    folder = write(
        tmp_path / "g",
        {
            "bad_regex.regex": "a(?=b)",
            "bad_schema.json": '{"type": "strnig"}',
            "not_json.json": "{",
            "bad_lark.lark": "start: nothing_here",
            "empty.choice": "\n\n",
            "twice.regex": "x",
            "twice.choice": "x",
            "fine.regex": "ok",
        },
    )
    with pytest.raises(ConfigError) as caught:
        GrammarLibrary.load(folder)
    problems = dict(caught.value.problems)
    assert sorted(problems) == [
        "grammars.bad_lark",
        "grammars.bad_regex",
        "grammars.bad_schema",
        "grammars.empty",
        "grammars.not_json",
        "grammars.twice",
    ]
    assert problems["grammars.bad_schema"] == (
        "json_schema: invalid schema at type: 'strnig' is not valid under any of the given schemas"
    )
    assert problems["grammars.bad_lark"] == 'lark: at 1(8): unknown name: "nothing_here"'
    assert problems["grammars.empty"] == "a .choice file needs at least one option (one per line)"
    assert problems["grammars.twice"] == "defined twice: twice.choice and twice.regex"
    assert problems["grammars.not_json"] == "not valid JSON: unexpected end of data at char 1"
    assert problems["grammars.bad_regex"].startswith("regex: at 1(8): invalid regex")
    assert "grammars.bad_schema: json_schema: invalid schema" in str(caught.value)


def test_undecodable_file(tmp_path: Path) -> None:
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "latin.regex").write_bytes(b"caf\xe9")
    with pytest.raises(ConfigError) as caught:
        GrammarLibrary.load(folder)
    assert caught.value.problems[0][0] == "grammars.latin"
    assert caught.value.problems[0][1].startswith("cannot read latin.regex: 'utf-8' codec can't decode")


def test_get_unknown() -> None:
    with pytest.raises(InvalidGrammar) as caught:
        GrammarLibrary.load(None).get("nope")
    assert caught.value.message == (
        "unknown grammar 'nope' (known: arithmetic, bullet_list, iso_date, sentiment, ticket, yes_no)"
    )


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("yes_no", ConstraintSpec("choice", '["yes","no"]', "yes_no")),
        ("regex:^[a-z]+$", ConstraintSpec("regex", "^[a-z]+$")),
        ("regex:a:b", ConstraintSpec("regex", "a:b")),
        ('choice:["a", "b"]', choice_spec(["a", "b"])),
        (
            'json_schema:{"type": "object",  "required": ["id"]}',
            ConstraintSpec("json_schema", '{"type":"object","required":["id"]}'),
        ),
        ('lark:start: "x"', ConstraintSpec("lark", 'start: "x"')),
        ("gbnf:root ::= [0-9]+", ConstraintSpec("gbnf", "root ::= [0-9]+")),
        ("json_object", JSON_OBJECT),
    ],
)
def test_resolve(ref: str, expected: ConstraintSpec) -> None:
    assert GrammarLibrary.load(None).resolve(ref) == expected


def test_resolve_without_check() -> None:
    lib = GrammarLibrary.load(None)
    assert lib.resolve("regex:(", check=False) == ConstraintSpec("regex", "(")
    with pytest.raises(InvalidGrammar, match="unknown grammar"):
        lib.resolve("nope", check=False)


def test_unknown_name_lists_at_most_20_names(tmp_path: Path) -> None:
    lib = GrammarLibrary.load(write(tmp_path / "g", {f"g{i:02}.regex": "x" for i in range(30)}))
    with pytest.raises(InvalidGrammar) as caught:
        lib.get("nope")
    assert caught.value.message.endswith("g16, g17, ...)")


def test_resolve_prefers_a_grammar_named_json_object(tmp_path: Path) -> None:
    lib = GrammarLibrary.load(write(tmp_path / "g", {"json_object.regex": "x"}))
    assert lib.resolve("json_object") == ConstraintSpec("regex", "x", "json_object")


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("nope", "unknown grammar 'nope'"),
        ("regex:a(?=b)", "regex: at 1(8): invalid regex"),
        ("choice:yes|no", "inline choice: not valid JSON"),
        ("choice:[]", "choice: options must be a non-empty JSON array of strings"),
        ("json_schema:{", "inline json_schema: not valid JSON"),
        ('json_schema:{"type": 1}', "json_schema: invalid schema at type"),
        ("lark:start: foo", 'lark: at 1(8): unknown name: "foo"'),
        ("xml:<a/>", "unknown grammar 'xml:<a/>'"),
    ],
)
def test_resolve_errors(ref: str, message: str) -> None:
    with pytest.raises(InvalidGrammar) as caught:
        GrammarLibrary.load(None).resolve(ref)
    assert caught.value.message.startswith(message)
