"""Package layout: the repository's folders show the architecture, installed they form
one `llmserve` package (services/router -> llmserve.router, and so on)."""

from setuptools import find_packages, setup

PACKAGE_ROOTS = {
    "llmserve": "llmserve",
    "llmserve.router": "services/router",
    "llmserve.scheduler": "services/scheduler",
    "llmserve.worker": "services/worker",
    "llmserve.kernels": "kernels",
}


def all_packages() -> list[str]:
    packages = []
    for name, path in PACKAGE_ROOTS.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(path)]
    return packages


setup(
    package_dir=PACKAGE_ROOTS,
    packages=all_packages(),
    # C++ sources built on first use by torch's extension builder.
    package_data={"llmserve.worker": ["cpu_kernels/csrc/*.cpp"]},
)
