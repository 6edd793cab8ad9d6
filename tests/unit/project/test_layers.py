"""The folders are layers: `policies` ← `hub/accounting` ← `spawner` ← `hub` and `mlflow` (DESIGN.md).

A lower layer never imports a higher one. The import graph is read from the source files with `ast` (every
`import`, those inside functions too), so an import that runs only on some path counts like any other.
Also here: the folders cannot be imported under their folder names (a second copy of every module), and the
MLflow run-context plugin registers whatever is imported first.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

#: Folder → import name (setup.cfg's package_dir).
PACKAGES = {"policies": "gpupool.policies", "hub": "gpupool.hub", "spawner": "gpupool.spawner",
            "mlflow": "gpupool.mlflow", "train": "gpupool.train", "images": "gpupool.images"}

#: Layer of each module, by the longest matching module prefix; a module may import its own layer and lower.
#: `hub` and `mlflow` are the top layer side by side.
LAYERS = {
    # The checkpoint helper runs inside users' jobs and notebooks: it needs no other part of gpupool.
    "gpupool.train": -1,
    # The images' lock files and the fine-tuning templates (data; the templates run in users' jobs, on train).
    "gpupool.images": -1,
    "gpupool.policies": 0,
    "gpupool.hub.accounting": 1,
    "gpupool.spawner": 2,
    "gpupool.hub": 3,
    "gpupool.mlflow": 3,
}
LAYER_NAMES = {-1: "train/images", 0: "policies", 1: "hub/accounting", 2: "spawner", 3: "hub/mlflow"}
#: What `policies/` (the rules and the pure decisions) may not import: databases, networks, processes, engines.
IO_LIBRARIES = ("sqlalchemy", "alembic", "psycopg", "requests", "urllib", "http", "socket", "subprocess", "asyncio",
                "tornado", "aiohttp", "kubernetes", "kubernetes_asyncio", "kubespawner", "jupyterhub", "mlflow",
                "psutil", "pynvml", "dvc", "boto3", "selenium")


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    file: Path
    line: int
    imported: str  # absolute module name (for `from X import y`: X, and X.y when that is a module)


def module_name(file: Path, root: Path = ROOT) -> tuple[str, bool]:
    """The import name of a source file, and whether it is a package's `__init__`."""
    folder, *rest = file.relative_to(root).with_suffix("").parts
    parts = [p for p in rest if p != "__init__"]
    return ".".join([PACKAGES[folder], *parts]), file.name == "__init__.py"


def imports_of(file: Path, root: Path = ROOT) -> list[Import]:
    """Every import in `file` of a gpupool module, relative ones resolved, at any depth of the syntax tree."""
    name, is_package = module_name(file, root)
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found += [Import(name, file, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from gpupool.spawner import pool` imports the module gpupool.spawner.pool
            submodules = [f"{module}.{a.name}" for a in node.names if is_module(f"{module}.{a.name}", root)]
            found += [Import(name, file, node.lineno, m) for m in submodules or [module]]
    return found


def is_module(name: str, root: Path = ROOT) -> bool:
    """Whether `name` is a gpupool module or package (rather than a name defined in one)."""
    for folder, package in PACKAGES.items():
        if name == package or name.startswith(package + "."):
            path = root / folder / Path(*name.removeprefix(package).lstrip(".").split("."))
            return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or path.is_dir()
    return False


def layer_of(module: str) -> int | None:
    """The layer of a gpupool module (or of a name inside one), None for anything else."""
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return LAYERS[max(matches, key=len)] if matches else None


def source_files(root: Path = ROOT) -> list[Path]:
    return sorted(f for folder in PACKAGES for f in (root / folder).rglob("*.py") if "__pycache__" not in f.parts)


def upward_imports(root: Path = ROOT) -> list[str]:
    """`file:line: importer (layer) imports imported (higher layer)` for each import against the layering."""
    offences = []
    for file in source_files(root):
        for found in imports_of(file, root):
            mine, theirs = layer_of(found.importer), layer_of(found.imported)
            if mine is not None and theirs is not None and theirs > mine:
                offences.append(f"{found.file.relative_to(root)}:{found.line}: {found.importer} "
                                f"({LAYER_NAMES[mine]}) imports {found.imported} ({LAYER_NAMES[theirs]})")
    return sorted(set(offences))


def folder_name_imports(root: Path = ROOT) -> list[str]:
    """Imports of gpupool's folders by their folder names (`from spawner import …`), which load second copies."""
    offences = []
    for file in source_files(root):
        for found in imports_of(file, root):
            if found.imported.split(".")[0] in ("hub", "spawner", "policies", "train"):
                offences.append(f"{file.relative_to(root)}:{found.line}: imports {found.imported}")
    return sorted(set(offences))


def test_a_lower_layer_never_imports_a_higher_one():
    assert upward_imports() == []


def io_imports(root: Path = ROOT) -> list[str]:
    """`file:line: imports X` for each import of an I/O library (`IO_LIBRARIES`) in `policies/`."""
    offences = []
    for file in sorted((root / "policies").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            offences += [(str(file.relative_to(root)), node.lineno, name) for name in names
                         if name.split(".")[0] in IO_LIBRARIES]
    return [f"{file}:{line}: imports {name}" for file, line, name in sorted(offences)]


def test_the_rules_and_decisions_import_no_io_library(tmp_path):
    assert io_imports() == []
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "admission.py").write_text("import math\ndef f():\n    import sqlalchemy.orm\n"
                                                       "from http.client import HTTPConnection\n")
    assert io_imports(tmp_path) == ["policies/admission.py:3: imports sqlalchemy.orm",
                                    "policies/admission.py:4: imports http.client"]


def test_the_folders_are_imported_by_their_package_names_only():
    assert folder_name_imports() == []


def test_every_module_has_a_layer():
    assert [f for f in source_files() if layer_of(module_name(f)[0]) is None] == []


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The checker itself: an upward import in a function body, a relative one, and a permitted one."""
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "hub" / "accounting").mkdir()
    (tmp_path / "policies" / "model.py").write_text(
        "def late():\n    from gpupool.spawner.pool import place\n    return place\n")
    (tmp_path / "hub" / "accounting" / "ledger.py").write_text("from ..config import Settings\n")
    (tmp_path / "spawner" / "local.py").write_text("from gpupool.hub.accounting import ledger\n"
                                                   "import gpupool.policies.model\n")
    (tmp_path / "mlflow" / "auth.py").write_text("from gpupool.hub import __version__\n")
    (tmp_path / "spawner" / "kube.py").write_text("from gpupool.hub import config\n")
    (tmp_path / "hub" / "config.py").write_text("from gpupool.spawner import local\n")
    assert upward_imports(tmp_path) == [
        "hub/accounting/ledger.py:1: gpupool.hub.accounting.ledger (hub/accounting) imports gpupool.hub.config "
        "(hub/mlflow)",
        "policies/model.py:2: gpupool.policies.model (policies) imports gpupool.spawner.pool (spawner)",
        "spawner/kube.py:1: gpupool.spawner.kube (spawner) imports gpupool.hub.config (hub/mlflow)",
    ]
    (tmp_path / "spawner" / "kube.py").write_text("from spawner import pool\n")
    assert folder_name_imports(tmp_path) == ["spawner/kube.py:1: imports spawner"]


def _python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    return subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("folder", ["hub", "spawner", "policies", "train"])
def test_a_folder_cannot_be_imported_by_its_folder_name(folder):
    """From the repository root a folder is importable as a top-level package: a second copy, refused."""
    done = _python(f"import {folder}")
    assert done.returncode != 0
    assert f"ImportError: {folder!r} is gpupool's {folder}/ folder imported by its folder name: " \
           f"import gpupool.{folder} instead" in done.stderr, done.stderr[-2000:]
    # and the package itself, from the same place, is the one copy
    done = _python(f"import gpupool.{folder}, sys; print(gpupool.{folder}.__file__); "
                   f"print(sorted(m for m in sys.modules if m.split('.')[0] == {folder!r}))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [str(ROOT / folder / "__init__.py"), "[]"]


def test_mlflow_from_the_repository_root_is_the_real_mlflow():
    """`mlflow/` has no `__init__.py`: from the root, `import mlflow` is MLflow, never gpupool's folder."""
    done = _python("import mlflow, gpupool.mlflow.run_context as r; print(mlflow.__file__); print(r.__file__)")
    assert done.returncode == 0, done.stderr[-2000:]
    mlflow_file, plugin_file = done.stdout.splitlines()
    assert not Path(mlflow_file).is_relative_to(ROOT / "mlflow") and Path(mlflow_file).name == "__init__.py"
    assert plugin_file == str(ROOT / "mlflow" / "run_context.py")
    assert _python("import mlflow.run_context").returncode != 0, "gpupool's plugin is not reachable as mlflow.*"


PROVIDERS = """
from mlflow.tracking.context.registry import _run_context_provider_registry, resolve_tags
print([type(p).__qualname__ for p in _run_context_provider_registry].count("GPUPoolRunContext"))
print(resolve_tags().get("gpupool.team"))
"""


@pytest.mark.parametrize("first", [
    "import gpupool.mlflow.run_context",  # the plugin first: MLflow loads its entry point while it imports
    "import mlflow",  # MLflow first: its registry imports the plugin
    "import mlflow.tracking.context.registry",
    "import gpupool.mlflow.auth",  # the MLflow app first (it imports MLflow)
])
def test_the_run_context_plugin_registers_in_any_import_order(first, tmp_path):
    env = {"GPUPOOL_TEAM": "vision"}
    code = f"import os; os.environ.update({env!r})\n{first}\n{PROVIDERS}"
    done = _python(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["1", "vision"], done.stdout
    assert "partially initialized" not in done.stderr and "circular import" not in done.stderr, done.stderr
    assert "Failure attempting to register context provider" not in done.stderr, done.stderr


# --- the spawner subclasses hold their backend only ---------------------------------------------------------

#: What both spawners do, and the one place it is written (spawner/mixin.py).
SHARED = {
    'env["GPUPOOL_TEAM"] = choice.team': "the choice's GPUPOOL_* environment (GPUPoolSpawnerMixin.get_env)",
    'state["choice"]': "the choice across hub restarts (GPUPoolSpawnerMixin.get_state / load_state)",
    "_apply_choice(self, self.user_options)": "the check when apply_user_options was skipped (ensure_choice)",
    "base + (self.policy.queue_timeout": "the start timeout widened by the queue's (queued_start_timeout)",
}


@pytest.mark.parametrize("subclass", ["local", "kube"])
def test_what_both_spawners_do_is_written_once_in_the_mixin(subclass):
    source = (ROOT / "spawner" / f"{subclass}.py").read_text()
    mixin = (ROOT / "spawner" / "mixin.py").read_text()
    again = {what: where for what, where in SHARED.items() if what in source}
    assert again == {}, f"spawner/{subclass}.py repeats what the mixin does: {again}"
    assert all(what in mixin for what in SHARED)


# --- unit and end-to-end tests apart -------------------------------------------------------------------------


def test_the_test_harness_is_the_tests_not_the_products():
    # The harness drives a whole `gpupool up` for the end-to-end tests and the benchmarks: it is not shipped
    assert (ROOT / "tests" / "harness.py").is_file() and not (ROOT / "hub" / "harness.py").exists()
    assert not [f"{found.file.relative_to(ROOT)}:{found.line}" for file in source_files()
                for found in imports_of(file) if found.imported.startswith("gpupool.hub.harness")]


def test_the_kind_of_a_test_is_its_folder():
    tests = ROOT / "tests"
    modules = {path.relative_to(tests) for path in tests.rglob("test_*.py")}
    assert modules and all(path.parts[0] in {"unit", "e2e"} for path in modules), sorted(
        str(path) for path in modules if path.parts[0] not in {"unit", "e2e"})
    layers = {"policies", "accounting", "spawner", "hub", "mlflow", "train", "project"}
    assert {path.parts[1] for path in modules if path.parts[0] == "unit"} <= layers
    # a unit test starts no hub: the harness (a hub with its proxy and services) is for tests/e2e/ only
    starts_a_hub = sorted(str(path) for path in modules if path.parts[0] == "unit"
                          and re.search(r"^\s*(from|import) harness\b", (tests / path).read_text(), re.M))
    assert starts_a_hub == []


def test_test_modules_import_no_other_test_module():
    # --import-mode=importlib gives test modules no importable names: what two modules share is a support
    # module in tests/ (pythonpath), or an import that works in one order of collection and fails in another
    tests = ROOT / "tests"
    imports = sorted(f"{path.relative_to(tests)}: {match.group(0).strip()}" for path in tests.rglob("test_*.py")
                     for match in re.finditer(r"^\s*(from|import)\s+(\S+\.)?test_\w+", path.read_text(), re.M))
    assert imports == []


def test_end_to_end_tests_are_marked_by_their_folder(request):
    e2e = [item for item in request.session.items if item.get_closest_marker("e2e")]
    unit = [item for item in request.session.items if not item.get_closest_marker("e2e")]
    assert all("tests/unit/" in str(item.path) for item in unit), [item.nodeid for item in unit][:5]
    assert all("tests/e2e/" in str(item.path) or "postgresql" in item.keywords
               or {"postgres_server", "s3_server"} & set(item.fixturenames) for item in e2e)
