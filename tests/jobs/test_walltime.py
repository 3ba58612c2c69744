"""Time limits: Slurm's ``--time`` forms in, each scheduler's documented format out (table-driven).

Sources of the formats (checked against the schedulers' manuals):
- Slurm sbatch(1) ``--time``: "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
  "days-hours:minutes", "days-hours:minutes:seconds"; seconds are rounded up to the next minute;
  no field is bounded (``time_str2secs`` adds them up).
- PBS Pro ``walltime``: a duration ``[[hours:]minutes:]seconds`` (hours unbounded).
- LSF ``bsub -W [hour:]minute``: whole minutes ("the minutes can be specified as a number greater than 59").
- Grid Engine ``h_rt``: sge_types(1) time_specifier, seconds or ``hours:minutes:seconds``.

The last test asks a real Slurm (tests/helpers/localslurm.py) what it makes of each form.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.schedulers import (
    JobRequest,
    get_scheduler,
    lsf_run_limit,
    parse_time,
    pbs_walltime,
    sge_time,
    slurm_time,
)
from fourd_mpi.jobs.spec import TIME_PATTERN

IN_CI = os.environ.get("CI", "").lower() == "true"
D, H, M = 86400, 3600, 60

# (Slurm --time value, seconds it means)
SLURM_FORMS = [
    (30, 30 * M),                       # minutes (int, as YAML gives it)
    ("30", 30 * M),                     # minutes
    ("90", 90 * M),                     # minutes above 59
    ("0:30", 30),                       # minutes:seconds
    ("10:00", 10 * M),
    ("90:30", 90 * M + 30),             # minutes above 59 in M:S
    ("00:30:00", 30 * M),               # hours:minutes:seconds
    ("1:30:00", H + 30 * M),
    ("36:30:00", 36 * H + 30 * M),      # hours above 23
    ("1:90:00", 2 * H + 30 * M),        # fields are added up, as Slurm does
    ("1-12", D + 12 * H),               # days-hours (was rejected)
    ("2-0", 2 * D),                     # days-hours (was rejected)
    ("0-36", 36 * H),
    ("1-12:30", D + 12 * H + 30 * M),   # days-hours:minutes (was read as 24:12:30)
    ("1-12:30:15", D + 12 * H + 30 * M + 15),
    ("1-00:00:01", D + 1),
    ("7-00:00:00", 7 * D),
    (" 45 ", 45 * M),                   # surrounding blanks, as YAML may keep them
]

# values refused with a one-line error naming the accepted forms
BAD_FORMS = ["", "abc", "1h", "1.5", "1:2:3:4", "1-2-3", "1-", "-5", ":30", "1-:30", "1-12:", "1:-2",
             "1 - 12", True, 1.5, None]
NO_LIMIT = [0, "0", "0:0", "0-0", "0:00:00", "-1", "INFINITE", "unlimited"]


@pytest.mark.parametrize("value,seconds", SLURM_FORMS)
def test_slurm_forms_mean_what_sbatch_documents(value, seconds):
    assert parse_time(value) == seconds
    if isinstance(value, str):  # the spec and site schemas accept every form parse_time accepts
        assert re.search(TIME_PATTERN, value.strip())


@pytest.mark.parametrize("value", BAD_FORMS)
def test_malformed_limits_are_refused(value):
    with pytest.raises(ConfigError, match="use minutes, minutes:seconds, hours:minutes:seconds, days-hours"):
        parse_time(value)
    if isinstance(value, str):
        assert not re.search(TIME_PATTERN, value)


@pytest.mark.parametrize("value", NO_LIMIT)
def test_no_limit_is_refused(value):
    with pytest.raises(ConfigError, match="zero|no limit"):
        parse_time(value)


# (seconds, Slurm --time, PBS walltime, LSF -W, SGE h_rt)
DIRECTIVES = [
    (30, "00:00:30", "00:00:30", "00:01", "00:00:30"),
    (10 * M, "00:10:00", "00:10:00", "00:10", "00:10:00"),
    (H - 1, "00:59:59", "00:59:59", "01:00", "00:59:59"),
    (H, "01:00:00", "01:00:00", "01:00", "01:00:00"),
    (D - 1, "23:59:59", "23:59:59", "24:00", "23:59:59"),
    (D, "1-00:00:00", "24:00:00", "24:00", "24:00:00"),
    (D + 12 * H + 30 * M, "1-12:30:00", "36:30:00", "36:30", "36:30:00"),
    (D + 12 * H + 30 * M + 15, "1-12:30:15", "36:30:15", "36:31", "36:30:15"),
    (100 * H, "4-04:00:00", "100:00:00", "100:00", "100:00:00"),
]


def _pbs_duration(text):
    """PBS Pro duration [[hours:]minutes:]seconds -> seconds."""
    assert re.fullmatch(r"(\d+:){0,2}\d+", text), text
    value = 0
    for part in text.split(":"):
        value = value * 60 + int(part)
    return value


def _lsf_minutes(text):
    """LSF [hour:]minute -> minutes."""
    match = re.fullmatch(r"(?:(\d+):)?(\d+)", text)
    assert match, text
    return int(match.group(1) or 0) * 60 + int(match.group(2))


def _sge_time(text):
    """sge_types(1) time_specifier hours:minutes:seconds (an empty field is zero) -> seconds."""
    match = re.fullmatch(r"(\d*):(\d*):(\d*)", text)
    assert match, text
    h, m, s = (int(g or 0) for g in match.groups())
    return (h * 60 + m) * 60 + s


@pytest.mark.parametrize("seconds,slurm,pbs,lsf,sge", DIRECTIVES)
def test_each_scheduler_gets_its_documented_format(seconds, slurm, pbs, lsf, sge):
    assert (slurm_time(seconds), pbs_walltime(seconds), lsf_run_limit(seconds), sge_time(seconds)) == \
        (slurm, pbs, lsf, sge)
    assert parse_time(slurm) == seconds  # what we write reads back as the same limit
    assert _pbs_duration(pbs) == seconds and _sge_time(sge) == seconds
    assert 0 <= _lsf_minutes(lsf) * 60 - seconds < 60  # whole minutes, never shorter than asked


@pytest.mark.parametrize("value,seconds", [("1-12:30", D + 12 * H + 30 * M), ("2-0", 2 * D), ("90", 90 * M)])
def test_directives_written_for_every_scheduler(value, seconds):
    job = JobRequest(name="j", ranks=4, nodes=1, ranks_per_node=4, time_seconds=parse_time(value), log="j.log")
    lines = {name: "\n".join(get_scheduler(name).directives(job)) for name in ("slurm", "pbs", "lsf", "sge")}
    assert f"#SBATCH --time={slurm_time(seconds)}" in lines["slurm"].splitlines()
    assert f"#PBS -l walltime={pbs_walltime(seconds)}" in lines["pbs"].splitlines()
    assert f"#BSUB -W {lsf_run_limit(seconds)}" in lines["lsf"].splitlines()
    assert f"#$ -l h_rt={sge_time(seconds)}" in lines["sge"].splitlines()


def test_real_slurm_reads_each_form_as_we_do(tmp_path):
    """Submit a held job per form to a real local Slurm; its TimeLimit (whole minutes, rounded up)
    must equal our seconds rounded up to a minute; then cancel them."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from localslurm import LocalSlurm, missing_programs

    why = ("the local Slurm runs its daemons as root" if os.geteuid() != 0 else
           (f"Slurm is not installed ({', '.join(missing_programs())} missing)" if missing_programs() else ""))
    if why:
        if IN_CI:
            pytest.fail(f"CI=true but no Slurm: {why}")
        pytest.skip(why)
    cluster = LocalSlurm(tmp_path / "slurm", cpus=2)
    cluster.start()
    try:
        ids = {}
        for value, _ in SLURM_FORMS:
            text = str(value).strip()
            done = subprocess.run(["sbatch", "--parsable", "-H", f"--time={text}", "-o", "/dev/null",
                                   "--wrap", "true"], env=cluster.env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, (text, done.stderr)
            ids[text] = done.stdout.strip().split(";")[0]
        for value, seconds in SLURM_FORMS:
            text = str(value).strip()
            show = subprocess.run(["scontrol", "show", "job", "-o", ids[text]], env=cluster.env,
                                  capture_output=True, text=True, timeout=60).stdout
            limit = re.search(r"\bTimeLimit=(\S+)", show).group(1)
            assert parse_time(limit) == -(-seconds // 60) * 60, (text, limit)
        subprocess.run(["scancel", *ids.values()], env=cluster.env, timeout=60)
    finally:
        cluster.stop()
