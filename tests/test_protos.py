"""The committed generated protobuf modules must match protos/."""

import subprocess
import sys


def test_generated_protobuf_modules_are_fresh():
    result = subprocess.run([sys.executable, "-m", "llmserve.protogen", "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
