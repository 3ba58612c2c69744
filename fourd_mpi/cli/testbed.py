"""``fourd-mpi testbed up | down | status | mpiexec | env``: a cluster of emulated nodes on this machine
(:mod:`fourd_mpi.testbed`; docs/multinode.md). One process, no MPI; needs root.

``up`` and ``down`` are idempotent (``up`` of a bed that is up with the same settings does nothing,
``down`` of a bed that is not up does nothing); ``status`` exits 1 when the bed is not up or damaged.
``mpiexec`` runs a command's ranks on the bed's nodes through the launcher shim, with ``UCX_TLS=tcp,self``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import sys

from fourd_mpi.cli.args import add_format
from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json
from fourd_mpi.core.launcher import beside, flavor, resolve_program
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.values import axis_size, int_in

log = logging.getLogger(__name__)

NAME_HELP = "the bed's name: a lowercase letter then up to 9 lowercase letters or digits; it names the bed's " \
            "directory under $FOURD_TESTBED_STATE (default /run/fourd-testbed), prefixes the bed's namespaces, " \
            "bridge and links and chooses its subnet, so beds of different names never collide (default fourd)"


def _start_slurm_or_down(slurm, state: dict, name: str, cpus: int) -> bool:
    """:func:`fourd_mpi.testbed.slurm.start`; the bed is taken down again when it fails (its one-line error raised)."""
    from fourd_mpi.testbed import bed

    try:
        return slurm.start(state, cpus=cpus)
    except ConfigError:
        with contextlib.suppress(ConfigError):
            bed.down(name)
        raise


def register(sub) -> None:
    tb = sub.add_parser("testbed", help="a cluster of emulated nodes on this machine (network namespaces, shaped "
                        "links, optional Slurm): up, down, status, mpiexec, env (one process, root)")
    tsub = tb.add_subparsers(dest="testbed_command", required=True, parser_class=type(tb))

    up = tsub.add_parser("up", help="make the bed (nothing when it is up with the same settings)")
    _name(up)
    up.add_argument("--nodes", type=int_in(1, 1 << 10, "emulated nodes"), default=None,
                    help="number of nodes (default 2, or the number of --node-names)")
    up.add_argument("--node-names", metavar="LIST",
                    help="comma-separated node names (namespace, host name and Slurm node name; default NAME-n1, ...)")
    up.add_argument("--rate", default="200mbit", metavar="RATE",
                    help="each node's link rate in both directions, as tc writes it (200mbit, 1gbit, 25mbps), one or "
                         "one per node comma-separated; none = unshaped (default 200mbit)")
    up.add_argument("--burst", metavar="SIZE", help="tbf burst (bucket) per link, e.g. 64kb; one or one per node "
                                                    "(default 10 ms of the rate, at least 64kb)")
    up.add_argument("--slurm", action="store_true", help="also start a Slurm: slurmctld here, one slurmd per node")
    up.add_argument("--cpus", type=int_in(1, 1 << 12, "CPUs per node"), default=4,
                    help="--slurm: CPUs each node declares (default 4)")
    add_format(up, ("table", "json"))
    up.set_defaults(handler=cmd_testbed, serial=True)

    down = tsub.add_parser("down", help="remove the bed: its processes and daemons, namespaces, links and files "
                           "(nothing when it is not up)")
    _name(down)
    down.add_argument("--all", action="store_true", help="remove every bed of the state directory that holds a valid "
                                                         "state of this tool, only what each state records and marks "
                                                         "(the check for leftovers of a killed run)")
    add_json_format(down, DOWN_JSON, help="the report on standard output: table (default: a line per bed) or json")
    down.set_defaults(handler=cmd_testbed, serial=True)

    st = tsub.add_parser("status", help="the bed's nodes, addresses, links, Slurm and link byte counters; exit 1 "
                         "when it is not up or damaged")
    _name(st)
    add_format(st, ("table", "json"))
    st.set_defaults(handler=cmd_testbed, serial=True)

    mx = tsub.add_parser("mpiexec", help="run COMMAND's ranks on the bed's nodes: the mpiexec (MPICH's or Open "
                         "MPI's) with the bed's launcher shim and UCX_TLS=tcp,self, e.g. "
                         "fourd-mpi testbed mpiexec -n 4 -- fourd-mpi verify --grid 1x2x1x2")
    _name(mx)
    mx.add_argument("-n", "--ranks", type=axis_size, required=True, help="number of ranks")
    mx.add_argument("--ppn", type=axis_size, help="ranks per node, consecutive ranks on one node (default: the "
                                                     "ranks spread evenly over the bed's nodes)")
    mx.add_argument("--order", choices=("block", "cyclic"), default="block",
                    help="block: consecutive ranks on one node, as schedulers place them (default); cyclic: rank i "
                         "on node i mod nodes, so the innermost grid axis (X) crosses nodes")
    mx.add_argument("--mpiexec", metavar="PATH",
                    help="the mpiexec, MPICH's Hydra or Open MPI's (default: next to this Python, else on PATH)")
    mx.add_argument("--dry-run", action="store_true", help="print the command line instead of running it")
    mx.add_argument("program", nargs="+", metavar="COMMAND",
                    help="the program and its arguments (after --); fourd-mpi and python are this environment's "
                         "(the ones beside this Python), activated or not")
    mx.set_defaults(handler=cmd_testbed, serial=True)

    ev = tsub.add_parser("env", help="shell lines that point Slurm's commands at the bed (SLURM_CONF) and keep "
                         "UCX on TCP: eval \"$(fourd-mpi testbed env)\"")
    _name(ev)
    add_json_format(ev, ENV_JSON, ("shell", "json"), default="shell",
                    help="shell (default: export lines for eval) or json")
    ev.set_defaults(handler=cmd_testbed, serial=True)


#: ``testbed down --format json``
DOWN_JSON = JsonDoc("testbed down", {
    "beds": "per bed: name, removed (what was removed; empty: it was not up), left (what was not removed)",
    "problems": "state directories that are not valid, left alone"})
#: ``testbed env --format json``
ENV_JSON = JsonDoc("testbed env", {"name": "the bed", "environment": "variable -> value"})


def _name(parser) -> None:
    parser.add_argument("--name", default=None,  # resolved and checked in cmd_testbed (FOURD_TESTBED, then fourd)
                        help=NAME_HELP + "; the environment variable FOURD_TESTBED sets the default")


def _bed_name(args) -> str:
    """``--name``, else ``$FOURD_TESTBED``, else ``fourd``: checked by one rule (bed.NAME_RULE) for every
    subcommand, so no name can point outside the state directory."""
    from fourd_mpi.testbed import bed

    if args.name is not None:
        return bed.check_name(args.name, "--name")
    if "FOURD_TESTBED" in os.environ:
        return bed.check_name(os.environ["FOURD_TESTBED"], "FOURD_TESTBED")
    return bed.DEFAULT_NAME


def cmd_testbed(args, world=None) -> int:
    from fourd_mpi.testbed import bed

    command = args.testbed_command
    args.name = _bed_name(args)
    if command == "up":
        return _cmd_up(args)
    if command == "down":
        return _cmd_down(args)
    if command == "status":
        state = bed.status(args.name) if not bed.why_unavailable() else bed.load_state(args.name)
        if state is None:
            print(f"test bed {args.name} is not up")
            return 1
        _show(state, args.format)
        return 1 if state.get("missing") else 0
    if command == "env":
        from fourd_mpi.testbed import slurm

        state = bed.require_up(args.name)
        env = dict(bed.UCX_ENV, FOURD_TESTBED=args.name)
        if state.get("slurm"):
            env["SLURM_CONF"] = slurm.conf_path(state)
        if args.format == "json":
            emit_json(ENV_JSON, {"name": args.name, "environment": env})
        else:
            print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))
        return 0
    if command == "mpiexec":
        state = bed.require_up(args.name)
        mpiexec = args.mpiexec or default_mpiexec()
        # the program as sweep render writes it: fourd-mpi and python of this environment, activated or not
        argv = bed.mpiexec_argv(state, args.ranks, args.ppn, mpiexec, args.order, flavor(mpiexec)) + \
            resolve_program(args.program)
        env = {**os.environ, **bed.UCX_ENV}
        if args.dry_run:
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in bed.UCX_ENV.items()) + " " + shlex.join(argv))
            return 0
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            raise ConfigError(f"cannot run {argv[0]}: {exc.strerror}") from None
    raise ConfigError(f"unknown testbed command {command!r}")


def _cmd_up(args) -> int:
    """``testbed up``: bring the bed up (and Slurm on it with ``--slurm``; a daemon that ends during start-up gets
    one more try on a fresh bed), then show its status."""
    from fourd_mpi.testbed import bed, slurm

    nodes = args.nodes if args.nodes is not None else (None if args.node_names else 2)
    spec = bed.make_spec(args.name, nodes, args.node_names, args.rate, args.burst)
    if args.slurm:
        bed.require_machine()
        missing = slurm.missing_programs()
        if missing:
            raise ConfigError(f"--slurm: Slurm is not installed ({', '.join(missing)} missing): apt-get install "
                              f"slurmctld slurmd slurm-client")
    state, created = bed.up(spec)
    started = False
    if args.slurm:
        try:
            started = _start_slurm_or_down(slurm, state, spec.name, args.cpus)
        except slurm.DaemonEnded as exc:  # once more, on a fresh bed: a daemon's start-up can lose a race
            log.warning("test bed %s: %s; bringing it up once more", spec.name, exc)
            state, created = bed.up(spec)
            started = _start_slurm_or_down(slurm, state, spec.name, args.cpus)
    verb = "up" if created else "already up"
    log.info("test bed %s %s: %s%s", spec.name, verb, bed.describe(state),
             "; Slurm " + ("started" if started else "running") if args.slurm else "")
    return _show(bed.status(spec.name), args.format)


def _cmd_down(args) -> int:
    """``testbed down [--all]``: take the bed(s) down; what was not made by a bed is named, never removed."""
    from fourd_mpi.testbed import bed

    if args.all:
        beds, problems = bed.down_all()
    else:
        beds, problems = {args.name: bed.down(args.name)}, []
    left_any = []
    for name, (removed, left) in beds.items():
        if (removed or not left) and args.format != "json":
            print(f"test bed {name}: " + (f"removed {', '.join(removed)}" if removed else "was not up"))
        left_any += left
    if args.format == "json":
        emit_json(DOWN_JSON, {"beds": [{"name": name, "removed": list(removed), "left": list(left)}
                                       for name, (removed, left) in beds.items()], "problems": list(problems)})
    elif args.all and not beds:
        print("no test bed was up")
    if problems:  # directories with a state file that is not valid: nothing of theirs was touched
        raise ConfigError("; ".join(problems))
    if left_any:
        raise ConfigError(f"not removed, not made by this test bed (no {bed.MARKER_PREFIX}<its id> marker, or "
                          f"no state records it): check by hand: {', '.join(left_any)}")
    return 0


def default_mpiexec() -> str:
    """The mpiexec beside this Python (the environment's), else the one on PATH; none: a ConfigError."""
    found = beside("mpiexec") or shutil.which("mpiexec")
    if not found:
        raise ConfigError("no mpiexec next to this Python or on PATH: pip install 'fourd_mpi[mpich]', or give "
                          "--mpiexec")
    return found


def _show(state: dict, fmt: str) -> int:
    if fmt == "json":
        print(json.dumps(state, indent=1, sort_keys=True))
        return 0
    from fourd_mpi.testbed import bed

    print(f"test bed {state['name']}: {bed.describe(state)}; bridge address {state.get('bridge_addr')}")
    counters = state.get("counters", {})
    from fourd_mpi.util.table import render

    rows = []
    for node in bed.nodes_of(state):
        c = counters.get(node.name, {})
        rows.append([node.name, node.addr, node.veth, bed.rate_text(node.rate_bits), node.burst_bytes or "-",
                     c.get("sent", "-"), c.get("received", "-")])
    print(render(rows, ["node", "address", "link", "rate", "burst", "sent", "received"],
                 align=["left", "left", "left", "right", "right", "right", "right"]))
    if state.get("slurm"):
        print(f"slurm: SLURM_CONF={state['slurm']['conf']} (daemons "
              f"{', '.join(str(d['pid']) for d in state.get('daemons', []))})")
    print(f"launcher shim: {bed.shim_path(state['name'])}")
    if state.get("missing"):
        print(f"damaged: missing {', '.join(state['missing'])}")
    return 0
