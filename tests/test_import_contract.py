"""The floors of the repository hold (pyproject.toml [tool.importlinter]): harness -> the trainers ->
trainerkit; the trainers never import each other; trainerkit imports no trainer and not the harness; the
harness reaches a trainer only through its registry (harness.planning.trainers).  Each contract is shown to fail on a
planted import of the kind it forbids (a real edit of a copied tree, tests/planted.py)."""
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT
from planted import planted_tree

LINT = ("import sys; sys.path.insert(0, '.'); from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")


def _lint(tree):
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return subprocess.run([sys.executable, "-c", LINT], cwd=tree, capture_output=True, text=True, timeout=300)


def test_the_repository_keeps_its_floors(tmp_path):
    proc = _lint(planted_tree(tmp_path / "tree", {}))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2 kept, 0 broken" in proc.stdout, proc.stdout[-3000:]


PLANTED = {
    # the megatron adapter borrowing the reference trainer's internals (what #20 measured)
    "trainer imports its sibling": ("megatron_trainer/model.py", "from trainerkit import names\n",
                                    "from trainerkit import names\n"
                                    "from reference_impl.model.losses import LossOutput  # noqa\n", "floors"),
    # the shared contract reaching up into a trainer
    "trainerkit imports a trainer": ("trainerkit/data.py", "from . import text\n",
                                     "from . import text\nfrom reference_impl import faults  # noqa\n", "floors"),
    # a harness module other than the registry reaching into a trainer
    "harness bypasses the registry": ("harness/verify.py", "from trainerkit.data import text_sha256\n",
                                      "from trainerkit.data import text_sha256\n"
                                      "from reference_impl import faults  # noqa\n", "registry"),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_import_breaks_the_build(tmp_path, case):
    path, old, new, contract = PLANTED[case]
    proc = _lint(planted_tree(tmp_path / "tree", {path: [(old, new)]}))
    assert proc.returncode == 1, proc.stdout[-3000:]
    name = {"floors": "harness -> (reference_impl | megatron_trainer) -> trainerkit",
            "registry": "the harness reaches a trainer only through harness.planning.trainers"}[contract]
    importer = path[:-3].replace("/", ".")
    assert f"{name} BROKEN" in proc.stdout and f"{importer} -> reference_impl" in proc.stdout, proc.stdout[-3000:]
