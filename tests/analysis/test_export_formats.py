"""The registry of export formats (fourd_mpi.analysis.export): which format ``fourd-mpi export FORMAT -o PATH``
writes, and the options each writer takes. Known answers from the suffixes the Perfetto UI and Hatchet accept."""

from __future__ import annotations

import dataclasses

import pytest

from fourd_mpi.analysis.export import COMMANDS, FORMATS, FORMATS_BY_NAME, format_for


@pytest.mark.parametrize("command, path, name", [
    ("perfetto", "run.json", "perfetto-json"),
    ("perfetto", "RUN.JSON.GZ", "perfetto-json"),
    ("perfetto", "run.pftrace", "perfetto-proto"),
    ("perfetto", "run.perfetto-trace.gz", "perfetto-proto"),
    ("thicket", "run.cali.json", "thicket"),
    ("thicket", "profile.anything", "thicket"),
])
def test_the_format_follows_the_command_and_the_suffix(command, path, name):
    assert format_for(command, path).name == name


def test_a_timeline_of_another_suffix_is_one_line_naming_the_suffixes():
    with pytest.raises(ValueError) as info:
        format_for("perfetto", "run.txt")
    assert str(info.value) == ("run.txt: the timeline's format comes from its suffix: .json, .json.gz (Chrome "
                               "trace-event JSON) or .pftrace, .perfetto-trace, .pftrace.gz, .perfetto-trace.gz "
                               "(Perfetto protobuf)")
    with pytest.raises(ValueError, match="unknown export format 'otf2': choose one of perfetto, thicket"):
        format_for("otf2", "run.otf2")


def test_the_registry_lists_each_format_once_with_the_options_its_writer_takes():
    assert COMMANDS == ("perfetto", "thicket")
    assert [f.name for f in FORMATS] == list(FORMATS_BY_NAME) == ["perfetto-json", "perfetto-proto", "thicket"]
    assert {f.name: f.options for f in FORMATS} == {"perfetto-json": ("steps", "ranks"),
                                                  "perfetto-proto": ("steps", "ranks"),
                                                  "thicket": ("include_warmup",)}
    seen = []
    spy = dataclasses.replace(FORMATS_BY_NAME["thicket"], write=lambda trace, path, **options: seen.append(options))
    spy.export(None, "x.json", steps=[1], ranks=None, include_warmup=True)  # what cmd_export passes
    assert seen == [{"include_warmup": True}]
