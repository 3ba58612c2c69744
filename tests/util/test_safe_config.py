"""Safe YAML, TOML and JSON: alias bombs, self-references, deep nesting
and oversized files are refused with one line naming the file before anything is expanded, for sweep
specs, site and machine profiles and ``--config`` files; a config value of the wrong type names the
file, the line and the key. One process, no MPI."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.errors import ConfigError
from fourd_mpi.run.configfile import config_tokens, load_config_file
from fourd_mpi.util.yamlspec import MAX_DEPTH, MAX_FILE_BYTES, YamlDocument


def bomb(levels: int = 9, width: int = 8) -> str:
    """The probe: each level refers ``width`` times to the one before (``width ** levels`` leaves)."""
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def fourd(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=REPO)


HOSTILE_YAML = {
    "bomb": (bomb(), "expand to more than 100,000 YAML nodes"),
    "self-reference": ("a: &a [1, *a]\n", "expand to more than"),
    "deep-flow": ("[" * 5000 + "]" * 5000 + "\n", f"nested more than {MAX_DEPTH} levels"),
    "deep-block": ("".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "v\n",
                   f"nested more than {MAX_DEPTH} levels"),
    "big": ("name: x\n" + "# padding\n" * (MAX_FILE_BYTES // 10 + 1), "bytes, more than"),
    "many-nodes": ("[" + ", ".join(["1"] * 100_001) + "]\n", "more than 100,000 YAML nodes"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_YAML))
def test_hostile_yaml_is_refused_by_the_loader(kind):
    text, message = HOSTILE_YAML[kind]
    with pytest.raises(ConfigError, match=message) as info:
        YamlDocument(text, "s.yaml")
    assert str(info.value).startswith("s.yaml") and "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["bomb", "deep-flow"])
@pytest.mark.parametrize("command", [["sweep", "plan"], ["sweep", "render"], ["run", "--config"],
                                     ["sweep", "plan", "--site", "{}", "jobscripts/weak-gpt-tiny.yaml"],
                                     ["model", "predict", "--config"]])
def test_hostile_yaml_is_one_line_in_every_command(tmp_path, kind, command):
    """Before: the bomb hung ``sweep plan``/``render`` (8x per level), deep nesting was a RecursionError
    traceback, a 30 MB file took minutes. After: one line, exit 2, at once (the timeout is generous)."""
    path = tmp_path / f"{kind}.yaml"
    path.write_text(HOSTILE_YAML[kind][0])
    argv = [a.format(path) for a in command] if "{}" in command else [*command, path]
    if command[0] == "sweep" and command[1] == "render":
        argv += ["--out", tmp_path / "out"]
    proc = fourd(*argv)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and str(path) in proc.stderr, proc.stderr


@pytest.mark.parametrize("name, text, message", [
    ("deep.toml", "a = " + "[" * 5000 + "]" * 5000 + "\n", "nested more than"),
    ("dotted.toml", "[" + ".".join(["k"] * 3000) + "]\nx = 1\n", "nested more than"),
    ("deep.json", "[" * 5000 + "]" * 5000, "nested more than"),
    ("big.toml", "steps = 3\n" + "#\n" * MAX_FILE_BYTES, "more than 1,048,576 bytes"),
    ("dup.json", '{"steps": 3, "steps": 4}', "given twice"),
    ("list.json", "[1, 2]", "expected a mapping"),
    ("config.ini", "steps=3", "unknown format .ini"),
])
def test_hostile_config_files_are_refused(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config_file(str(path))


@pytest.mark.parametrize("name, text, line, key", [
    ("wrong.toml", 'model = "gpt-tiny"\n\nsteps = "many"\n', 3, "steps"),
    ("table.toml", 'model = "gpt-tiny"\n[grid]\ngx = 2\ngy = "wide"\n', 4, "grid.gy"),
    ("dotted.toml", 'grid.gx = 2\ngrid.gz = 1.5\n', 2, "grid.gz"),
    ("wrong.yaml", "model: gpt-tiny\ngrid:\n  gx: 2\n  gy: [1, 2]\n", 4, "grid.gy"),
    ("wrong.json", '{\n  "model": "gpt-tiny",\n  "trace_level": "everything"\n}\n', 3, "trace_level"),
])
def test_config_errors_name_file_line_and_key(tmp_path, name, text, line, key):
    """Before: "config file c.toml: --steps: ..." (no line; JSON not accepted). After: file:line: key."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config_tokens(load_config_file(str(path)), str(path))
    assert str(info.value).startswith(f"config file {path}:{line}: {key}: "), str(info.value)
    proc = fourd("run", "--config", path)  # the same line from the command, before MPI does anything
    assert proc.returncode == 2 and proc.stderr.strip() == f"fourd-mpi: error: {info.value}", proc.stderr


def test_json_config_is_read_like_toml(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"model": "gpt-tiny", "grid": {"gx": 2}, "trace_level": "layer"}')
    config = load_config_file(str(path))
    assert config == {"model": "gpt-tiny", "gx": 2, "trace-level": "layer"}
    assert config_tokens(config, str(path)) == ["--model=gpt-tiny", "--gx=2", "--trace-level=layer"]
