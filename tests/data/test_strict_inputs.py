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


# ---- cost model files and model configs --------------------------------------------------------------------------
def _cost_file(tmp_path, payload) -> str:
    path = tmp_path / "cost.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return str(path)


@pytest.mark.parametrize(
    "payload, needle",
    [
        ({"attn_coef": 1e-6, "linear_coef": 1.0, "causal": "false"}, '"causal": expected true or false, got "false"'),
        ({"attn_coef": 1e-6, "linear_coef": 1.0, "window": True}, '"window": expected an integer >= 1 or null'),
        ({"attn_coef": 1e-6, "linear_coef": 1.0, "fixd": 2.0}, '"fixd": unknown key (did you mean "fixed"?)'),
        ({"attn_coef": 1e-6, "linear_coef": "1"}, '"linear_coef": expected a number >= 0, got "1"'),
        ({"attn_coef": 1e-6}, 'missing key "linear_coef"'),
        ({"format": "balancer.cost", "format_version": 9, "attn_coef": 1, "linear_coef": 1}, "newer than"),
        ({"format": "balancer.plan", "format_version": 1, "attn_coef": 1, "linear_coef": 1}, "not a balancer.cost"),
        ('{"attn_coef": 1e-6, "linear_coef": 1.0, "window": 1' + "0" * 30 + "}", '"window": expected an integer'),
        ('{"attn_coef": NaN, "linear_coef": 1.0}', "NaN is not a JSON number"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_cost_files_are_read_strictly(tmp_path, payload, needle):
    from balancer import CostModel

    path = _cost_file(tmp_path, payload)
    with pytest.raises(ValueError) as err:
        CostModel.load(path)
    assert str(err.value).startswith(path + ": ") and needle in str(err.value), str(err.value)


def test_cost_files_round_trip_and_version_1_still_loads(tmp_path):
    from balancer import CostModel

    cost = CostModel(attn_coef=2e-6, linear_coef=1.0, fixed=3.0, causal=False, window=512, comm_overlap=False)
    cost.save(tmp_path / "c.json", held_out={"count": 3})
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["format"] == "balancer.cost" and data["format_version"] == 2
    assert CostModel.load(tmp_path / "c.json") == cost
    del data["format_version"]
    data["format"] = "balancer.cost/1"  # as version 1 wrote it
    assert CostModel.load(_cost_file(tmp_path, data)) == cost
    hand_written = {"attn_coef": 2e-6, "linear_coef": 1.0}
    assert CostModel.load(_cost_file(tmp_path, hand_written)) == CostModel(attn_coef=2e-6, linear_coef=1.0)


@pytest.mark.parametrize(
    "argument, value",
    [("causal", "false"), ("causal", 1), ("window", True), ("window", "64"), ("comm_overlap", "yes")],
)
def test_cost_model_api_names_the_argument(argument, value):
    from balancer import CostModel

    with pytest.raises(ValueError, match=f"CostModel.{argument} must be"):
        CostModel(attn_coef=1.0, linear_coef=1.0, **{argument: value})


LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"num_attention_heads": 0}, '"num_attention_heads": expected an integer in [1, 2147483647], got 0'),
        ({"hidden_size": "64"}, '"hidden_size": expected an integer in [1, 2147483647], got "64"'),
        ({"hidden_size": True}, '"hidden_size": expected an integer'),
        ({"hidden_size": 64.0}, '"hidden_size": expected an integer'),
        ({"num_hidden_layers": 2**80}, '"num_hidden_layers": expected an integer in [1, 2147483647]'),
        ({"sliding_window": True}, '"sliding_window": expected an integer'),
        ({"use_sliding_window": "false", "sliding_window": 16}, '"use_sliding_window": expected true or false'),
        ({"num_attention_heads": 5}, '"hidden_size" 64 is not divisible by "num_attention_heads" 5'),
        ({"num_attention_heads": None}, 'missing key "num_attention_heads"'),
    ],
)
def test_model_configs_name_the_file_and_key(change, needle):
    from balancer import CostModel

    config = {**LLAMA, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError) as err:
        CostModel.from_config(config, source="config.json")
    assert str(err.value).startswith("config.json: ") and needle in str(err.value), str(err.value)


def test_model_configs_keep_reading_what_they_read():
    from balancer import CostModel

    qwen = {**LLAMA, "use_sliding_window": False, "sliding_window": 4096, "num_key_value_heads": 2, "extra": "x"}
    assert CostModel.from_config(qwen).window is None
    assert CostModel.from_config({**LLAMA, "sliding_window": 32}).window == 32
    assert CostModel.from_config({**LLAMA, "sliding_window": None}).window is None


def test_cost_coefficients_are_bounded(tmp_path):
    """A coefficient of 1e308 made every cost inf or nan: planning then failed with a message about step sizes,
    or wrote a plan of nan metrics. Refused where it is read, naming the file and key (or the argument)."""
    path = tmp_path / "cost.json"
    from balancer.planning.cost.model import CostModel

    path.write_text(json.dumps({"attn_coef": 1e-5, "linear_coef": 1e308}))
    with pytest.raises(ValueError, match=r'cost.json: "linear_coef": expected a number in \[0, 1e\+100\], got 1e\+308'):
        CostModel.load(path)
    with pytest.raises(ValueError, match=r"CostModel.fixed must be a finite number in \[0, 1e\+100\]"):
        CostModel(attn_coef=1.0, linear_coef=1.0, fixed=1e308)
