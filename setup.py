"""What goes into the wheel; the rest of the metadata is in pyproject.toml.

Every package under attngen/ is found (a new family folder needs no entry here), and the
template tree and the manifests live outside attngen/ in the checkout, so they are mapped into
the package and shipped whole: every file under templates/, whatever its name or folder
(tests/test_wheel.py compares the built wheel with the tree).
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["attngen", "attngen.*"]) + ["attngen.templates", "attngen.manifests"],
    package_dir={"attngen.templates": "templates", "attngen.manifests": "cache"},
    package_data={"attngen.templates": ["**/*"], "attngen.manifests": ["*.toml"]},
)
