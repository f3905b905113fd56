"""hippie-ds: declarative pipeline-parallel schedules (Hippie and others) for DeepSpeed.

The built-in schedule files live in the repository's top-level ``schedules/`` directory and are
installed as the data-only package ``hippie_ds._builtin_schedules`` (see
``hippie_ds.schedules.spec.builtin_dir``). ``configs/`` and ``tools/`` stay in the repository.
"""

import os

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

BUILTIN_SCHEDULES = "hippie_ds._builtin_schedules"


class BuildPy(build_py):
    """Give the installed schedule package an ``__init__.py``.

    ``schedules/`` has none (it is a data directory, not code). Without one the installed copy is a
    namespace package, and ``importlib.resources.files()`` of a namespace package is a
    ``MultiplexedPath`` that cannot be turned into a plain directory path.
    """

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, *BUILTIN_SCHEDULES.split("."), "__init__.py")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write('"""Built-in schedule files of hippie-ds (an installed copy of the repository\'s schedules/)."""\n')


# find_namespace_packages also finds hippie_ds and its sub-packages while they have no __init__.py.
packages = find_namespace_packages(include=["hippie_ds", "hippie_ds.*"], exclude=["*.__pycache__"])

setup(
    name="hippie-ds",
    version="0.1.0",
    description="Declarative pipeline-parallel schedules (Hippie, 1F1B, GPipe) for DeepSpeed",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages + [BUILTIN_SCHEDULES],
    package_dir={BUILTIN_SCHEDULES: "schedules"},
    package_data={BUILTIN_SCHEDULES: ["*.yaml"]},
    include_package_data=False,
    install_requires=[
        # hippie-ds subclasses DeepSpeed's pipeline engine internals: the releases that have all of
        # them (hippie_ds/_compat.py, SEAMS and REQUIREMENT; tests/compat/test_seams.py checks both).
        "deepspeed>=0.19.8,<0.20",
        "torch>=2.1",
        "pydantic>=2,<3",
        "pyyaml>=6",
        "matplotlib>=3.5",
        "tqdm>=4",  # progress bars (hippie-ds profile, the examples); DeepSpeed needs it too
    ],
    # ruff pinned: a new release may add findings to the rules pyproject.toml selects, and `make test` runs it
    extras_require={"test": ["pytest", "scikit-learn", "ruff==0.17.5"], "examples": ["scikit-learn"]},
    entry_points={"console_scripts": ["hippie-ds = hippie_ds.cli:main"]},
    cmdclass={"build_py": BuildPy},
)
