"""fastpersist.integrations: importing fastpersist never imports a framework."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers",
              "accelerate", "torchtitan", "deepspeed")


def test_importing_fastpersist_imports_no_framework() -> None:
    code = (
        "import sys, fastpersist, fastpersist.integrations\n"
        "fastpersist.save, fastpersist.async_save, fastpersist.Checkpointer\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"
