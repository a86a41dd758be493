"""Print the requirements of one extra of pyproject.toml: the core's dependencies and the extra's.

The Dockerfile installs them before it copies the sources, so that the dependency layer stays
cached while the sources change.  Usage: python requirements-of.py EXTRA < pyproject.toml
"""

import sys
import tomllib

project = tomllib.load(sys.stdin.buffer)["project"]
print(*project["dependencies"], *project["optional-dependencies"][sys.argv[1]], sep="\n")
