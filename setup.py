"""The package layout of the build; every other setting (name, dependencies, extras, scripts)
is in pyproject.toml.

Why a setup.py: pyproject.toml alone can either list the packages by hand, which silently drops
any package folder added later (lctrain/rundir and lctrain/prepare were once missing from the
wheel), or find them with [tool.setuptools.packages.find], which cannot add packages from the
root folders conf/ and recipes/ (they ship inside the package as lctrain.conf and
lctrain.recipes, where lctrain/config/paths.py looks for them). Here find_packages finds every
lctrain.* folder with an __init__.py, and the two root folders are mapped beside them.
tests/test_packaging.py checks that no package folder is missed and builds and installs the
wheel.
"""

from setuptools import find_packages, setup

ROOT_FOLDERS = {"lctrain.conf": "conf", "lctrain.recipes": "recipes"}

setup(
    packages=[*find_packages(include=["lctrain", "lctrain.*"]), *ROOT_FOLDERS],
    package_dir=ROOT_FOLDERS,
    package_data={
        "lctrain.conf": ["*.yaml", "*/*.yaml"],  # config.yaml and model/*.yaml
        "lctrain.recipes": ["*.yaml"],
        "lctrain.commands": ["templates/*"],  # the sbatch scripts lctrain submit renders
    },
)
