"""The research library never imports the platform's dependencies (DESIGN.md, three layers)."""

import subprocess
import sys


def test_importing_icr_imports_no_ray_optuna_mlflow_or_studies():
    code = (
        "import pkgutil, importlib, sys, icr\n"
        "for m in pkgutil.walk_packages(icr.__path__, 'icr.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in {'ray', 'optuna', 'mlflow', 'studies'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
