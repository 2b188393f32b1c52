"""pyproject.toml against the source tree: what ``pip install .`` puts in the wheel."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed():
    """Each folder of hvd_topk/ holding an ``__init__.py`` is in ``[tool.setuptools] packages``:
    a folder left out is missing from a non-editable install (``pip install .``, the Docker
    image) while an editable one, as in the tests, still finds it."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hvd_topk").rglob("__init__.py")}
    assert found == listed, (sorted(found - listed), sorted(listed - found))
