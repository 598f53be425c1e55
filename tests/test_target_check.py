"""launcher/launch/target_check.py: a `_target_` read from its module's source, as Python would bind it, in the parent.

No false refusal of a name the module does define, a misspelt one named, a package that fails to import left to the
workers, and a package of one's own that another of its name shadows told to be renamed. The launches that meet
these checks are tests/test_own_job.py's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import REPO
from launcher.derived import ConfigError


@pytest.mark.parametrize("source, found", [
    (b"\xef\xbb\xbfclass Model:\n    pass\n", True),  # a BOM: Python reads it
    (b"import sys\nmatch sys.platform:\n    case _:\n        class Model:\n            pass\n", True),
    (b"def _setup():\n    global Model\n    Model = object\n_setup()\n", True),  # bound by a function
    (b"vars()['Model'] = object\n", True), (b"from os.path import join as Model\n", True),
    (b"class Modle:\n    pass\n", False),
], ids=["bom", "match", "global", "vars", "import as", "misspelt"])
def test_a_target_s_name_is_read_from_its_source_as_python_binds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  source: bytes, found: bool) -> None:
    """No false refusal of a name the module does define (a review found these); a misspelt one is named."""
    from launcher.launch.target_check import target_problem

    package = f"pkg_{abs(hash(source))}"  # (a package of its own: this process keeps the ones imported before)
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "mod.py").write_bytes(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    problem = target_problem(f"{package}.mod.Model")
    assert (problem is None) == found, problem
    if not found:
        assert problem == f"{tmp_path / package / 'mod.py'} defines no Model; did you mean Modle?"


def test_a_package_that_needs_what_is_not_installed_is_left_to_the_workers(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing the package fails (its __init__ imports a missing dependency): not 'no module named pkg.mod', and
    no traceback in the parent; the workers' import says what is missing."""
    from launcher.launch.target_check import target_problem

    (tmp_path / "needy").mkdir()
    (tmp_path / "needy" / "__init__.py").write_text("import a_package_not_installed_here\n\n\nclass Model:\n    pass\n")
    (tmp_path / "needy" / "mod.py").write_text("class Model:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert target_problem("needy.mod.Model") is None and target_problem("needy.Model") is None


def test_a_slurm_job_whose_setup_lines_may_give_its_nodes_a_path_is_not_checked_here() -> None:
    from conftest import compose_config
    from launcher.launch.target_check import check_targets

    nowhere = ("+exp=toy", "data._target_=a_job_on_the_nodes_path.Task")
    with pytest.raises(ConfigError, match="no module named 'a_job_on_the_nodes_path'"):
        check_targets(compose_config(*nowhere, "launcher=slurm"))
    check_targets(compose_config(*nowhere, "launcher=slurm", "launcher.setup=[source /shared/venv/bin/activate]"))


def test_a_package_of_one_s_own_named_like_the_launcher_s_jobs_is_told_to_be_renamed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's `jobs/` on PYTHONPATH comes after the launcher's own `jobs` package (installed, or the current dir):
    'no module named jobs.mine' alone reads as a typo; the line names the package that has it."""
    from launcher.launch.target_check import target_problem

    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "__init__.py").write_text("")
    (tmp_path / "jobs" / "mine.py").write_text("class Task:\n    pass\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    problem = target_problem("jobs.mine.Task")
    assert problem == (f"no module named jobs.mine (jobs is {REPO / 'jobs'}/); {tmp_path / 'jobs'}/ has it, but comes "
                       f"later on the path: rename that package"), problem
    elsewhere = target_problem("jobs.nothing_anywhere.Task")
    assert elsewhere == f"no module named jobs.nothing_anywhere (jobs is {REPO / 'jobs'}/)", elsewhere
