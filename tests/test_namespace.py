"""openprime is a PEP 420 namespace: a stray __init__.py at its root in any package breaks the others."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _package_roots() -> list[Path]:
    return sorted(p.parent for p in ROOT.glob("*/*/pyproject.toml")) + sorted(
        p.parent for p in ROOT.glob("*/pyproject.toml") if p.parent != ROOT
    )


def test_packages_exist():
    names = {p.name for p in _package_roots()}
    assert {"core", "diloco", "train", "gloo"} <= names, names


def test_no_init_in_namespace_dirs():
    strays = []
    for pkg in _package_roots():
        for ns in (pkg / "src" / "openprime", pkg / "src" / "openprime" / "transports"):
            if (ns / "__init__.py").exists():
                strays.append(str((ns / "__init__.py").relative_to(ROOT)))
    assert not strays, f"remove these: openprime is a PEP 420 namespace package: {strays}"


def test_every_package_has_its_own_module_and_tests():
    for pkg in _package_roots():
        assert (pkg / "README.md").exists(), pkg
        assert (pkg / "tests").is_dir(), pkg
        modules = [p for p in (pkg / "src" / "openprime").rglob("__init__.py")]
        assert modules, f"{pkg} has no openprime.<name> module"


def test_test_file_names_are_unique():
    seen: dict[str, Path] = {}
    # The directories pytest collects (pyproject's testpaths), not ROOT: walking the .venv below it took 10 s.
    paths = [path for top in ("packages", "transports", "kernels", "tests") for path in (ROOT / top).rglob("test_*.py")]
    assert len(paths) > 30, paths
    for path in paths:
        assert path.name not in seen, f"{path} and {seen[path.name]} share a name (importlib mode needs unique)"
        seen[path.name] = path
