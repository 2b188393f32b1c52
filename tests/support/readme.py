"""The README's runnable files, as the tests that run them read them."""

import re

from mpi import REPO


def readme_python_block(heading):
    """The first ```python block under the README's ``## heading`` (before the next ``## ``)."""
    text = (REPO / "README.md").read_text()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)
