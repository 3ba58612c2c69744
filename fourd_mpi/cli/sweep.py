"""``fourd-mpi sweep plan | render | submit | status | collect``: scaling sweeps (one process, no MPI)."""

from __future__ import annotations

import json
import sys

from fourd_mpi.cli.args import FORMATS, add_format, add_site
from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json
from fourd_mpi.jobs.pack import PACK_MODES
from fourd_mpi.jobs.sites import load_site, retired_note
from fourd_mpi.jobs.spec import load_spec
from fourd_mpi.jobs.sweep import (
    JOB_OVERRIDES,
    MANIFEST,
    build_manifest,
    collect,
    default_script_dir,
    load_jobs,
    load_manifest,
    next_steps,
    plan_rows,
    public_manifest,
    run_states,
    submit,
    write_sweep,
)
from fourd_mpi.util.text import format_rows
from fourd_mpi.util.values import axis_size, repeat_count
from fourd_mpi.util.values import text as nonempty_text


def register(sub) -> None:
    """``fourd-mpi sweep ...`` subcommands."""
    sw = sub.add_parser("sweep", help="scaling sweeps: plan, render job scripts, submit, status, collect")
    ssub = sw.add_subparsers(dest="sweep_command", required=True, parser_class=type(sw))

    def site_arg(p):
        add_site(p, default="local", help="the cluster the job scripts are for")
        p.add_argument("--python", metavar="PATH", help="interpreter the jobs run (default: job.python of the "
                                                        "spec, else the site's, else python3)")
        p.add_argument("--results-dir", metavar="DIR",
                       help="where the jobs write traces (default: results_dir of the spec, else results/SWEEP, "
                            "with the site's name below it: results/SWEEP/SITE)")
        p.add_argument("--ranks-per-node", type=axis_size, metavar="N",
                       help="ranks per node (default: job.ranks_per_node of the spec, else the site's)")
        for key in JOB_OVERRIDES:
            p.add_argument(f"--{key}", metavar=key.upper(), help=f"job.{key} for every job (overrides the spec)")
        p.add_argument("--pack", type=repeat_count, metavar="N",
                       help="put up to N runs in one job (default: job.pack of the spec, else the site's, "
                            "else 1: one job per run)")
        p.add_argument("--pack-mode", choices=PACK_MODES,
                       help="how a pack runs its runs: one after another (sequential, any scheduler), side by "
                            "side as srun steps (concurrent) or as a Slurm job array (array); default "
                            "job.pack_mode of the spec, else the site's, else sequential")

    plan = ssub.add_parser("plan", help="list the runs a spec expands to (rank count, nodes, memory per rank)")
    plan.add_argument("spec", metavar="SPEC.yaml", help="the sweep spec (YAML)")
    site_arg(plan)
    add_format(plan, FORMATS, help="table (default), csv or markdown (a row per run), json (the whole manifest)")

    render = ssub.add_parser("render", help="write one job script per run and a manifest under results/SWEEP/SITE/jobs")
    render.add_argument("spec", metavar="SPEC.yaml", help="the sweep spec (YAML)")
    site_arg(render)
    render.add_argument("--out", type=nonempty_text, metavar="DIR",
                        help="directory of the scripts (default: jobs/ in the sweep's results directory, "
                             "results/SWEEP/SITE/jobs)")
    render.add_argument("--force", action="store_true", help="render again over an existing directory")
    add_json_format(render, RENDER_JSON, help="the report on standard output: table (default: one line) or json")

    for name, text in (("submit", "submit the rendered jobs (sbatch, qsub, bsub; local: run them now); exit 1 "
                                  "when a submission (or a local job) failed"),
                       ("status", "each run's scheduler state and trace; exit 1 when a job failed"),
                       ("collect", "check the traces and print the runs and scaling tables")):
        p = ssub.add_parser(name, help=text)
        p.add_argument("sweep_dir", metavar="DIR", help="the rendered sweep, e.g. results/SWEEP/SITE/jobs")
        if name == "submit":
            p.add_argument("--resubmit-failed", action="store_true",
                           help="submit again runs whose job failed, was cancelled or timed out")
            p.add_argument("--dry-run", action="store_true", help="say what would be submitted")
            p.add_argument("--pack", type=repeat_count, metavar="N",
                           help="pack the runs to submit now into jobs of up to N runs (pack-TIME-K.sh in DIR), "
                                "whatever the render packed; e.g. to retry failed runs as few jobs")
            p.add_argument("--pack-mode", choices=PACK_MODES, default="sequential",
                           help="with --pack: sequential (default), concurrent or array, as for render")
            add_json_format(p, SUBMIT_JSON, help="the report on standard output: table (default: one line) or json")
        if name == "status":
            add_format(p, FORMATS, help="a row per run: table (default), csv, json or markdown (the count of "
                                        "complete traces and failed jobs then goes to standard error)")
        if name == "collect":
            p.add_argument("--into", metavar="DIR", help="gather the traces here (default: analyse them where the "
                                                         "jobs wrote them, the sweep's results directory; traces "
                                                         "already in DIR are not copied)")
            add_format(p, FORMATS, help="the runs and scaling tables: table (default), csv, json or markdown")
    sw.set_defaults(handler=cmd_sweep, serial=True)


#: ``sweep render --format json``
RENDER_JSON = JsonDoc("sweep render", {
    "sweep": "its name", "directory": "where the scripts are", "files": "the files written",
    "manifest": "the manifest's file name", "runs": "how many runs", "submit": "the command that submits them"})
#: ``sweep submit --format json``
SUBMIT_JSON = JsonDoc("sweep submit", {
    "sweep": "its name", "submitted": "how many jobs were submitted (or would be, --dry-run)",
    "failed": "submissions that failed: run_id, why", "dry_run": "nothing was submitted"})


def cmd_sweep(args, world=None) -> int:
    command = args.sweep_command
    if command in ("plan", "render"):
        spec = load_spec(args.spec)
        site = load_site(args.site)
        if retired_note(site):
            sys.stderr.write(f"fourd-mpi: {retired_note(site)}\n")
        if args.ranks_per_node is not None:
            spec.job["ranks_per_node"] = args.ranks_per_node
        for key in JOB_OVERRIDES:
            if getattr(args, key) is not None:
                spec.job[key] = getattr(args, key)
        for key in ("pack", "pack_mode"):
            if getattr(args, key) is not None:
                spec.job[key] = getattr(args, key)
        if any(getattr(args, key) is not None for key in (*JOB_OVERRIDES, "pack", "pack_mode")):
            spec.revalidate_job()
        # default: next to the sweep's traces, results/SWEEP/SITE/jobs (git-ignored in a checkout, never the
        # source tree)
        script_dir = getattr(args, "out", None) or default_script_dir(spec, site, args.results_dir)
        manifest = build_manifest(spec, site, args.spec, script_dir, args.python, args.results_dir)
        if command == "plan":
            if args.format == "json":
                sys.stdout.write(json.dumps(public_manifest(manifest), indent=1) + "\n")
            elif args.format in ("csv", "markdown"):
                sys.stdout.write(format_rows(plan_rows(manifest), args.format))
            else:
                packs = manifest.get("packs")
                packed = f" in {len(packs)} {packs[0]['mode']} packs" if packs else ""
                sys.stdout.write(f"sweep {spec.name}: {spec.study} scaling, {len(manifest['runs'])} runs{packed} "
                                 f"on site {site.name} ({site.scheduler})\n")
                sys.stdout.write(format_rows(plan_rows(manifest)))
            return 0
        written = write_sweep(manifest, spec, site, script_dir, args.force)
        if args.format == "json":
            emit_json(RENDER_JSON, {"sweep": spec.name, "directory": script_dir, "files": list(written),
                                    "manifest": MANIFEST, "runs": len(manifest["runs"]),
                                    "submit": f"fourd-mpi sweep submit {script_dir}"})
            return 0
        sys.stdout.write(f"wrote {len(written)} files and {MANIFEST} to {script_dir}/ "
                         f"(submit with: fourd-mpi sweep submit {script_dir})\n")
        return 0
    manifest = load_manifest(args.sweep_dir)
    if command == "submit":
        result = submit(manifest, args.sweep_dir, args.resubmit_failed, args.dry_run, pack=args.pack,
                        pack_mode=args.pack_mode, out=sys.stderr if args.format == "json" else sys.stdout)
        failed = f", {len(result.failed)} failed" if result.failed else ""
        if args.format == "json":
            emit_json(SUBMIT_JSON, {"sweep": manifest["sweep"], "submitted": result.submitted,
                                    "failed": [{"run_id": run_id, "why": why} for run_id, why in result.failed],
                                    "dry_run": args.dry_run})
        else:
            sys.stdout.write(f"{result.submitted} submitted{failed}\n")
        for run_id, why in result.failed:
            sys.stderr.write(f"fourd-mpi: error: sweep {manifest['sweep']}: {run_id} failed: {why}\n")
        return 1 if result.failed else 0
    if command == "status":
        rows = run_states(manifest, load_jobs(args.sweep_dir))
        sys.stdout.write(format_rows(rows, args.format))
        done = sum(r["trace"] == "complete" for r in rows)
        todo = next_steps(manifest, rows, args.sweep_dir)  # no complete trace, no live job: one line each
        recoverable = sum(r["trace"] == "recoverable" for r in rows)
        said = sys.stdout if args.format == "table" else sys.stderr
        for line in todo:
            said.write(f"{line}\n")
        said.write(f"{done}/{len(rows)} traces complete, {len(todo)} jobs failed"
                   + (f" ({recoverable} recoverable with 'fourd-mpi trace recover')" if recoverable else "") + "\n")
        return 1 if todo else 0
    return collect(manifest, args.into, fmt=args.format)
