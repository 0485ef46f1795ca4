"""Maps the top-level folders onto one distribution's subpackages.

``server/`` -> ``kvscale.server``, ``kernels/`` -> ``kvscale.kernels``,
``operator/`` -> ``kvscale.operator``; nothing is importable as a top-level
``server``, ``kernels`` or ``operator`` (the last would shadow the stdlib).
"""

from setuptools import find_packages, setup

SUBPACKAGES = {"server": "server", "kernels": "kernels", "operator": "operator"}

packages = ["kvscale"]
package_dir = {"kvscale": "kvscale"}
for name, folder in SUBPACKAGES.items():
    packages.append(f"kvscale.{name}")
    package_dir[f"kvscale.{name}"] = folder
    for sub in find_packages(folder):
        packages.append(f"kvscale.{name}.{sub}")
        package_dir[f"kvscale.{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
