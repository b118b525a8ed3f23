"""Strict reading of the JSON files balancer trusts (balancer.strict_json) and of every input the planning commands
read: one error naming the file and the key, never a loosely read value."""

from __future__ import annotations

import json

import pytest

from balancer.strict_json import (
    FormatSpec,
    JSONFileError,
    anything,
    array,
    boolean,
    check,
    check_format,
    integer,
    load_json,
    number,
    obj,
    string,
)

COST_LIKE = obj(
    {
        "attn_coef": number(min=0),
        "causal": boolean(required=False),
        "window": integer(min=1, nullable=True, required=False),
        "mode": string(choices=("a", "b"), required=False),
        "sizes": array(integer(min=1), required=False),
        "nested": obj({"dp": integer(min=1)}, required=False),
        "report": anything(required=False),
        "added_later": integer(required=False, since=2),
    }
)


def _load(tmp_path, payload: bytes | str):
    path = tmp_path / "cost.json"
    path.write_bytes(payload if isinstance(payload, bytes) else payload.encode())
    return path, load_json(path)


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b"\xff\xfe{}", "not UTF-8 text (byte 0xff at offset 0)"),
        (b'{"a": ', "invalid JSON at line 1 column 7"),
        (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
        (b'{"a": [' * 5000 + b"1" + b"]}" * 5000, "nested too deeply"),
        (b'{"a": 1, "a": 2}', 'key "a" appears twice'),
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
        (b"9" * 5000, "an integer of more than 4300 digits"),
    ],
)
def test_load_json_refuses_with_one_line_naming_the_file(tmp_path, payload, needle):
    with pytest.raises(JSONFileError) as err:
        _load(tmp_path, payload)
    message = str(err.value)
    assert message.startswith(str(tmp_path / "cost.json") + ": ") and needle in message and "\n" not in message


def test_load_json_accepts_a_byte_order_mark_and_deep_strings(tmp_path):
    assert _load(tmp_path, b'\xef\xbb\xbf{"a": 1}')[1] == {"a": 1}
    text = json.dumps({"a": "[" * 20_000})  # brackets inside a string are not nesting
    assert _load(tmp_path, text)[1] == {"a": "[" * 20_000}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"attn_coef": 1, "window": True}, 'cost.json: "window": expected an integer >= 1 or null, got true'),
        ({"attn_coef": 1, "causal": "false"}, 'cost.json: "causal": expected true or false, got "false"'),
        ({"attn_coef": 1, "causal": 0}, 'cost.json: "causal": expected true or false, got 0'),
        ({"attn_coef": 1, "window": 2.0}, 'cost.json: "window": expected an integer >= 1 or null, got 2.0'),
        ({"attn_coef": 1, "window": 0}, 'cost.json: "window": expected an integer >= 1 or null, got 0'),
        (
            {"attn_coef": 1, "window": 2**63},
            'cost.json: "window": expected an integer in [1, 2^63-1] or null, got 9223372036854775808',
        ),
        ({"attn_coef": "1"}, 'cost.json: "attn_coef": expected a number >= 0, got "1"'),
        ({"attn_coef": True}, 'cost.json: "attn_coef": expected a number >= 0, got true'),
        ({"attn_coef": -1}, 'cost.json: "attn_coef": expected a number >= 0, got -1'),
        ({"atn_coef": 1}, 'cost.json: "atn_coef": unknown key (did you mean "attn_coef"?)'),
        ({"attn_coef": 1, "zzz": 1}, 'cost.json: "zzz": unknown key (known keys: attn_coef, causal, window'),
        ({}, 'cost.json: missing key "attn_coef" (a number >= 0)'),
        ({"attn_coef": 1, "mode": "c"}, 'cost.json: "mode": expected one of "a", "b", got "c"'),
        ({"attn_coef": 1, "sizes": [1, 0]}, 'cost.json: "sizes[1]": expected an integer >= 1, got 0'),
        ({"attn_coef": 1, "nested": {"dp": None}}, 'cost.json: "nested.dp": expected an integer >= 1, got null'),
        ({"attn_coef": 1, "nested": {"dpp": 1}}, 'cost.json: "nested.dpp": unknown key (did you mean "dp"?)'),
        ({"attn_coef": 1, "added_later": 1}, 'cost.json: "added_later": not part of format_version 1'),
        ([1], "cost.json: expected an object, got [1]"),
    ],
)
def test_check_names_file_key_and_value(data, message):
    with pytest.raises(JSONFileError) as err:
        check(data, COST_LIKE, "cost.json", version=1)
    assert str(err.value).startswith(message), str(err.value)


def test_check_returns_good_values_unchanged():
    data = {"attn_coef": 0.5, "window": None, "report": {"x": [1, "y"]}, "added_later": 3}
    assert check(data, COST_LIKE, "cost.json", version=2) is data


SPEC = FormatSpec("balancer.thing", 3, {"balancer.thing/1": 1})


@pytest.mark.parametrize(
    "data, version",
    [
        ({"format": "balancer.thing/1"}, 1),
        ({"format": "balancer.thing", "format_version": 2}, 2),
        ({"format": "balancer.thing", "format_version": 3}, 3),
    ],
)
def test_check_format_reads_older_versions(data, version):
    assert check_format(data, "t.json", SPEC) == version


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"format": "balancer.thing", "format_version": 4}, '"format_version": 4 is newer than this balancer reads'),
        ({"format": "balancer.other", "format_version": 1}, '"format": not a balancer.thing file'),
        ({"format": "balancer.thing/2"}, '"format": not a balancer.thing file'),
        ({"format": "balancer.thing"}, 'missing key "format_version"'),
        ({"format": "balancer.thing", "format_version": True}, '"format_version": expected an integer >= 1, got true'),
        ({"format": "balancer.thing", "format_version": "3"}, '"format_version": expected an integer >= 1, got "3"'),
        ({}, 'missing key "format"'),
    ],
)
def test_check_format_refuses_unknown_formats(data, needle):
    with pytest.raises(JSONFileError, match="^t.json: ") as err:
        check_format(data, "t.json", SPEC)
    assert needle in str(err.value)


def test_check_format_optional_reads_current_version():
    assert check_format({"a": 1}, "t.json", SPEC, required=False) == 3
    assert SPEC.header() == {"format": "balancer.thing", "format_version": 3}
