"""CI runs the tests marked `floor` on the lowest transformers that pyproject.toml declares (.ci/run): the floor it
installs is the one declared."""

import pytest
from packaging.requirements import Requirement

from tests.planted import REPO
from tools.transformers_floor import transformers_floor


def test_ci_installs_the_declared_transformers_floor():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    lines = [line.strip().strip('",') for line in text.splitlines()]
    requirement = next(Requirement(line) for line in lines if line.startswith("transformers"))
    declared = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    assert [transformers_floor(text)] == declared
    assert 'transformers==$floor"' in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def test_a_pyproject_without_a_transformers_floor_is_named():
    with pytest.raises(ValueError, match="declares no lower bound for transformers"):
        transformers_floor('dependencies = [\n    "transformers<6",\n]\n')
