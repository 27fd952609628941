"""The scheduler service never needs torch: block management is plain Python."""

import subprocess
import sys


def test_scheduler_package_imports_without_torch():
    code = (
        "import sys, llmserve.scheduler.scheduler, llmserve.scheduler.service;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
