"""Package layout (metadata is in pyproject.toml).

conf/ and sweeps/ stay at the top of the repository and ship inside the wheel as harness/conf and
harness/sweeps (harness.config.paths finds either), so an installed lowp runs without a checkout.
hydra_plugins is a namespace package (no __init__.py) shared with the other Hydra plugins.
"""

from setuptools import find_namespace_packages, find_packages, setup

packages = find_packages(include=["harness", "harness.*", "analysis", "analysis.*"])
packages += find_namespace_packages(include=["hydra_plugins.*"], exclude=["*.__pycache__"])

setup(
    packages=[*packages, "harness.conf", "harness.sweeps"],
    package_dir={"harness.conf": "conf", "harness.sweeps": "sweeps"},
    package_data={"harness.conf": ["**/*.yaml"], "harness.sweeps": ["*.yaml"]},
    exclude_package_data={"harness.conf": ["local/*"]},  # site settings never leave the machine
)
