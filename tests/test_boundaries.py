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


def test_torchvision_is_imported_only_where_a_resnet_is_built():
    """Importing torchvision imports all of it, torch._dynamo included (1.5 to 3.9 CPU seconds on
    these machines): no module of the library or the platform imports it, so the command line,
    the driver and every trial's process start without it (benchmarks/process_start.py); random
    erasing is the project's own (icr.data.images) and the ResNet builders import it when
    called."""
    code = (
        "import pkgutil, importlib, sys, icr, studies, torch\n"
        "for package in (icr, studies):\n"
        "    for m in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        if not m.name.endswith('__main__'):\n"
        "            importlib.import_module(m.name)\n"
        "print('torchvision' in sys.modules, 'torch._dynamo' in sys.modules)\n"
        "from icr.data.images import erase\n"
        "erased = erase(torch.ones(1, 3, 16, 16), torch.tensor([[2, 3, 4, 5]]))\n"
        "print('torchvision' in sys.modules, bool((erased == 0).any()), bool((erased == 1).any()))\n"
        "from icr.models.image import resnet18\n"
        "resnet18()\n"
        "print('torchvision' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False", "True", "True", "True"]
