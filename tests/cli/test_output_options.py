"""One rule for every file a command writes (:mod:`fourd_mpi.util.files`).

The commands are enumerated from the parser: every option that names an output (``-o``, ``--out``,
``--emit-sweep``, ``--json``, ``--report``) must have a sample command line below, and each is tried
against an existing foreign directory, a read-only file system (a real tmpfs remounted read-only; root
only), ``/dev/full``, an output that is one of the command's inputs (with ``--force``) and a symbolic link
to another directory's file (``--out``: to a directory; with ``--force``: never written through nor
replaced). Each must be refused in one line with status 2, before the work, and leave every file as it was.

Before: ``analyze T.h5 -o T.h5 --force`` and ``export perfetto T.h5 -o T.h5 --force`` destroyed the
trace; ``results reindex DIR -o T.h5 --force`` replaced it with an index; ``sweep render --out DIR``
emptied a directory it did not make (``--out .`` the current directory); unwritable outputs were
tracebacks after the work (``export``, ``plot``, ``model paper``, ``sweep render``, ``tune
--emit-sweep``, ``verify --json``), and ``bench collectives --name 'my profile'`` failed only after
every measurement.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, mounted_tmpfs, mpi_env

from fourd_mpi.cli.args import walk_parsers
from fourd_mpi.cli.main import build_parser, main
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.files import refuse_output

SAMPLE_TRACE = REPO / "results" / "samples" / "weak-1.h5"
SPEC = REPO / "jobscripts" / "weak-gpt-tiny.yaml"
#: options that name something a command writes
OUTPUT_OPTIONS = ("-o", "--out", "--emit-sweep", "--json", "--report")

#: per (command, option): a command line with IN (an input the output may not replace: a trace, the index,
#: the profile) and OUT (the output), the suffix of a good output name, and whether it runs under MPI
SAMPLES = {
    ("analyze", "-o"): (["analyze", "IN", "-o", "OUT"], ".txt", False),
    ("plot", "-o"): (["plot", "breakdown", "IN", "-o", "OUT"], ".png", False),
    ("export", "-o"): (["export", "perfetto", "IN", "-o", "OUT"], ".json", False),
    ("results list", "-o"): (["results", "list", "--index", "INDEX", "-o", "OUT"], ".txt", False),
    ("results reindex", "-o"): (["results", "reindex", "DIR", "-o", "OUT"], ".jsonl", False),
    ("compare", "-o"): (["compare", "IN", "--baseline", "IN", "-o", "OUT"], ".txt", False),
    ("trace recover", "-o"): (["trace", "recover", "SPOOL", "-o", "OUT"], ".h5", False),
    ("sweep render", "--out"): (["sweep", "render", "SPEC", "--out", "OUT"], "", False),
    ("tune", "--emit-sweep"): (["tune", "--ranks", "8", "--model", "gpt-tiny", "--profile", "PROFILE",
                                "--emit-sweep", "OUT"], ".yaml", False),
    ("model calibrate", "-o"): (["model", "calibrate", "IN", "--profile", "laptop", "-o", "OUT"], ".yaml", False),
    ("model validate", "-o"): (["model", "validate", "IN", "-o", "OUT"], ".txt", False),
    ("model paper", "-o"): (["model", "paper", "--profile", "PROFILE", "-o", "OUT"], ".png", False),
    ("verify", "--json"): (["verify", "--steps", "1", "--model", "gpt-tiny", "--json", "OUT"], ".json", True),
    ("bench collectives", "-o"): (["bench", "collectives", "--name", "p", "--fallback", "PROFILE", "-o", "OUT"],
                                  ".yaml", True),
    ("bench collectives", "--report"): (["bench", "collectives", "--fallback", "PROFILE", "--report", "OUT", "-o",
                                         "SCRATCH/p.yaml"], ".txt", True),
}
#: what IN means for a command whose output could land on it (None: the command reads no file of the user's)
INPUT_OF = {"results list": "INDEX", "results reindex": "TRACE_IN_DIR", "trace recover": "SPOOL_META",
            "sweep render": "SPEC", "tune": "PROFILE", "model paper": "PROFILE", "verify": None,
            "bench collectives": "PROFILE"}


PARSERS = dict(walk_parsers(build_parser()))


def output_options():
    for path, parser in walk_parsers(build_parser()):
        for action in parser._actions:
            for option in action.option_strings:
                if option in OUTPUT_OPTIONS:
                    yield " ".join(path), option


def test_every_output_option_has_a_sample():
    missing = sorted(set(output_options()) - set(SAMPLES))
    assert not missing, f"add a command line to SAMPLES for {missing}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Inputs: a trace, an index of it, a results directory, a spool, a profile file, the spec."""
    if not SAMPLE_TRACE.exists():
        pytest.skip("no sample trace under results/samples")
    root = tmp_path_factory.mktemp("outrule")
    results = root / "results"
    results.mkdir()
    shutil.copy(SAMPLE_TRACE, results / "t.h5")
    assert main(["results", "reindex", str(results)]) == 0
    spool = root / "run.ranks"
    spool.mkdir()
    (spool / "run.json").write_text('{"run_id": "run", "world_size": 1, "layers": [""], "level": "op"}')
    profile = root / "mine.yaml"
    shutil.copy(REPO / "fourd_mpi" / "perf" / "profiles" / "laptop.yaml", profile)
    profile.write_text(profile.read_text().replace("name: laptop", "name: mine"))
    spec = root / "spec.yaml"
    shutil.copy(SPEC, spec)
    scratch = root / "scratch"
    scratch.mkdir()
    return {"IN": str(results / "t.h5"), "INDEX": str(results / "index.jsonl"), "DIR": str(results),
            "SPOOL": str(spool), "PROFILE": str(profile), "SPEC": str(spec), "SCRATCH": str(scratch),
            "TRACE_IN_DIR": str(results / "t.h5"), "SPOOL_META": str(spool / "run.json"), "root": root}


@pytest.fixture(scope="module")
def readonly(tmp_path_factory):
    where = tmp_path_factory.mktemp("ro")
    yield from mounted_tmpfs(where, "ro,size=1m")


def digest_tree(root) -> dict:
    out = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as fh:
                out[path] = hashlib.sha256(fh.read()).hexdigest()
    return out


def run_command(argv, mpi: bool, capfd, cwd):
    """Status and standard error of ``fourd-mpi ARGV`` (serial commands in this process, MPI ones as a singleton)."""
    if mpi:
        proc = subprocess.run([sys.executable, "-m", "fourd_mpi", *argv], capture_output=True, text=True,
                              timeout=120, env=mpi_env(), cwd=cwd)
        return proc.returncode, proc.stderr, proc.stdout
    capfd.readouterr()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        status = main(argv)
    finally:
        os.chdir(old)
    captured = capfd.readouterr()
    return status, captured.err, captured.out


def refused(status, err, out, *expected):
    assert status == 2, (status, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: "), err
    assert not any(word in out for word in ("measured", "#wrong", "passed")), out  # refused before the work
    for text in expected:
        assert text in lines[0], lines[0]


CASES = ("foreign-directory", "read-only", "dev-full", "output-is-input", "symbolic-link")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("key", sorted(SAMPLES), ids=lambda k: f"{k[0]} {k[1]}".replace(" ", "-"))
def test_each_output_is_refused_in_one_line_before_the_work(key, case, world, readonly, capfd):
    argv, suffix, mpi = SAMPLES[key]
    command = key[0]
    root = world["root"]
    foreign = root / f"foreign-{command.replace(' ', '-')}-{key[1].strip('-')}"
    foreign.mkdir(exist_ok=True)
    (foreign / "notes.txt").write_text("mine\n")
    force = []
    if case == "foreign-directory":
        out, expected = str(foreign), ()
    elif case == "read-only":
        out, expected = str(readonly / f"out{suffix}" if suffix else readonly / "out"), ("Read-only file system",)
    elif case == "dev-full":
        out, expected = "/dev/full", ()
    elif case == "symbolic-link":  # a link to another directory's file (--out: to a directory), even with --force
        shared = root / "shared"
        shared.mkdir(exist_ok=True)
        target = shared / ("a-directory" if key[1] == "--out" else f"a-file{suffix}")
        if key[1] == "--out":
            target.mkdir(exist_ok=True)
        else:
            target.write_text("another directory's file\n")
        out = str(root / f"link-{command.replace(' ', '-')}-{key[1].strip('-')}{suffix}")
        if not os.path.lexists(out):
            os.symlink(target, out)
        expected = ("is a symbolic link to", str(target))
        force = ["--force"] if "--force" in PARSERS[tuple(command.split())]._option_string_actions else []
    else:
        which = INPUT_OF.get(command, "IN")
        if which is None:
            pytest.skip(f"{command} reads no file of the user's that {key[1]} could replace")
        out, expected, force = world[which], (), ["--force"]
    values = dict(world, OUT=out)
    line = [values.get(a, a).replace("SCRATCH", world["SCRATCH"]) for a in argv] + force
    before = digest_tree(root)
    status, err, stdout = run_command(line, mpi, capfd, str(world["SCRATCH"]))
    refused(status, err, stdout, *expected)
    assert digest_tree(root) == before  # nothing replaced, nothing removed
    assert (foreign / "notes.txt").read_text() == "mine\n"
    if case == "symbolic-link":
        assert os.path.islink(out)  # the link is kept, and what it points to is as it was (digest above)


def test_sweep_render_never_removes_what_it_did_not_write(world, capfd):
    """Before: --out DIR without manifest.json deleted everything in DIR; --out . emptied the current
    directory; --force also deleted traces under a --results-dir inside --out."""
    scratch = world["root"] / "render"
    scratch.mkdir()
    (scratch / "spec.yaml").write_text(open(world["SPEC"]).read())
    status, err, _ = run_command(["sweep", "render", "spec.yaml", "--out", "."], False, capfd, str(scratch))
    refused(status, err, "", "did not create")
    assert sorted(os.listdir(scratch)) == ["spec.yaml"]
    out = scratch / "jobs"
    assert run_command(["sweep", "render", "spec.yaml", "--out", "jobs"], False, capfd, str(scratch))[0] == 0
    (out / "results").mkdir()
    (out / "results" / "run.h5").write_text("a trace\n")
    (out / "mine.txt").write_text("mine\n")
    status, err, _ = run_command(["sweep", "render", "spec.yaml", "--out", "jobs"], False, capfd, str(scratch))
    refused(status, err, "--force")
    status, _, _ = run_command(["sweep", "render", "spec.yaml", "--out", "jobs", "--force", "--results-dir",
                                "jobs/results"], False, capfd, str(scratch))
    assert status == 0
    assert (out / "results" / "run.h5").read_text() == "a trace\n" and (out / "mine.txt").read_text() == "mine\n"
    assert (out / "manifest.json").exists() and (out / ".fourd-mpi-dir.json").exists()


def test_an_empty_existing_directory_may_receive_a_render(world, capfd):
    scratch = world["root"] / "render-empty"
    (scratch / "out").mkdir(parents=True)
    status, err, _ = run_command(["sweep", "render", world["SPEC"], "--out", "out"], False, capfd, str(scratch))
    assert status == 0, err
    assert (scratch / "out" / "manifest.json").exists()


def test_a_failed_write_leaves_no_file_and_no_temporary(tmp_path):
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.util.files import replacing

    target = tmp_path / "report.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with replacing(str(target)) as tmp:
            with open(tmp, "w") as fh:
                fh.write("half")
            raise RuntimeError("the work failed")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["report.txt"]
    with pytest.raises(ConfigError, match="cannot write -o"):
        with replacing(str(tmp_path / "gone" / "x.txt")) as tmp:
            open(tmp, "w").close()


def test_bench_refuses_a_profile_name_before_measuring(tmp_path):
    """Before: --name 'my profile' failed with a jsonschema traceback after every measurement (all lost)."""
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "bench", "collectives", "--name", "my profile", "-o",
                           str(tmp_path / "p.yaml")], capture_output=True, text=True, timeout=120, env=mpi_env(),
                          cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr.strip() == ("fourd-mpi: error: --name 'my profile': "
                                   "a profile name uses letters, digits and . _ - "
                                   "(at most 64 characters, starting with a letter or digit)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind, words", [("dir", "it is a directory"), ("fifo", "not a regular file (a FIFO)"),
                                         ("dangling", "a symbolic link that leads nowhere"),
                                         ("device", "not a regular file (a character device)")])
@pytest.mark.parametrize("force", [False, True])
def test_an_output_that_is_not_a_regular_file_is_said_first(tmp_path, kind, words, force):
    path = tmp_path / "out.json"
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling":
        os.symlink(tmp_path / "nowhere" / "x", path)
    else:
        path = "/dev/null"
    with pytest.raises(ConfigError) as info:
        refuse_output(str(path), force)
    assert words in str(info.value) and "--force" not in str(info.value)
