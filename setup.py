"""fedml-fedmitr: FedMITR (one-shot federated learning for ViTs) as a FedML 0.9.6 plugin.

    pip install torch==2.14.1 torchvision==0.29.1   # or the torch build for your machine
    pip install -e ".[mpi,dev]"                     # mpi: an MPI from PyPI (mpich); dev: pytest
"""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
version = "0.1.0"
for line in (ROOT / "fedml_fedmitr" / "__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        version = line.split("=", 1)[1].strip().strip("\"'")

readme = ROOT / "README.md"

setup(
    name="fedml-fedmitr",
    version=version,
    description="FedMITR one-shot federated learning for Vision Transformers, as a FedML 0.9.6 plugin",
    long_description=readme.read_text() if readme.exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fedml_fedmitr", "fedml_fedmitr.*"]),
    python_requires=">=3.9",
    install_requires=[
        "fedml==0.9.6",
        "setuptools<81",        # fedml 0.9.6 imports pkg_resources
        "numpy<2",              # fedml 0.9.6's pin
        "sentry-sdk<3",         # fedml 0.9.6 pins wandb 0.13.2, whose import calls sentry_sdk.Hub (gone in 3.0)
        "torch>=2.1",
        "torchvision>=0.16",
        "timm>=0.9",
        "mpi4py>=3.1",
        "grpcio",
        "pyyaml",
        "scikit-learn",          # the digits dataset of the demo
        "tqdm",
        "matplotlib",
        "tensorboard",
    ],
    extras_require={
        # an MPI implementation from PyPI; a cluster keeps its own MPI (mpi4py finds it)
        "mpi": ["mpich"],
        "dev": ["pytest", "ruff"],
    },
    entry_points={"console_scripts": ["fedml-fedmitr=fedml_fedmitr.cli:main"]},
)
