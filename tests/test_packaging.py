"""The package as pip builds it, against the source tree: every folder of lctrain/ that holds
Python files is a package that setup.py's finder returns (asked of setuptools' own reading of
setup.py and pyproject.toml), every other file there and every yaml of conf/ and recipes/ is
package data; and the built wheel, installed non-editable into a new virtual environment (its
dependencies this environment's), holds every such file, imports from that environment and
trains the tiny recipe from a folder outside the repository."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the build reads: setup.py and pyproject.toml, the README (the long description) and the
# three folders the packages come from. The wheel is built from a copy of these, so that the
# build neither writes build/ and *.egg-info into the checkout nor picks up a stale build/.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "lctrain", "conf", "recipes")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}

# setuptools' own reading of the build configuration (setup.py with pyproject.toml applied), in a
# fresh interpreter so that setuptools' distutils is the one imported
READ_CONFIG = """
import json, setuptools
from distutils.core import run_setup
dist = run_setup("setup.py", stop_after="config")
print(json.dumps({"packages": dist.packages, "package_dir": dist.package_dir or {},
                  "package_data": dist.package_data or {}}))
"""


def source_files(folder: str) -> list[Path]:
    """The files of a folder that git tracks or would track (new ones too; not the ignored
    __pycache__ and build outputs)."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z",
                            folder], cwd=REPO, capture_output=True, text=True, check=True,
                           timeout=60).stdout.split("\0")
    return sorted(REPO / name for name in names if name and (REPO / name).is_file())


def expected_wheel_files() -> dict[str, Path]:
    """Path inside the wheel -> source file: lctrain/ as it is, conf/ and recipes/ under lctrain/."""
    files = {str(p.relative_to(REPO)): p for p in source_files("lctrain")}
    for folder in ("conf", "recipes"):
        files.update({f"lctrain/{p.relative_to(REPO)}": p for p in source_files(folder)
                      if p.suffix == ".yaml"})
    assert len(files) > 100, f"git lists only {len(files)} files of lctrain/, conf/, recipes/"
    return files


@pytest.fixture(scope="module")
def build_config():
    done = subprocess.run([sys.executable, "-c", READ_CONFIG], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def package_folder(name: str, package_dir: dict) -> Path:
    return REPO / package_dir.get(name, name.replace(".", "/"))


def test_every_package_folder_is_found(build_config):
    packages = set(build_config["packages"])
    folders = sorted({p.parent for p in expected_wheel_files().values() if p.suffix == ".py"})
    for folder in folders:
        name = ".".join(folder.relative_to(REPO).parts)
        assert (folder / "__init__.py").is_file(), (
            f"{folder.relative_to(REPO)}/ holds Python files but no __init__.py: "
            "setup.py's find_packages skips it and the wheel would lack it")
        assert name in packages, f"{name} is missing from the packages setup.py gives the build"
    assert {"lctrain.conf", "lctrain.recipes"} <= packages, "conf/ and recipes/ must ship"
    for name in packages:
        folder = package_folder(name, build_config["package_dir"])
        assert (folder / "__init__.py").is_file() or name in ("lctrain.conf", "lctrain.recipes"), (
            f"{name} is built from {folder}, which is not a package")


def test_every_data_file_is_package_data(build_config):
    """Each file that is not Python, under lctrain/ and the yaml files of conf/ and recipes/,
    matches a package_data pattern of its package (setuptools globs them the same way)."""
    package_dir = build_config["package_dir"]
    shipped = set()
    for name, patterns in build_config["package_data"].items():
        folder = package_folder(name, package_dir)
        shipped |= {p for pattern in patterns for p in folder.glob(pattern) if p.is_file()}
    data = [p for p in expected_wheel_files().values() if p.suffix != ".py"]
    assert data, "no data files found: conf/, recipes/ and lctrain/commands/templates/"
    missing = sorted(str(p.relative_to(REPO)) for p in data if p not in shipped)
    assert missing == [], f"not package data, so missing from the wheel: {missing}"


def run(args, **kwargs):
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, (
        f"{' '.join(map(str, args))} exited {done.returncode}:\n"
        f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done


@pytest.mark.slow  # 20 s on 2 cores: the wheel's build and install
def test_wheel_installs_and_trains_outside_the_repository(tmp_path):
    """The wheel installed non-editable into a new virtual environment whose path ends with
    this environment's site-packages (a .pth line, so none of the .pth files there run, the
    editable lctrain's among them): its dependencies resolve without a download. CI installs
    them from nothing into a fresh one (.ci/run)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", source, "--no-deps", "-w", dist], timeout=600)
    wheel, = dist.glob("lctrain-*.whl")
    contents = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(set(expected_wheel_files()) - contents)
    assert missing == [], f"the wheel lacks {missing}"

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=300)
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    timeout=60).stdout.strip())
    here = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    (site / "zz_dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(here)))
    # the wheel alone (--ignore-installed: the editable lctrain is visible too), never a
    # download; then every installed requirement checked, the wheel's own among them
    run([python, "-m", "pip", "install", "--no-index", "--ignore-installed", "--no-deps", wheel],
        timeout=600)
    run([python, "-m", "pip", "check"], timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OFFLINE, VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    where = run([python, "-c", "import lctrain, json; from lctrain.config import paths; "
                 "print(json.dumps([lctrain.__file__, str(paths.conf_dir()), "
                 "str(paths.recipes_dir())]))"], cwd=elsewhere, env=env, timeout=300)
    for path in map(Path, json.loads(where.stdout.splitlines()[-1])):
        assert path.resolve().is_relative_to(venv.resolve()), f"{path} is outside the venv"
        assert not path.resolve().is_relative_to(REPO), f"{path} is in the repository"

    run_dir = tmp_path / "run"
    run([venv / "bin" / "lctrain", "train", "+recipe=tiny", "train.steps=2",
         f"hydra.run.dir={run_dir}"], cwd=elsewhere, env=env, timeout=600)
    # the tiny recipe logs every 10 steps and always the last one
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2], records
