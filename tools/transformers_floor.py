"""Print the lowest transformers release that pyproject.toml allows (`transformers>=X`), e.g. `5.17`: CI installs it
and runs the tests marked `floor` on it, so the declared range is a tested range."""

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def transformers_floor(pyproject: str) -> str:
    """X of the `"transformers>=X..."` requirement in the text of a pyproject.toml; ValueError when there is none."""
    match = re.search(r'^\s*"transformers\s*>=\s*([0-9][0-9.]*)[,"]', pyproject, re.MULTILINE)
    if match is None:
        raise ValueError(f'{PYPROJECT} declares no lower bound for transformers (a line such as "transformers>=5.17")')
    return match.group(1)


if __name__ == "__main__":
    try:
        print(transformers_floor(PYPROJECT.read_text(encoding="utf-8")))
    except ValueError as error:
        sys.exit(str(error))
