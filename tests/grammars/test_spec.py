"""ConstraintSpec: content-hash keys, helpers."""

from __future__ import annotations

import dataclasses

import pytest

from grammars.spec import JSON_OBJECT, ConstraintSpec, Violation, choice_spec, json_schema_spec


def test_key_is_a_content_hash_of_kind_and_source() -> None:
    a = ConstraintSpec("regex", "[a-z]+", name="one")
    assert a.key == ConstraintSpec("regex", "[a-z]+", name="two").key  # the name is not content
    assert a.key != ConstraintSpec("lark", "[a-z]+").key
    assert a.key != ConstraintSpec("regex", "[a-z]*").key
    assert len(a.key) == 64 and int(a.key, 16) >= 0
    # no ambiguity between kind and source
    assert ConstraintSpec("choice", '["a"]').key != ConstraintSpec("regex", '["a"]').key


def test_specs_are_frozen_and_compare_by_value() -> None:
    a = ConstraintSpec("regex", "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.source = "y"  # type: ignore[misc]
    assert a == ConstraintSpec("regex", "x") and hash(a) == hash(ConstraintSpec("regex", "x"))
    assert a != ConstraintSpec("regex", "x", name="n")
    assert repr(a) == "ConstraintSpec(kind='regex', source='x', name=None)"


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown constraint kind 'xml'"):
        ConstraintSpec("xml", "<a/>")  # type: ignore[arg-type]


def test_helpers() -> None:
    assert json_schema_spec({"b": 1, "a": 2}, "n") == ConstraintSpec("json_schema", '{"b":1,"a":2}', "n")
    assert json_schema_spec(True).source == "true"
    assert choice_spec(("y", "\u00e9")) == ConstraintSpec("choice", '["y","\u00e9"]')
    assert ConstraintSpec("json_object", "") == JSON_OBJECT and JSON_OBJECT.is_json
    assert not ConstraintSpec("regex", "x").is_json


def test_surrogates_do_not_break_the_key() -> None:
    assert ConstraintSpec("regex", "\ud800").key


def test_violation() -> None:
    assert Violation("m") == Violation("m", None)
    assert Violation("m", 3).offset == 3
