"""Schema violations are worded by the project, not by jsonschema: the tests pin these lines, so a jsonschema
release that rewords its messages must not change them. Known answers for every validator the project's schemas
use; YAML 1.2 numbers (``1e30``) read as numbers wherever a schema wants one, a quoted number stays text and says so.
No MPI."""

from __future__ import annotations

import pytest

from fourd_mpi.errors import ConfigError
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
    ({"name": "x", "ranks": [1], "extra": 1}, ["extra"],
     "unknown key 'extra' (known: name, ranks, rate, study, version)"),
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


@pytest.mark.parametrize("literal, value", [("1e30", 1e30), ("5E-6", 5e-6), ("+2e3", 2000.0), ("1.5e2", 150.0)])
def test_a_yaml_1_2_float_is_a_number_where_the_schema_wants_one(literal, value, tmp_path):
    """Before: 'float32: 1e30' was "'1e30' is not of type 'number'" (PyYAML reads YAML 1.1: 1e30 is text)."""
    from fourd_mpi.perf.machine import load_profile

    path = tmp_path / "p.yaml"
    path.write_text(f"base: dgx-h100\nname: mine\ncompute:\n  gemm_tflops: {{float32: {literal}}}\n")
    assert load_profile(str(path)).data["compute"]["gemm_tflops"]["float32"] == value


def test_a_quoted_number_stays_text_and_says_so(tmp_path):
    from fourd_mpi.perf.machine import load_profile

    path = tmp_path / "p.yaml"
    path.write_text('base: dgx-h100\nname: mine\ncompute:\n  gemm_tflops: {float32: "1e30"}\n')
    with pytest.raises(ConfigError, match=r"p.yaml:4: compute.gemm_tflops.float32: '1e30' is not of type 'number' "
                                          r"\(a quoted number is text: write it without quotes\)"):
        load_profile(str(path))


def test_yaml_numbers_for_every_schema_validated_file():
    """The class: YamlDocument.validate reads the numbers (sweep specs, sites, profiles); an integer field takes
    an integral 1e3 as 1000; a name that looks like a number stays a name."""
    from fourd_mpi.util.yamlspec import YamlDocument

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                               "name": {"type": "string"}, "k": {"type": "integer"}}}
    doc = YamlDocument("n: 1e3\nx: 2e-3\nname: 1e3\nk: 1.5e0\n", "s.yaml")
    with pytest.raises(ConfigError, match="s.yaml:4: k: '1.5e0' is not of type 'integer'"):
        doc.validate(schema)
    assert doc.data["n"] == 1000 and isinstance(doc.data["n"], int) and doc.data["x"] == 2e-3
    assert doc.data["name"] == "1e3"
