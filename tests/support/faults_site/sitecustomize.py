"""Installs the planted test faults (tests/support/faults.py) in a Python process started with this
folder first on PYTHONPATH and NITRO_TEST_FAULTS set; does nothing otherwise."""

import os

if os.environ.get("NITRO_TEST_FAULTS"):
    import importlib.util

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "faults.py")
    _spec = importlib.util.spec_from_file_location("nitro_test_faults", _path)
    _faults = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_faults)
    _faults.install_planted()
