"""Schema violations are worded by the project, not by jsonschema (issue 31 item 1): the tests pin
these lines, so a jsonschema release that rewords its messages must not change them. Known answers
for every validator the project's schemas use. No MPI."""

from __future__ import annotations

import pytest

from fourd_mpi.util.yamlspec import schema_violations

SCHEMA = {
    "type": "object",
    "required": ["name", "ranks"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "ranks": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 64}, "minItems": 1,
                  "uniqueItems": True},
        "study": {"enum": ["weak", "strong"]},
        "rate": {"type": ["number", "string"], "exclusiveMinimum": 0},
        "version": {"const": 1},
    },
}


@pytest.mark.parametrize("data, where, message", [
    ({"ranks": [1]}, [], "'name' is a required property"),
    ({"name": "x", "ranks": [1], "extra": 1}, ["extra"], "unknown key 'extra' (known: name, ranks, rate, study, version)"),
    ({"name": 3, "ranks": [1]}, ["name"], "3 is not of type 'string'"),
    ({"name": "", "ranks": [1]}, ["name"], "'' has too few characters (min 1)"),
    ({"name": "x", "ranks": []}, ["ranks"], "[] has too few items (min 1)"),
    ({"name": "x", "ranks": [0]}, ["ranks", 0], "0 is less than the minimum of 1"),
    ({"name": "x", "ranks": [65]}, ["ranks", 0], "65 is greater than the maximum of 64"),
    ({"name": "x", "ranks": [2, 2]}, ["ranks"], "[2, 2] has repeated items"),
    ({"name": "x", "ranks": [1], "study": "wide"}, ["study"], "'wide' is not one of weak, strong"),
    ({"name": "x", "ranks": [1], "rate": None}, ["rate"], "None is not of type 'number', 'string'"),
    ({"name": "x", "ranks": [1], "rate": 0}, ["rate"], "0 is less than or equal to the minimum of 0"),
    ({"name": "x", "ranks": [1], "version": 2}, ["version"], "1 was expected"),
])
def test_each_validator_has_the_projects_wording(data, where, message):
    assert schema_violations(data, SCHEMA) == [(where, message)]
