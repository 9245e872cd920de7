"""Packaging: every folder setuptools would ship is a package it was told about.

setuptools warns ("Package would be ignored") for a folder inside a package that holds
files but is not listed in ``packages``; ``pip install .`` and ``make demo`` must print no
such warning (issue 16). Checked from ``pyproject.toml`` and the tree, without a build.
"""
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Folders of a package that are not shipped (generated results, caches).
NOT_SHIPPED = {"__pycache__", "results"}


def _config():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["tool"]["setuptools"]


def _folder(package: str, package_dir: dict) -> str:
    for prefix in sorted(package_dir, key=len, reverse=True):
        if package == prefix or package.startswith(prefix + "."):
            rest = package[len(prefix):].lstrip(".")
            return os.path.join(ROOT, package_dir[prefix], *rest.split(".") if rest else [])
    return os.path.join(ROOT, *package.split("."))


def test_every_folder_with_files_is_a_listed_package():
    config = _config()
    packages, package_dir = set(config["packages"]), config.get("package-dir", {})
    unlisted = []
    for package in sorted(packages):
        folder = _folder(package, package_dir)
        assert os.path.isdir(folder), f"{package}: no folder {folder}"
        for entry in sorted(os.listdir(folder)):
            path = os.path.join(folder, entry)
            if not os.path.isdir(path) or entry in NOT_SHIPPED or entry.startswith("."):
                continue
            if any(not os.path.isdir(os.path.join(path, f)) for f in os.listdir(path)) \
                    and f"{package}.{entry}" not in packages:
                unlisted.append(f"{package}.{entry}")
    assert not unlisted, f"folders setuptools would warn about (add them to packages): {unlisted}"


def test_data_files_are_declared():
    config = _config()
    packages, package_dir = config["packages"], config.get("package-dir", {})
    data = config.get("package-data", {})
    undeclared = []
    for package in packages:
        folder = _folder(package, package_dir)
        for entry in os.listdir(folder):
            if entry.endswith((".toml", ".json")) and not any(
                    p == f"*{os.path.splitext(entry)[1]}" for p in data.get(package, [])):
                undeclared.append(f"{package}: {entry}")
    assert not undeclared, undeclared
