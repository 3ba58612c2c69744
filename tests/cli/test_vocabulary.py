"""One command-line vocabulary (docs/guide/commands.md, "Command-line conventions"; ``fourd_mpi/cli/args.py``).

Every (sub)command is discovered from the parser itself (:func:`fourd_mpi.cli.args.walk_parsers`),
so a command added later is checked by the same rules: ``--help`` exits 0, every argument has
help text, long options are never abbreviated, counts and selections are told apart by name,
``--format`` names come from the common set, deprecated spellings still work and say so.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.cli.args import FORMATS, SPECIAL_FORMATS, DeprecatedAlias, OneLineParser, walk_parsers
from fourd_mpi.cli.main import build_parser, main
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.values import int_list

PARSERS = list(walk_parsers(build_parser()))
IDS = [" ".join(path) or "fourd-mpi" for path, _ in PARSERS]
#: commands every walk must find (a rename or a lost registration fails here)
EXPECTED = {"run", "verify", "info", "presets", "trace show", "trace check", "trace recover", "analyze", "plot",
            "export", "sweep plan", "sweep render", "sweep submit", "sweep status", "sweep collect", "tune",
            "model calibrate", "model validate", "model compare-axonn", "model paper", "bench collectives",
            "completion", "results list", "results show", "results reindex", "compare"}


def options(parser):
    """The parser's own arguments (not -h, not its subcommand action)."""
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction))]


def is_leaf(parser) -> bool:
    return not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def test_the_walk_finds_every_command():
    assert EXPECTED <= set(IDS), sorted(EXPECTED - set(IDS))


@pytest.mark.parametrize("path, parser", PARSERS, ids=IDS)
def test_help_exits_0_and_every_argument_has_help(path, parser, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fourd-mpi") and "Traceback" not in out
    assert not help_problems(parser), help_problems(parser)


def help_problems(parser):
    """What breaks the rules of help text and parser class in one parser."""
    out = []
    if not isinstance(parser, OneLineParser) or parser.allow_abbrev is not False:
        out.append(f"{parser.prog}: not a OneLineParser without abbreviations (build it with sub.add_parser)")
    for action in options(parser):
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, DeprecatedAlias):
            if action.help is not argparse.SUPPRESS:
                out.append(f"{parser.prog} {name}: a deprecated alias is hidden from --help")
        elif not action.help or action.help is argparse.SUPPRESS or not action.help.strip():
            out.append(f"{parser.prog} {name}: no help text")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {a.dest for a in action._choices_actions if a.help and a.help.strip()}
            out += [f"{parser.prog} {c}: subcommand without help" for c in set(action.choices) - helped]
    return out


def test_the_help_rules_catch_what_they_should():
    bad = OneLineParser(prog="x")
    bad.add_argument("--quiet", action="store_true")
    sub = bad.add_subparsers(dest="c")
    sub.add_parser("silent")
    assert sorted(help_problems(bad)) == ["x --quiet: no help text", "x silent: subcommand without help"]
    assert help_problems(argparse.ArgumentParser(prog="y")) == [
        "y: not a OneLineParser without abbreviations (build it with sub.add_parser)"]


def filler(parser):
    """Arguments that satisfy the parser's required ones (first choice, else "1")."""
    out = []
    for action in options(parser):
        if action.required or not action.option_strings and action.nargs != "?":
            value = str(action.choices[0] if isinstance(action.choices, (list, tuple)) else "1")
            out += ([action.option_strings[-1]] if action.option_strings else []) + [value]
    return out


LEAVES = [(path, parser) for path, parser in PARSERS if is_leaf(parser)]


@pytest.mark.parametrize("path, parser", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_no_long_option_is_abbreviated(path, parser):
    """``run --step 3`` must not be ``--steps 3``: each long option, one letter short, is refused."""
    known = {o for a in parser._actions for o in a.option_strings}
    tried = 0
    for action in options(parser):
        for option in action.option_strings:
            short = option[:-1]
            if not option.startswith("--") or len(short) < 4 or short in known:
                continue
            argv = [*path, *filler(parser), short, "1"]
            try:
                build_parser().parse_args(argv)
            except ConfigError as exc:
                if "invalid" in str(exc) and "unrecognized" not in str(exc):
                    pytest.skip(f"the filler values do not fit this command: {exc}")
                assert f"unrecognized arguments: {short}" in str(exc), (argv, str(exc))
                tried += 1
                continue
            pytest.fail(f"fourd-mpi {' '.join(argv)} was accepted ({short} taken for {option})")
    if any(o.startswith("--") for a in options(parser) for o in a.option_strings):
        assert tried


def test_run_step_is_refused_with_a_suggestion(capfd):
    assert main(["run", "--step", "3"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --step 3" in err
    assert "did you mean --steps" in err and "fourd-mpi run --help" in err


def test_counts_and_selections_are_told_apart():
    """``--ranks``/``--steps`` are counts everywhere, ``--select-ranks``/``--select-steps`` selections."""
    seen = set()
    for path, parser in PARSERS:
        for action in options(parser):
            if isinstance(action, DeprecatedAlias):
                continue
            for option in action.option_strings:
                if option in ("--ranks", "--steps"):
                    assert action.type is not int_list, f"{' '.join(path)} {option} is a list: use --select-"
                    seen.add(option)
                if option.startswith("--select-"):
                    assert action.type is int_list, f"{' '.join(path)} {option} must take a LIST"
                    seen.add(option)
    assert seen >= {"--ranks", "--steps", "--select-ranks", "--select-steps"}


def test_format_and_output_and_site_are_one_vocabulary():
    sites = set()
    for path, parser in PARSERS:
        for action in options(parser):
            if "--format" in action.option_strings:
                assert set(action.choices) <= set(FORMATS) | set(SPECIAL_FORMATS), \
                    f"{' '.join(path)} --format {action.choices}: use names of fourd_mpi.cli.args.FORMATS"
            if "-o" in action.option_strings:
                assert action.option_strings == ["-o", "--output"], path
            if "--site" in action.option_strings:
                sites.add(action.help.split("built-in ", 1)[-1].split(" (default")[0])
    from fourd_mpi.jobs.sites import builtin_sites

    # every --site lists the same sites: the built-in site profiles
    assert sites == {f"{', '.join(builtin_sites())}, or a site profile FILE.yaml"}, sites


def test_unsupported_format_is_refused_with_the_list(capfd):
    assert main(["bench", "collectives", "--format", "markdown"]) == 2
    err = capfd.readouterr().err
    assert "invalid choice: 'markdown'" in err and "'table', 'csv', 'json'" in err


def test_deprecated_aliases_still_work(capfd):
    parser = build_parser()
    args = parser.parse_args(["plot", "timeline", "t.h5", "-o", "t.png", "--step", "2", "--ranks", "0-3"])
    assert args.select_steps == [2] and args.select_ranks == [0, 1, 2, 3]
    err = capfd.readouterr().err
    assert "note: --step is deprecated, use --select-steps" in err
    assert "note: --ranks is deprecated, use --select-ranks" in err
    assert parser.parse_args(["plot", "scaling", "t.h5", "-o", "s.png", "--mode", "strong"]).scaling == "strong"
    assert "note: --mode is deprecated, use --scaling" in capfd.readouterr().err
    args = parser.parse_args(["export", "perfetto", "t.h5", "-o", "t.json", "--steps", "1,2", "--ranks", "4"])
    assert args.select_steps == [1, 2] and args.select_ranks == [4]
    assert "note: --steps is deprecated, use --select-steps" in capfd.readouterr().err
    new = parser.parse_args(["export", "perfetto", "t.h5", "-o", "t.json", "--select-steps", "3"])
    assert new.select_steps == [3] and new.select_ranks is None and capfd.readouterr().err == ""
    # every alias anywhere stores into an option its parser shows (an old spelling of a choice,
    # "--overlap ...,cache", names the option it is a value of and keeps its own dest for config files)
    for path, p in PARSERS:
        for action in options(p):
            if isinstance(action, DeprecatedAlias):
                shown = [a for a in options(p) if action.new.split()[0] in a.option_strings]
                assert shown and (shown[0].dest == action.dest or " " in action.new), (path, action.option_strings)


def test_output_writes_the_file_and_says_so_on_stderr(tmp_path):
    """``-o FILE``: the product goes to FILE only; stdout stays empty; one 'wrote FILE' line on stderr."""
    out = tmp_path / "runs.md"
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "analyze", REPO / "results" / "samples" / "weak-8.h5",
                           "--what", "runs", "--format", "markdown", "-o", out],
                          capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr.strip() == f"wrote {out} (markdown: 1 table(s))"
    assert out.read_text().startswith("## runs")


def test_grid_too_large_for_the_world_suggests_mpiexec():
    """Outside mpiexec the world is one rank: the error says how to launch the grid."""
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "run", "--gx", "2", "--gy", "2", "--steps", "2"],
                          capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "does not divide the world size 1" in proc.stderr and "run under mpiexec -n 4" in proc.stderr


def test_shell_completion_script_completes_the_new_spellings(tmp_path, capsys):
    pytest.importorskip("shtab", reason="the completion extra (shtab) is not installed")
    assert main(["completion", "bash"]) == 0
    script = tmp_path / "fourd-mpi.bash"
    script.write_text(capsys.readouterr().out)
    probe = (f"source {script}; COMP_WORDS=(fourd-mpi plot timeline --sel); COMP_CWORD=3; _shtab_fourd_mpi; "
             "echo \"${COMPREPLY[@]}\"; COMP_WORDS=(fourd-mpi compl); COMP_CWORD=1; _shtab_fourd_mpi; "
             "echo \"${COMPREPLY[@]}\"")
    proc = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60)
    first, second = proc.stdout.splitlines()
    assert set(first.split()) == {"--select-steps", "--select-ranks"}, proc.stdout + proc.stderr
    assert second.split() == ["completion"]
    for shell in ("zsh", "tcsh"):
        assert main(["completion", shell]) == 0 and "fourd-mpi" in capsys.readouterr().out


@pytest.mark.mpi
def test_help_and_notes_are_printed_once_under_mpiexec(run_mpi, tmp_path):
    """The command line is parsed before MPI starts: the launcher's rank variable picks rank 0."""
    proc = run_mpi(3, ["bench", "collectives", "--table", tmp_path / "r.txt", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage: fourd-mpi bench collectives") == 1
    assert proc.stderr.count("note: --table is deprecated, use --report") == 1


def test_one_site_list_for_sweeps_and_the_model(tmp_path, capfd):
    """``tune --site`` takes the sweep sites; a site names its machine profile or is refused with the list."""
    from fourd_mpi.jobs.sites import builtin_sites, machine_profile_of, sites_with_profiles

    assert set(sites_with_profiles()) == {"emulated", "emulated-slurm", "frontier", "local", "perlmutter"} \
        <= set(builtin_sites())
    assert machine_profile_of("local") == "laptop"
    with pytest.raises(ConfigError, match="no machine profile for site 'summit': sites with one are emulated, "
                                          "emulated-slurm, frontier, local, perlmutter; pass --profile"):
        machine_profile_of("summit")
    # a user site FILE.yaml names a profile file next to it
    (tmp_path / "prof.yaml").write_text((REPO / "fourd_mpi" / "perf" / "profiles" / "frontier.yaml").read_text())
    site = tmp_path / "mysite.yaml"
    site.write_text("name: mysite\nscheduler: slurm\nlauncher: srun\nranks_per_node: 8\n"
                    "machine_profile: prof.yaml\n")
    assert main(["tune", "--ranks", "4", "--model", "gpt-tiny", "--site", str(site), "--top", "1"]) == 0
    assert "frontier" in capfd.readouterr().out
    assert main(["tune", "--ranks", "4", "--model", "gpt-tiny", "--site", "lassen"]) == 2
    assert "sites with one are emulated, emulated-slurm, frontier, local, perlmutter" in capfd.readouterr().err
