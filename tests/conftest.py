import os
from pathlib import Path

# Triton kernels run on the CPU only in the interpreter, and the variable must be set before
# any module that defines a kernel is imported. Tests never have a GPU here; a GPU run of the
# kernels goes through bench/, not through the unit tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
