"""Fuzz the trace reader, the sweep-spec loader and the config loader with hypothesis
(run by tests/trace/test_reader_fuzz.py in a subprocess under a timeout and an address-space limit).

    python tests/helpers/fuzz_readers.py TARGET EXAMPLES WORKDIR

TARGET: ``trace`` (real traces from results/samples mutated: attributes, dtypes, shapes, values,
truncations), ``spec`` (generated YAML: sweep specs and site profiles, aliases included) or
``config`` (generated TOML/YAML/JSON ``--config`` files). Every case must end in success or in
one of the project's error types (:class:`ConfigError` and its subclass :class:`TraceError`);
anything else is printed with its traceback and the exit status is 1. The last line is JSON:
``{"target", "files", "accepted", "refused", "tracebacks"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import sys
import traceback

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from fourd_mpi.errors import ConfigError  # noqa: E402

COUNTS = {"files": 0, "accepted": 0, "refused": 0, "tracebacks": 0}
FAILURES = []


def attempt(case: str, fn) -> None:
    COUNTS["files"] += 1
    try:
        fn()
        COUNTS["accepted"] += 1
    except ConfigError:
        COUNTS["refused"] += 1
    except Exception:  # noqa: BLE001 - the point: nothing else may escape
        COUNTS["tracebacks"] += 1
        if len(FAILURES) < 5:
            FAILURES.append(f"--- {case}\n{traceback.format_exc()}")


# ---------------------------------------------------------------------------
# traces
# ---------------------------------------------------------------------------

JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                    max_size=4), max_leaves=12)
ATTR_VALUE = st.one_of(
    st.integers(-2**63, 2**63 - 1), st.floats(), st.text(max_size=40), st.binary(max_size=20),
    JSONISH.map(lambda v: json.dumps(v)),
    st.integers(1, 200_000).map(lambda n: "[" * n + "]" * n),              # deep JSON
    st.integers(1, 4).map(lambda k: "x" * (k * 6_000_000)),                # huge string
    st.just(np.arange(5)),
)
ROOT_ATTRS = ("events", "world_size", "schema_version", "status", "schema")
META_ATTRS = ("world_size", "json_keys", "summary", "level", "run_options", "grid", "warmup_steps", "config",
              "layers", "mpi", "tokens_per_step", "model_flops_per_step")
VOCAB_ATTRS = ("ops", "phases", "axes", "layers", "levels")
DATASETS = ("events", "rank_steps", "steps", "ranks")
DTYPES = ("<f8", "<f4", "i1", "<u8", "S8", ">i8", "<i4", "?", "<u2")


def _rewrite(f, name, data):
    del f[name]
    f.create_dataset(name, data=data)


def mutate(path: str, kind: str, draw) -> None:
    import h5py

    if kind == "truncate-file":
        size = os.path.getsize(path)
        with open(path, "r+b") as fh:
            fh.truncate(draw(st.integers(0, size - 1)))
        return
    with h5py.File(path, "r+") as f:
        if kind == "root-attr":
            f.attrs[draw(st.sampled_from(ROOT_ATTRS))] = draw(ATTR_VALUE)
        elif kind == "meta-attr":
            f["metadata"].attrs[draw(st.sampled_from(META_ATTRS))] = draw(ATTR_VALUE)
        elif kind == "vocab-attr":
            f["vocab"].attrs[draw(st.sampled_from(VOCAB_ATTRS))] = draw(ATTR_VALUE)
        elif kind == "dtype":
            name = draw(st.sampled_from(DATASETS))
            data = f[name][()]
            column = draw(st.sampled_from(data.dtype.names))
            new_dtype = np.dtype([(n, draw(st.sampled_from(DTYPES)) if n == column else data.dtype[n])
                                  for n in data.dtype.names])
            out = np.zeros(len(data), dtype=new_dtype)
            for n in data.dtype.names:
                try:
                    out[n] = data[n]
                except (ValueError, TypeError):
                    pass
            _rewrite(f, name, out)
        elif kind == "values":
            name = draw(st.sampled_from(DATASETS))
            data = f[name][()]
            if len(data):
                column = draw(st.sampled_from(data.dtype.names))
                rows = draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=5))
                info = data.dtype[column]
                if info.kind == "f":
                    value = draw(st.sampled_from([np.nan, np.inf, -1.0, 1e300, 0.0]))
                elif info.kind in "iu":
                    lo, hi = np.iinfo(info).min, np.iinfo(info).max
                    value = draw(st.one_of(st.integers(int(lo), int(hi)), st.sampled_from([int(lo), int(hi), 0])))
                else:
                    value = draw(st.binary(max_size=8))
                data[column][rows] = value
                f[name][...] = data
        elif kind == "shape":
            name = draw(st.sampled_from(DATASETS))
            how = draw(st.sampled_from(["2d", "scalar", "group", "delete", "resize-up", "resize-down",
                                        "truncate-fixed"]))
            data = f[name][()]
            if how == "2d":
                _rewrite(f, name, np.stack([data, data]))
            elif how == "scalar":
                del f[name]
                f.create_dataset(name, data=data[0] if len(data) else np.zeros((), data.dtype))
            elif how == "group":
                del f[name]
                f.create_group(name)
            elif how == "delete":
                del f[name]
            elif how in ("resize-up", "resize-down", "truncate-fixed") and f[name].maxshape[0] is None:
                n = len(data)
                new = draw(st.integers(n + 1, n + 10**10)) if how == "resize-up" else draw(st.integers(0, n))
                f[name].resize((new,))
                if how == "truncate-fixed" and name == "events":  # a header "fixed" to match the truncation
                    f.attrs["events"] = new
                    ranks = f["ranks"][()]
                    end = np.minimum(ranks["event_offset"] + ranks["event_count"], new)
                    ranks["event_count"] = np.maximum(end - ranks["event_offset"], 0)
                    f["ranks"][...] = ranks
            else:  # fixed-size datasets: rewrite shorter
                _rewrite(f, name, data[: draw(st.integers(0, len(data)))])
        elif kind == "delete-group":
            del f[draw(st.sampled_from(["metadata", "vocab"]))]


KINDS = ("root-attr", "meta-attr", "vocab-attr", "dtype", "values", "shape", "truncate-file", "delete-group")


def fuzz_traces(examples: int, workdir: str) -> None:
    from fourd_mpi.analysis.tables import breakdown, comm_table, runs_table
    from fourd_mpi.cli.traces import cmd_trace
    from fourd_mpi.trace.invariants import check_invariants
    from fourd_mpi.trace.read import load_trace

    bases = [os.path.join(REPO, "results", "samples", name) for name in ("weak-1.h5", "weak-2.h5")]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(base=st.sampled_from(bases), kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
           data=st.data(), allow=st.booleans())
    def case(base, kinds, data, allow):
        path = os.path.join(workdir, "t.h5")
        shutil.copy(base, path)
        try:
            for kind in kinds:
                mutate(path, kind, data.draw)
        except (OSError, KeyError, ValueError, TypeError):
            pass  # h5py refused this mutation: the file is whatever it became

        def read():
            with contextlib.redirect_stdout(io.StringIO()):  # the commands, as the CLI runs them
                cmd_trace(argparse.Namespace(trace_command="show", file=path, allow_damaged=allow, format="text"))
                cmd_trace(argparse.Namespace(trace_command="check", file=path, format="text"))
            trace = load_trace(path, allow_damaged=allow)
            check_invariants(trace)
            runs_table([trace])
            breakdown(trace)
            comm_table(trace)

        attempt(f"{os.path.basename(base)} {kinds}", read)

    case()


# ---------------------------------------------------------------------------
# YAML specs and site profiles, config files
# ---------------------------------------------------------------------------

SPEC_KEYS = ("name", "description", "study", "ranks", "grids", "model", "weak", "options", "matrix", "job", "preset",
             "batch", "overlap", "steps", "warmup", "time", "repeats", "zip", "results_dir", "scheduler", "launcher")
SCALAR = st.one_of(st.integers(-5, 2**40), st.floats(allow_nan=True), st.booleans(), st.none(),
                   st.sampled_from(["gpt-tiny", "1x1x1x2", "none", "all", "weak", "op", "00:10:00", "*a", "&a x"]),
                   st.text(max_size=10))
TREE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.one_of(st.sampled_from(SPEC_KEYS), st.integers(1, 8)), inner, max_size=5),
                    max_leaves=20)


def _bomb(depth: int, width: int) -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


SPEC_FILE = os.path.join(REPO, "jobscripts", "weak-gpt-tiny.yaml")


@st.composite
def mutated_spec(draw):
    """The example spec with one value (at any depth) replaced by a generated one."""
    import yaml

    with open(SPEC_FILE) as fh:
        data = yaml.safe_load(fh)
    node = data
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = draw(st.sampled_from(keys))
        if isinstance(node[key], (dict, list)) and node[key] and draw(st.booleans()):
            node = node[key]
            continue
        if draw(st.integers(0, 4)) == 0 and isinstance(node, dict):
            del node[key]
        else:
            node[key] = draw(TREE)
        break
    return yaml.safe_dump(data)


YAML_TEXT = st.one_of(
    mutated_spec(), mutated_spec(), st.just(open(SPEC_FILE).read()),
    TREE.map(lambda t: __import__("yaml").safe_dump(t)),
    st.builds(_bomb, st.integers(1, 12), st.integers(1, 10)),
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 3000).map(lambda n: "".join("  " * i + f"k{i}:\n" for i in range(n)) + "  " * n + "v\n"),
    st.just("a: &a [*a]\n"), st.just("? [a, b]\n: 1\n"), st.just("a: !!python/object:os.system x\n"),
    st.text(alphabet="[]{}:,-&*!|>'\"# \nabc1", max_size=200),
    st.integers(1, 3).map(lambda k: "name: x\n" + "# pad\n" * (k * 200_000)),
)


def fuzz_specs(examples: int, workdir: str) -> None:
    from fourd_mpi.jobs.sites import load_site
    from fourd_mpi.jobs.spec import load_spec

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(text=YAML_TEXT, site=st.booleans())
    def case(text, site):
        path = os.path.join(workdir, "spec.yaml")
        with open(path, "w") as fh:
            fh.write(text)

        def read():
            if site:
                load_site(path)
            else:
                load_spec(path).expand()

        attempt("site" if site else "spec", read)

    case()


OPTION_NAMES = ("steps", "warmup", "gx", "gy", "gz", "gdata", "model", "lr", "overlap", "trace-level", "trace_level",
                "prefetch-depth", "seed", "label", "results-dir", "check-buffers", "nope")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if v == v and abs(v) != float("inf") else "nan"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


CONFIG_TREE = st.dictionaries(st.sampled_from(OPTION_NAMES), st.one_of(
    SCALAR, st.lists(SCALAR, max_size=3), st.dictionaries(st.sampled_from(OPTION_NAMES), SCALAR, max_size=3)),
    max_size=6)


@st.composite
def config_text(draw):
    fmt = draw(st.sampled_from(["toml", "yaml", "json", "yml"]))
    how = draw(st.sampled_from(["tree", "tree", "text", "deep", "big"]))
    if how == "tree":
        tree = draw(CONFIG_TREE)
        if fmt == "json":
            return fmt, json.dumps(tree)
        if fmt in ("yaml", "yml"):
            import yaml

            return fmt, yaml.safe_dump(tree)
        lines, tables = [], []
        for k, v in tree.items():
            if isinstance(v, dict):
                tables.append(f"[{k}]\n" + "".join(f"{kk} = {_toml_value(vv)}\n"
                                                    for kk, vv in v.items() if vv is not None))
            elif v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
        return fmt, "\n".join(lines) + "\n" + "".join(tables)
    if how == "deep":
        n = draw(st.integers(1, 5000))
        return fmt, ("a = " if fmt == "toml" else "") + "[" * n + "]" * n
    if how == "big":
        return fmt, "#" * draw(st.integers(1 << 20, 3 << 20)) + "\n"
    return fmt, draw(st.text(alphabet="[]{}=:,.\"'#\n abc123-_", max_size=200))


def fuzz_configs(examples: int, workdir: str) -> None:
    from fourd_mpi.cli.main import build_parser
    from fourd_mpi.run.configfile import config_tokens, load_config_file

    parser = build_parser()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(item=config_text())
    def case(item):
        fmt, text = item
        path = os.path.join(workdir, f"c.{fmt}")
        with open(path, "w") as fh:
            fh.write(text)

        def read():
            parser.parse_args(["run", *config_tokens(load_config_file(path), path)])

        attempt(fmt, read)

    case()


def main() -> int:
    target, examples, workdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    limit = int(os.environ.get("FUZZ_MEMORY_LIMIT", 3 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # bounded memory: a runaway allocation fails here
    {"trace": fuzz_traces, "spec": fuzz_specs, "config": fuzz_configs}[target](examples, workdir)
    for failure in FAILURES:
        print(failure)
    print(json.dumps(dict(target=target, **COUNTS)))
    return 1 if COUNTS["tracebacks"] else 0


if __name__ == "__main__":
    sys.exit(main())
