"""Body rewriting: only the named top-level fields change, every other byte stays."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw_slurm.router._body import with_fields

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def _spaced(obj: dict[str, Any], rnd: random.Random) -> str:
    """The object as JSON with random whitespace around its top-level tokens."""

    def ws() -> str:
        return rnd.choice(["", " ", "\n", " \t "])

    items = [f"{ws()}{json.dumps(k)}{ws()}:{ws()}{json.dumps(v)}{ws()}" for k, v in obj.items()]
    return "{" + ",".join(items) + ws() + "}"


@given(
    obj=st.dictionaries(st.text(max_size=6), _json, max_size=5),
    new_model=st.text(max_size=10),
    seed=st.integers(0, 1000),
)
def test_only_the_named_fields_change(obj: dict[str, Any], new_model: str, seed: int) -> None:
    raw = _spaced(obj, random.Random(seed)).encode()
    fields = {"model": new_model, "stream_options": {"include_usage": True}}
    out = with_fields(raw, fields)
    # Told the object's keys, it gives the same bytes (by either way).
    assert with_fields(raw, fields, obj.keys()) == out
    assert json.loads(out) == {
        **obj,
        "model": new_model,
        "stream_options": {"include_usage": True},
    }
    # Whatever the old value of a field was, the rest of the text is kept:
    # removing the new values gives back the old text without those values.
    if "model" not in obj and "stream_options" not in obj:
        assert out.startswith(raw[:-1])


def test_numbers_and_nested_models_are_not_touched() -> None:
    raw = (
        b'{"model" : "alias", "temperature": 1e400, "big": 12345678901234567890123,'
        b' "tools": [{"model": "keep"}], "s": "\\u00e9"}'
    )
    out = with_fields(raw, {"model": "real"})
    assert out == raw.replace(b'"alias"', b'"real"')


def test_empty_object_gets_fields() -> None:
    assert json.loads(with_fields(b" {\n} ", {"model": "m"})) == {"model": "m"}


@given(obj=st.dictionaries(st.text(max_size=6), _json, max_size=5), seed=st.integers(0, 1000))
def test_a_field_the_object_lacks_is_added_at_its_end(obj: dict[str, Any], seed: int) -> None:
    fields = {"stream_options": {"include_usage": True}, "é": [1, "ü"]}
    obj = {k: v for k, v in obj.items() if k not in fields}
    raw = _spaced(obj, random.Random(seed)).encode() + b" \n"[: seed % 3]
    out = with_fields(raw, fields, obj.keys())
    assert out == with_fields(raw, fields)  # the walk over every value's span adds them there too
    assert json.loads(out) == {**obj, **fields}
    end = len(raw.rstrip()) - 1
    assert out.startswith(raw[:end]) and out.endswith(raw[end:])
