"""Maps the top-level folders onto one distribution's subpackages.

``server/`` -> ``kvscale.server``, ``kernels/`` -> ``kvscale.kernels``,
``operator/`` -> ``kvscale.operator``, ``router/`` -> ``kvscale.router``; nothing is
importable as a top-level ``server``, ``kernels``, ``operator`` or ``router`` (operator
would shadow the stdlib).
"""

from setuptools import find_packages, setup

SUBPACKAGES = {
    "server": "server",
    "kernels": "kernels",
    "operator": "operator",
    "router": "router",
}

packages = ["kvscale"]
package_dir = {"kvscale": "kvscale"}
for name, folder in SUBPACKAGES.items():
    packages.append(f"kvscale.{name}")
    package_dir[f"kvscale.{name}"] = folder
    for sub in find_packages(folder):
        packages.append(f"kvscale.{name}.{sub}")
        package_dir[f"kvscale.{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

# C sources built at first use (kvscale.server.native_build)
package_data = {"kvscale.server.spec_decode": ["*.c"]}
setup(packages=packages, package_dir=package_dir, package_data=package_data)
