"""One record per algorithm family (:mod:`fourd_mpi.algorithms.families`): every hook it names resolves,
every algorithm names a family, and listing the families imports neither the model nor MPI."""

import importlib
import subprocess
import sys

import pytest

from fourd_mpi.algorithms import families, registry
from fourd_mpi.algorithms.families import FAMILIES, MODEL_HOOKS, Family
from fourd_mpi.errors import ConfigError

PURE = ("checker", "shaper", "model_checker", "describer", "splitter", "grid_dims")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_hook_of_every_family_resolves(name):
    family = FAMILIES[name]
    assert family.name == name and family.covered()
    impl = importlib.import_module(family.impl)
    assert family.module() is impl
    assert callable(impl.build_state) and callable(impl.make_trainer)  # what run.build calls
    for which in PURE:
        assert getattr(family, which) is None or callable(getattr(family, which)), which
    for which in MODEL_HOOKS:
        if getattr(family, which) is not None:  # named: its module imports and the function exists
            assert callable(family.hook(which)), (name, which)
            assert family.required(which) is family.hook(which)
    assert family.hook("predict") is not None and family.hook("admission") is not None


def test_every_algorithm_names_a_registered_family():
    assert {registry.get(n).family for n in registry.names()} == set(FAMILIES)
    for n in registry.names():
        assert registry.get(n).spec is FAMILIES[registry.get(n).family]
    assert registry.get("megatron1d").spec is registry.get("axonn4d").spec


def test_a_missing_model_or_hook_is_none_or_one_line():
    ghost = Family("ghost", "nomodule", "fourd_mpi.perf.no_such_module", memory="memory")
    assert ghost.hook("predict") is None and ghost.hook("memory") is None and not ghost.covered()
    assert FAMILIES["optimus3d"].hook("lower_bound") is None  # not named: none
    with pytest.raises(ConfigError, match="family 'optimus3d' has no lower_bound hook"):
        FAMILIES["optimus3d"].required("lower_bound")
    with pytest.raises(ConfigError, match="unknown algorithm family 'nofamily'"):
        families.get("nofamily")
    with pytest.raises(ValueError, match="unknown model hook"):
        ghost.hook("build")


def test_listing_the_families_imports_no_model_and_no_mpi():
    code = ("import sys; from fourd_mpi.algorithms import registry; registry.get('pipeline').spec; "
            "print(sorted(m for m in sys.modules if m.startswith(('fourd_mpi.perf', 'fourd_mpi.run', 'mpi4py'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
